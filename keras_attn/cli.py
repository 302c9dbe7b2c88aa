"""The `keras-attn` console script."""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="keras-attn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the version")
    from keras_attn.export import cli as export_cli

    export_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "export":
        return export_cli.run(args)
    if args.command == "version":
        import keras_attn

        print(keras_attn.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
