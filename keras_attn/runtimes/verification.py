"""What the prefill/decode exports return: the artifact run against Keras.

`verify_prefill_decode` drives an exported `prefill` and `decode` (any
runtime: a TFLite signature runner, onnxruntime, a SavedModel signature) over
one random sequence, teacher-forced: `prefill` on its first tokens, then one
`decode` per remaining token, and compares every position's logits with the
Keras model's forward pass over the whole sequence. The exporters put the
result in a `SignatureReport`, the model exports' `ExportReport` with the
artifact's files.
"""

import dataclasses
import os

import keras
import numpy as np

from keras_attn.export.report import ExportReport, ParityError

# float32 exports: the runtimes reorder float32 sums, nothing more; the bound
# is relative to the largest Keras logit (as for the LiteRT-LM bundles).
FLOAT32_RTOL = 1e-4
# The verification sequence: long enough for a few decode steps, short enough
# to cost well under a second on any runtime.
VERIFY_LENGTH = 12


@dataclasses.dataclass
class SignatureReport(ExportReport):
    """An `ExportReport` of a prefill/decode export (`export_saved_model`,
    `export_tflite`, `export_onnx`, `export_onnx_genai`).

    `path` is the SavedModel folder, the `.tflite` file or the output folder;
    `files` names each file written (`{"prefill": ..., "decode": ...}` for
    ONNX). `checks` holds one entry per signature run (`prefill`, `decode`)
    with its inputs' shapes and largest logit error. The report stands where
    the exporters used to return a path: `os.fspath(report)` is `path`, and
    `report["prefill"]` is `files["prefill"]` (ONNX used to return that
    dict).
    """

    files: dict = dataclasses.field(default_factory=dict)

    def __fspath__(self):
        return self.path

    def tolerance_text(self):
        if self.atol is None and self.min_agreement is None and self.agreement is not None:
            return f"argmax agreement {self.agreement:.3f} on random ids, reported, not checked"
        return super().tolerance_text()

    def __getitem__(self, name):
        return self.files[name]


