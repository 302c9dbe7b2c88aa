"""`keras-attn export`: export a `.keras` model to SavedModel, TFLite and ONNX.

The flags are defined once, by the launcher (`keras_attn_cli._add_export_arguments`),
which parses them without importing TensorFlow; `run` reads them.
"""

import os
import sys

from keras_attn.export.report import FORMATS


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
    quantizations = {"tflite": [None if q == "none" else q for q in args.quantize],
                     "onnx": [None if q == "none" else q for q in args.onnx_quantize]}
    failed = 0
    for fmt in formats:
        for quant in quantizations.get(fmt, (None,)):
            print(f"exporting {fmt}{f' ({quant})' if quant else ''} ...", flush=True)
            if quant in ("int8", "int16x8"):
                print(f"  {quant}: calibrating on random inputs from the input specs; "
                      "use export_tflite(representative_dataset=...) with real data")
            try:
                reports = export.export_all(
                    model, args.out, name=name, formats=(fmt,),
                    tflite_quantizations=(quant if fmt == "tflite" else None,),
                    onnx_quantizations=(quant if fmt == "onnx" else None,),
                    atol=args.atol, min_agreement=args.min_agreement, measure=args.measure,
                    threshold=args.threshold, version=args.version, opset=args.opset, verbose=False,
                    check_ids=args.check_ids,
                )
            except (export.ExportError, ValueError, OSError) as error:
                failed += 1
                print(f"  FAILED: {type(error).__name__}: {error}", file=sys.stderr)
                continue
            for report in reports.values():
                print(report, flush=True)
    return 1 if failed else 0
