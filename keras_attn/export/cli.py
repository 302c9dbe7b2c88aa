"""`keras-attn export`: export a `.keras` model to SavedModel, TFLite and ONNX."""

import os
import sys

FORMATS = ("saved_model", "tflite", "onnx")
QUANTIZE = ("none", "float16", "dynamic", "int8")


def add_parser(subparsers):
    parser = subparsers.add_parser(
        "export",
        help="export a .keras model to SavedModel / TFLite / ONNX and verify it",
        description=__doc__,
    )
    parser.add_argument("model", help="path to a .keras file (loaded with safe_mode=True unless --unsafe-deserialization)")
    parser.add_argument("--format", default="all", choices=FORMATS + ("all",))
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--quantize",
        nargs="+",
        default=["none"],
        choices=QUANTIZE,
        help="TFLite variants to write (several allowed, e.g. none dynamic)",
    )
    parser.add_argument("--model-name", default=None, help="TF Serving model name")
    parser.add_argument("--version", type=int, default=1, help="TF Serving version")
    parser.add_argument("--opset", type=int, default=17, choices=(17, 18))
    parser.add_argument("--atol", type=float, default=None, help="parity tolerance")
    parser.add_argument("--min-agreement", type=float, default=None,
                        help="quantized TFLite: smallest fraction of argmax positions equal "
                             "to Keras's (default 0.99 float16, 0.95 dynamic, 0.9 int8)")
    parser.add_argument(
        "--unsafe-deserialization",
        action="store_true",
        help="allow Lambda layers and other arbitrary code in the model file "
        "(only for files you trust; off by default)",
    )
    return parser


def run(args):
    from keras_attn import export
    from keras_attn import saving

    if not os.path.isfile(args.model):
        print(f"error: no such model file: {args.model}", file=sys.stderr)
        return 2
    safe_mode = not args.unsafe_deserialization
    print(f"loading {args.model} (safe_mode={safe_mode})", flush=True)
    try:
        model = saving.load_model(args.model, safe_mode=safe_mode)
    except ValueError as error:
        print(f"error: cannot load {args.model}: {error}", file=sys.stderr)
        if safe_mode and "unsafe" in str(error).lower():
            print("  (only if you trust this file: --unsafe-deserialization)", file=sys.stderr)
        return 2
    name = args.model_name or os.path.splitext(os.path.basename(args.model))[0]
    formats = FORMATS if args.format == "all" else (args.format,)
    quantizations = [None if q == "none" else q for q in args.quantize]
    failed = 0
    for fmt in formats:
        for quant in quantizations if fmt == "tflite" else (None,):
            print(f"exporting {fmt}{f' ({quant})' if quant else ''} ...", flush=True)
            if quant == "int8":
                print("  int8: calibrating on random inputs from the input specs; "
                      "use export_tflite(representative_dataset=...) with real data")
            try:
                reports = export.export_all(
                    model, args.out, name=name, formats=(fmt,), tflite_quantizations=(quant,),
                    atol=args.atol, min_agreement=args.min_agreement, version=args.version, opset=args.opset, verbose=False,
                )
            except (export.ExportError, ValueError, OSError) as error:
                failed += 1
                print(f"  FAILED: {type(error).__name__}: {error}", file=sys.stderr)
                continue
            for report in reports.values():
                print(report, flush=True)
    return 1 if failed else 0