def verification_ids(model, batch, length, seed=0):
    """Random `(batch, length)` int32 ids without the model's padding id (the
    Keras forward pass masks padding, an exported cache does not)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, model.vocabulary_size, size=(batch, length)).astype("int32")
    pad = getattr(model, "pad_token_id", None)
    if pad is not None:
        ids[ids == pad] = (pad + 1) % model.vocabulary_size
    return ids


def verify_prefill_decode(fmt, model, prefill, decode, *, max_length, batch_size=None,
                          prompt_length=None, encoder_length=None, quantization=None,
                          cache_dtype="float32", seed=0, decode_steps=None, prefill_logits="all",
                          decode_step=None):
    """Runs `prefill` / `decode` (callables over NumPy dicts named as the
    signatures) against Keras; returns `(checks, atol, agreement, min_agreement)`.

    `decode_step` (the signature whose caller keeps the cache): run over the
    same tokens from the same prefill, each call given exactly the slots
    filled so far and the new one (`L = index + 1`, a new length every
    call), its `new_cache` written into the caller's cache; checked as
    `decode` is.

    Static shapes (TFLite) are given by `batch_size`, `prompt_length` and
    `encoder_length`; otherwise a batch of 2, a prompt of 4 and an encoder
    input of 6 are used. `decode_steps` (default: up to `VERIFY_LENGTH`
    tokens in all) bounds the `decode` calls. `prefill_logits="last"`: the
    `prefill` returns the last prompt position's logits only `(B, 1, V)`,
    compared with Keras's there. Raises `ParityError` when a float32 export's logits
    differ from Keras's by more than `FLOAT32_RTOL` of the largest logit.
    Quantized weights or a float16 cache are reported, not checked: the
    share of positions whose next token (argmax) equals Keras's
    (`agreement`), and the largest logit error.
    """
    batch = batch_size or 2
    length = max(2, min(max_length, VERIFY_LENGTH))
    prompt = prompt_length or min(4, length - 1)
    length = max(length, prompt)
    if decode_steps is not None:
        length = min(prompt + decode_steps, max_length)
    ids = verification_ids(model, batch, length, seed)
    encoder_ids = None
    if hasattr(model, "encode"):
        encoder_ids = verification_ids(model, batch, encoder_length or 6, seed + 1)
        reference = model((encoder_ids, ids))
    else:
        reference = model(ids)
    # Any backend's tensor (torch's may carry gradients): NumPy, float64.
    reference = keras.ops.convert_to_numpy(reference).astype(np.float64)
    inputs = {"token_ids": ids[:, :prompt]}
    if encoder_ids is not None:
        inputs["encoder_ids"] = encoder_ids
    out = prefill(**inputs)
    got = [np.asarray(out["logits"], np.float64)]
    first = prompt - 1 if prefill_logits == "last" else 0  # the first position compared
    checks = [_check("prefill", inputs, got[0], reference[:, first:prompt])]
    state = {k: out[k] for k in ("cache", "cross_cache", "encoder_padding_mask") if k in out}
    kept = np.array(out["cache"]) if decode_step is not None else None
    steps = []
    for i in range(prompt, length):
        step = dict(token_ids=ids[:, i:i + 1], index=np.array(i, np.int32), **state)
        out = decode(**step)
        state["cache"] = out["cache"]
        steps.append(np.asarray(out["logits"], np.float64)[:, 0])
    if steps:
        decoded = np.stack(steps, axis=1)
        got.append(decoded)
        checks.append(_check("decode", {"token_ids": (batch, 1)}, decoded,
                             reference[:, prompt:], steps=len(steps)))
    if decode_step is not None and length > prompt:
        release = getattr(decode, "release", None)
        if release is not None:  # one runtime session's weights at a time
            release()
        stepped = []
        for i in range(prompt, length):
            step = dict(token_ids=ids[:, i:i + 1], index=np.array(i, np.int32), **state)
            step["cache"] = np.ascontiguousarray(kept[:, :, :, :i + 1])
            out = decode_step(**step)
            kept[:, :, :, i:i + 1] = out["new_cache"]
            stepped.append(np.asarray(out["logits"], np.float64)[:, 0])
        stepped = np.stack(stepped, axis=1)
        checks.append(_check("decode_step", {"token_ids": (batch, 1)}, stepped,
                             reference[:, prompt:], steps=len(stepped[0])))
    got = np.concatenate(got, axis=1)
    error = max(c["max_abs_error"] for c in checks)
    reference = reference[:, first:]
    agreement = float(np.mean(np.argmax(got, -1) == np.argmax(reference, -1)))
    if quantization is None and cache_dtype == "float32":
        atol = FLOAT32_RTOL * max(1.0, float(np.max(np.abs(reference))))
        if not error <= atol:
            raise ParityError(
                f"The {fmt} prefill/decode export's logits differ from Keras's by "
                f"{error:.3g} > atol={atol:.3g} on the verification sequence "
                f"(batch {batch}, {length} tokens); nothing was written.")
        return checks, atol, None, None
    # Reported, not checked: on random ids (far from what a trained model
    # reads) the share of equal next tokens says little about a quantized
    # model's quality, which its own data measures.
    return checks, None, agreement, None


def _check(name, inputs, got, reference, steps=1):
    shapes = {k: tuple(np.shape(v)) if not isinstance(v, tuple) else v
              for k, v in inputs.items()}
    matches = np.argmax(got, -1) == np.argmax(reference, -1)
    return {"signature": name, "shapes": shapes, "calls": steps,
            "max_abs_error": float(np.max(np.abs(got - reference))),
            "argmax_matches": [int(matches.sum()), int(matches.size)]}


def signature_report(fmt, path, verified, *, ops, details, files=None):
    """The `SignatureReport` of an artifact written at `path`, from what
    `verify_prefill_decode` returned."""
    from keras_attn.export.staging import size_of

    checks, atol, agreement, min_agreement = verified
    path = os.path.abspath(os.fspath(path))
    size = sum(size_of(f) for f in files.values()) if files else size_of(path)
    return SignatureReport(
        format=fmt, path=path, size_bytes=size,
        max_abs_error=max(c["max_abs_error"] for c in checks), atol=atol, ops=ops,
        checks=checks, details=details, agreement=agreement, min_agreement=min_agreement,
        files=dict(files or {}))
