"""What each exported runtime does with each bad request: error, garbage or crash.

Exports a tiny `DecoderOnlyLM` (vocabulary 20, `max_length` 8) with the
prefill/decode signatures of `keras_attn.runtimes.signatures`, to SavedModel,
TFLite and ONNX, each with its request checks ("assert" for SavedModel,
"flag" for TFLite / ONNX) and without ("none"), then sends every bad request
of `REQUESTS` to every artifact. TFLite and ONNX Runtime probes run one per
subprocess, so a crash (a signal) is seen as one instead of killing this
script; SavedModel probes run in this process (TensorFlow raises). Prints the markdown table of docs/guides/serving_validation.md.

    python benchmarks/bench_serving_requests.py

Outcomes: `error: <type>: <message>`, `flagged` (the `valid` output is
False; ids/index were clamped into range), `garbage` (outputs returned, no
error, nothing flagged), `crash: ...` (the process died).
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

VOCAB = 20
MAX_LENGTH = 8
BATCH, PROMPT = 2, 4
PROMPT_IDS = np.array([[5, 6, 7, 0], [3, 4, 0, 0]], np.int32)

# name -> (signature, description)
REQUESTS = {
    "negative id": ("prefill", "token_ids holds -3"),
    "id >= vocab": ("prefill", f"token_ids holds {VOCAB} (vocabulary {VOCAB})"),
    "index = max_length": ("decode", f"index={MAX_LENGTH} (cache length {MAX_LENGTH})"),
    "negative index": ("decode", "index=-1"),
    "wrong dtype": ("prefill", "token_ids float32"),
    "wrong rank": ("prefill", "token_ids 1-D (4,)"),
    "prompt > max_length": ("prefill", f"token_ids (2, {MAX_LENGTH + 1})"),
}

RUNTIMES = ("saved_model", "tflite", "onnx")
CHECKS = {"saved_model": "assert", "tflite": "flag", "onnx": "flag"}


def request_inputs(name, cache):
    """`(signature, inputs)` of the bad request `name`; `cache` from a good prefill."""
    ids = PROMPT_IDS.copy()
    step = {"token_ids": ids[:, :1], "cache": cache}
    if name == "negative id":
        ids[0, 1] = -3
        return "prefill", {"token_ids": ids}
    if name == "id >= vocab":
        ids[0, 1] = VOCAB
        return "prefill", {"token_ids": ids}
    if name == "index = max_length":
        return "decode", dict(step, index=np.array(MAX_LENGTH, np.int32))
    if name == "negative index":
        return "decode", dict(step, index=np.array(-1, np.int32))
    if name == "wrong dtype":
        return "prefill", {"token_ids": ids.astype(np.float32)}
    if name == "wrong rank":
        return "prefill", {"token_ids": ids[0]}
    if name == "prompt > max_length":
        return "prefill", {"token_ids": np.ones((BATCH, MAX_LENGTH + 1), np.int32)}
    raise ValueError(f"Unknown request {name!r}")


# --------------------------------------------------------------------------
# Runners (imported in the probe subprocesses: no TensorFlow for TFLite/ONNX)


def _runner(runtime, path):
    """`{signature: fn(**numpy) -> {name: numpy}}` for one artifact."""
    if runtime == "tflite":
        from ai_edge_litert.interpreter import Interpreter

        interpreter = Interpreter(model_path=path)
        runners = {k: interpreter.get_signature_runner(k) for k in ("prefill", "decode")}
        return {k: (lambda r: lambda **kw: {n: np.asarray(v) for n, v in r(**kw).items()})(r)
                for k, r in runners.items()}
    if runtime == "onnx":
        import onnxruntime as ort

        def make(session):
            names = [o.name for o in session.get_outputs()]

            def run(**kw):
                values = session.run(None, kw)
                return {n.removesuffix("_out"): v for n, v in zip(names, values)}

            return run

        return {k: make(ort.InferenceSession(os.path.join(path, f"{k}.onnx"),
                                             providers=["CPUExecutionProvider"]))
                for k in ("prefill", "decode")}
    import tensorflow as tf

    loaded = tf.saved_model.load(path)

    def make(fn):
        def run(**kw):
            return {k: v.numpy() for k, v in fn(**{n: tf.constant(x) for n, x in kw.items()}).items()}

        return run

    runners = {k: make(loaded.signatures[k]) for k in ("prefill", "decode")}
    runners["_keep"] = loaded
    return runners


def _message(error):
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for key in ("assertion failed", "indices", "out of bounds", "got", "expected", "invalid",
                "failed"):
        for line in lines:
            if key in line.lower():
                return line[:160]
    return (lines[0] if lines else "")[:160]


def probe(runtime, path, name):
    """`{"outcome", "detail"}` of the bad request `name` sent to one artifact."""
    runners = _runner(runtime, path)
    good = runners["prefill"](token_ids=PROMPT_IDS)
    signature, inputs = request_inputs(name, good["cache"])
    try:
        out = runners[signature](**inputs)
    except Exception as error:  # noqa: BLE001  classifying what the runtime raises
        return {"outcome": "error", "detail": f"{type(error).__name__}: {_message(error)}"}
    if "valid" in out and not bool(np.all(out["valid"])):
        return {"outcome": "flagged", "detail": "valid=False"}
    finite = all(np.isfinite(v).all() for v in out.values() if v.dtype.kind == "f")
    detail = "outputs returned, no error" + ("" if finite else " (non-finite values)")
    if name == "negative id":
        wrapped = PROMPT_IDS.copy()
        wrapped[0, 1] = VOCAB - 3
        # The same graph on the same effective ids: equal up to the rounding
        # of a re-run (scaled by the logits' magnitude, not a fixed 1e-6).
        want = runners["prefill"](token_ids=wrapped)["logits"]
        same = np.max(np.abs(want - out["logits"])) <= 64 * np.finfo(np.float32).eps * max(
            np.abs(want).max(), np.finfo(np.float32).tiny)
        detail += f"; logits {'equal' if same else 'differ from'} those of id {VOCAB - 3}"
    return {"outcome": "garbage", "detail": detail}


def _probe_main(runtime, path, name):
    print("PROBE " + json.dumps(probe(runtime, path, name)), flush=True)


def probe_in_subprocess(runtime, path, name, timeout=120):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--probe", runtime, path, name],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    if proc.returncode < 0:
        return {"outcome": "crash", "detail": f"killed by signal {-proc.returncode}"}
    tail = (proc.stderr.strip().splitlines() or [""])[-1][:160]
    return {"outcome": "crash", "detail": f"exit code {proc.returncode}: {tail}"}


# --------------------------------------------------------------------------
# Building the artifacts (TensorFlow)


def build_artifacts(directory, seed=0):
    """Exports the tiny model to every runtime, with and without checks.

    Returns `{(runtime, checks): path}`.
    """
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    from keras_attn.generation import DecoderOnlyLM
    from keras_attn.runtimes import signatures as gen_export

    keras.utils.set_random_seed(seed)
    lm = DecoderOnlyLM(VOCAB, 16, 16, num_layers=1, num_heads=2, intermediate_dim=32,
                       position="rotary")
    lm(PROMPT_IDS)
    paths = {}
    for runtime in RUNTIMES:
        for checks in (CHECKS[runtime], "none"):
            path = os.path.join(directory, f"{runtime}_{checks}")
            if runtime == "saved_model":
                gen_export.export_saved_model(lm, path, max_length=MAX_LENGTH, checks=checks,
                                              include_generate=False)
            elif runtime == "tflite":
                path += ".tflite"
                gen_export.export_tflite(lm, path, max_length=MAX_LENGTH, batch_size=BATCH,
                                         prompt_length=PROMPT, checks=checks)
            else:
                gen_export.export_onnx(lm, path, max_length=MAX_LENGTH, checks=checks)
            paths[(runtime, checks)] = path
    return paths


def probe_all(paths, requests=tuple(REQUESTS)):
    """`{(runtime, checks, request): {"outcome", "detail"}}`.

    TFLite and ONNX Runtime probes run one per subprocess (native code that
    may crash); SavedModel probes run here (TensorFlow raises Python errors).
    """
    return {(runtime, checks, name): (probe(runtime, path, name) if runtime == "saved_model"
                                      else probe_in_subprocess(runtime, path, name))
            for (runtime, checks), path in paths.items() for name in requests}


LABELS = {"saved_model": "SavedModel", "tflite": "TFLite (LiteRT)", "onnx": "ONNX Runtime"}


def markdown(results):
    columns = sorted({(r, c) for r, c, _ in results},
                     key=lambda rc: (RUNTIMES.index(rc[0]), rc[1] == "none"))
    head = "| request | " + " | ".join(f"{LABELS[r]} checks={c}" for r, c in columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 1)]
    for name, (signature, description) in REQUESTS.items():
        cells = []
        for runtime, checks in columns:
            result = results.get((runtime, checks, name))
            if result is None:
                cells.append("")
                continue
            detail = result["detail"].replace("|", "\\|")
            if "[" in detail:  # error texts like "... [0, 20)] [-3]" read as links in markdown
                detail = "`" + detail.replace("`", "'") + "`"
            cells.append(f"**{result['outcome']}**: {detail}")
        lines.append(f"| {name} (`{signature}`: {description}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--probe":
        _probe_main(*sys.argv[2:])
        return
    with tempfile.TemporaryDirectory(prefix="bench_serving_requests_") as tmp:
        paths = build_artifacts(tmp)
        results = probe_all(paths)
    print(markdown(results))


if __name__ == "__main__":
    main()
