"""The `keras-attn` console script."""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="keras-attn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the version")
    from keras_attn.export import cli as export_cli

    export_cli.add_parser(sub)
    sub.add_parser(
        "demo", add_help=False,
        help="the quickstart: train the dates Transformer, show attention, export "
        "(`keras-attn demo --help` lists its flags)",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:
        from keras_attn.training import quickstart

        return quickstart.main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "export":
        return export_cli.run(args)
    if args.command == "version":
        import keras_attn

        print(keras_attn.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
