"""The `keras-attn` console script, and quiet logging for the CLI and examples.

This module sits outside the `keras_attn` package on purpose: importing
`keras_attn` imports Keras and TensorFlow (the layers register themselves for
deserialization on import), which takes seconds and prints TensorFlow's start-up
lines. Here only the standard library is imported until a command runs, so
`keras-attn --help` is instant, and the logging switches are set before
TensorFlow is imported, which is the only time they take effect.
"""

import argparse
import logging
import os
import sys
import warnings

VERBOSE_ENV = "KERAS_ATTN_VERBOSE"

# Libraries whose Python warnings are about their own internals (deprecations
# inside TensorFlow, tf2onnx, tfds, protobuf), not about the caller's code.
_NOISY_MODULES = r"(tensorflow|tf2onnx|onnx|tensorflow_datasets|google|absl|ai_edge_litert|jax|torch)(\..*)?"


def is_verbose():
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def _import_silently(name):
    """Imports `name` with the process's stderr (fd 2) captured.

    TensorFlow's C++ start-up lines (oneDNN notice, CUDA probing) are written
    before its logging is initialised, so no environment variable hides them.
    If the import fails, the captured text is printed with the error.
    """
    import importlib
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            importlib.import_module(name)
        except BaseException:
            os.dup2(saved, 2)
            captured.seek(0)
            sys.stderr.write(captured.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def quiet(verbose=None, import_tensorflow=True):
    """Hides TensorFlow/absl/tfds start-up and info logging; call before importing TF.

    Keeps our own prints, Keras progress bars, Python exceptions, and warnings
    raised about the caller's code. `verbose=True` (or the environment variable
    `KERAS_ATTN_VERBOSE=1`) leaves every log line as the libraries print it.
    With `import_tensorflow`, TensorFlow is imported here with its start-up
    lines captured. Returns whether output is verbose.
    """
    if verbose is None:
        verbose = is_verbose()
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
        return True
    # C++ logging (CUDA probing on machines without a GPU, XLA service lines,
    # oneDNN fallbacks): off. Failures still raise Python exceptions.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    os.environ.setdefault("ABSL_MIN_LOG_LEVEL", "2")
    for category in (DeprecationWarning, FutureWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=_NOISY_MODULES)
    # Python-side loggers of TensorFlow and tfds go through absl; absl is tiny
    # to import, TensorFlow's own logger is named "tensorflow".
    for name in ("tensorflow", "absl", "tensorflow_datasets", "tf2onnx", "h5py"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:
        pass
    if import_tensorflow and "tensorflow" not in sys.modules:
        _import_silently("tensorflow")
    return False


def _add_export_arguments(parser):
    """`keras-attn export` flags; `keras_attn.export.cli.run` reads them."""
    parser.add_argument("model", help="path to a .keras file (loaded with safe_mode=True "
                        "unless --unsafe-deserialization)")
    parser.add_argument("--format", default="all",
                        choices=("saved_model", "tflite", "onnx", "all"))
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--quantize", nargs="+", default=["none"],
                        choices=("none", "float16", "dynamic", "int8", "int16x8"),
                        help="TFLite variants to write (several allowed, e.g. none dynamic)")
    parser.add_argument("--onnx-quantize", nargs="+", default=["none"],
                        choices=("none", "dynamic"),
                        help="ONNX variants to write (several allowed, e.g. none dynamic: "
                             "int8 weights, activations quantized at run time)")
    parser.add_argument("--model-name", default=None, help="TF Serving model name")
    parser.add_argument("--version", type=int, default=1, help="TF Serving version")
    parser.add_argument("--opset", type=int, default=17, choices=(17, 18))
    parser.add_argument("--atol", type=float, default=None,
                        help="parity tolerance, an absolute bound (default: float32 rounding "
                             "at the magnitude of the outputs, see keras_attn/export/bounds.py)")
    parser.add_argument("--min-agreement", type=float, default=None,
                        help="quantized TFLite: smallest fraction of argmax positions equal "
                             "to Keras's (default 0.99 float16, 0.95 dynamic and int16x8, "
                             "0.9 int8)")
    parser.add_argument("--measure", default="auto",
                        choices=("auto", "argmax", "cosine", "relative_error"),
                        help="quantized TFLite and ONNX: how every output is compared with Keras "
                             "(auto: argmax for logits/scores, per-row cosine for "
                             "embeddings and hidden states, relative error otherwise)")
    parser.add_argument("--threshold", type=float, default=None,
                        help="quantized TFLite and ONNX: the minimum argmax agreement or cosine, or "
                             "the maximum relative error (default per quantization)")
    parser.add_argument("--check-ids", default=None, choices=("clamp", "flag"),
                        help="an out-of-range token id: by default SavedModel rejects the "
                             "request and TFLite/ONNX clamp it; 'clamp' or 'flag' (clamp and "
                             "add a boolean 'valid' output per row) for every format")
    parser.add_argument("--unsafe-deserialization", action="store_true",
                        help="allow Lambda layers and other arbitrary code in the model file "
                        "(only for files you trust; off by default)")


def build_parser():
    parser = argparse.ArgumentParser(
        prog="keras-attn",
        description="keras_attn: attention layers for Keras 3 that export everywhere.",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show TensorFlow/absl/tfds log lines (hidden by default)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the version")
    _add_export_arguments(sub.add_parser(
        "export", help="export a .keras model to SavedModel / TFLite / ONNX and verify it",
        description="Export a .keras model to SavedModel, TFLite and ONNX, each verified "
        "against Keras.",
    ))
    attention = sub.add_parser(
        "attention", help="draw every attention map of a .keras model for one input (PNG + HTML)",
        description="Run a .keras model once on the given tokens and write every attention "
        "map: attention_heads.png (layers x heads) and attention.html (offline explorer).",
    )
    attention.add_argument("model", help="path of a .keras model built with keras_attn layers")
    source = attention.add_mutually_exclusive_group(required=True)
    source.add_argument("--ids", help="token ids, e.g. 5,17,42")
    source.add_argument("--text", help="text, mapped to ids with --vocab")
    attention.add_argument("--vocab", help="with --text: a file with one token per line (line i = id i)")
    attention.add_argument("--split", choices=("words", "chars"), default="words",
                           help="with --text: split on whitespace or into characters")
    attention.add_argument("--out", default="outputs/attention", help="output folder")
    attention.add_argument("--unsafe-deserialization", action="store_true",
                           help="allow Lambda layers and other code in the model file (trusted files only)")
    sub.add_parser(
        "demo", add_help=False,
        help="the quickstart: train the dates Transformer, show attention, export "
        "(`keras-attn demo --help` lists its flags)",
    )
    return parser


def _version():
    """keras_attn.__version__, read from the source without importing TensorFlow."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("keras_attn")
    with open(spec.origin, encoding="utf-8") as handle:
        return re.search(r'^__version__ = "([^"]+)"', handle.read(), re.M).group(1)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    # `demo` owns its flags (its own --help); only options before it are ours.
    command = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if command is not None and argv[command] == "demo":
        at = command
        args = parser.parse_args(argv[:at + 1])
        quiet(args.verbose or None)
        from keras_attn.training import quickstart

        return quickstart.main(argv[at + 1:])
    args = parser.parse_args(argv)
    if args.command == "version":
        print(_version())
        return 0
    quiet(args.verbose or None)
    if args.command == "attention":
        from keras_attn.visualize import cli as attention_cli

        return attention_cli.run(args)
    from keras_attn.export import cli as export_cli

    return export_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
