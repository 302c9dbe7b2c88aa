"""Every direct decoder writer on every variant of tests/export/decoder_variants.py.

For each (variant, writer): the capability table (`keras_attn.export.
capabilities.support`) must say "covered" exactly for the writers the
variant lists; a covering writer's graph, run in its runtime (onnxruntime,
LiteRT), gives Keras's logits within float32 rounding for a prompt and
decode steps, and the same greedy tokens wherever Keras's top two are
further apart than that bound; a writer that does not cover the variant
raises `NotFusableError` with the table's reason. Backend-agnostic: the
writers read the description, never TensorFlow's graph.
"""

import keras
import numpy as np
import pytest

from keras_attn.export import capabilities
from keras_attn.export import onnx_signatures
from keras_attn.export import tflite_decoder
from keras_attn.export import tflite_signatures
from keras_attn.export.onnx_decoder import decoder_model_proto
from keras_attn.export.capabilities import NotFusableError
from keras_attn.runtimes import litertlm
from tests import tolerance
from tests.export.decoder_variants import CACHE
from tests.export.decoder_variants import VARIANTS
from tests.export.decoder_variants import VOCAB
from tests.export.decoder_variants import WRITERS
from tests.export.decoder_variants import make_lm

ort = pytest.importorskip("onnxruntime")

LENGTH, PROMPT = 12, 7
# Smaller than the cache: decode steps read the filled slots only (the
# dynamic-length reads real sizes take).
READ_BUCKET = 8


@pytest.fixture(scope="module")
def variants():
    """name -> (model, its ids (2, LENGTH), Keras's logits): each built once."""
    built = {}

    def get(name):
        if name not in built:
            lm = make_lm(name)
            ids = np.random.default_rng(1).integers(1, VOCAB, (2, LENGTH)).astype("int32")
            built[name] = lm, ids, keras.ops.convert_to_numpy(lm(ids)).astype(np.float64)
        return built[name]

    return get


def _session(proto):
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


def run_genai(lm, ids):
    """The GenAI graph: a prefill of PROMPT tokens, then one token at a time
    with the present caches fed back as the past ones."""
    d = lm.describe()
    heads, dim = d.layers[0].attention.num_key_value_heads, d.layers[0].attention.head_dim
    session = _session(decoder_model_proto(lm, max_length=CACHE, prompt_logits="all"))
    names = [o.name for o in session.get_outputs()]
    past = {f"past_key_values.{i}.{kind}": np.zeros((len(ids), heads, CACHE, dim), np.float32)
            for i in range(d.num_layers) for kind in ("key", "value")}
    logits, start = [], 0
    for end in [PROMPT] + list(range(PROMPT + 1, LENGTH + 1)):
        out = dict(zip(names, session.run(None, {"input_ids": ids[:, start:end].astype(np.int64),
                                                  "attention_mask": np.ones((len(ids), end), np.int64),
                                                  **past})))
        logits.append(out["logits"])
        past = {f"past_key_values.{k[len('present.'):]}": v for k, v in out.items() if k.startswith("present.")}
        start = end
    return np.concatenate(logits, axis=1), 0


def run_onnx_signatures(lm, ids):
    """`prefill` on PROMPT tokens, then `decode` per token (the stacked cache)."""
    sessions = {k: _session(p) for k, p in onnx_signatures.signature_models(
        lm, max_length=CACHE, read_bucket=READ_BUCKET).items()}

    def run(name, **feeds):
        names = [o.name for o in sessions[name].get_outputs()]
        return {n.removesuffix("_out"): v for n, v in zip(names, sessions[name].run(None, feeds))}

    out = run("prefill", token_ids=ids[:, :PROMPT])
    got, cache = [out["logits"]], out["cache"]
    for i in range(PROMPT, LENGTH):
        out = run("decode", token_ids=ids[:, i:i + 1], cache=cache, index=np.array(i, np.int32))
        got.append(out["logits"])
        cache = out["cache"]
    return np.concatenate(got, axis=1), 0


def run_litertlm(lm, ids):
    """LiteRT-LM's schedule (chunked prefill of the first half, then decode), per row."""
    content = tflite_decoder.written_bytes(tflite_decoder.write_decoder_tflite, lm, max_length=CACHE,
                                           prefill_lengths=(4, 8), read_bucket=READ_BUCKET)
    rows = [litertlm.runtime_logits(content, row) for row in ids]
    first = rows[0][1]
    return np.stack([r[0] for r in rows]), first


def run_tflite_signatures(lm, ids):
    from ai_edge_litert import interpreter as litert

    content = tflite_decoder.written_bytes(tflite_signatures.write_signatures_tflite, lm, max_length=CACHE,
                                           batch_size=len(ids), prompt_length=PROMPT, read_bucket=READ_BUCKET)
    interpreter = litert.Interpreter(model_content=content)
    prefill, decode = (interpreter.get_signature_runner(n) for n in ("prefill", "decode"))
    out = prefill(token_ids=ids[:, :PROMPT])
    got, cache = [out["logits"]], out["cache"]
    for i in range(PROMPT, LENGTH):
        out = decode(token_ids=ids[:, i:i + 1], cache=cache, index=np.array(i, np.int32))
        got.append(out["logits"])
        cache = out["cache"]
    return np.concatenate(got, axis=1), 0


RUNNERS = {"onnx_genai": run_genai, "onnx_signatures": run_onnx_signatures,
           "litertlm": run_litertlm, "tflite_signatures": run_tflite_signatures}
CHECKS = {
    "onnx_genai": lambda lm: decoder_model_proto(lm, max_length=CACHE),
    "onnx_signatures": lambda lm: onnx_signatures.signature_models(lm, max_length=CACHE),
    "litertlm": lambda lm: tflite_decoder.written_bytes(tflite_decoder.write_decoder_tflite, lm,
                                                        max_length=CACHE, prefill_lengths=(8,)),
    "tflite_signatures": lambda lm: tflite_decoder.written_bytes(
        tflite_signatures.write_signatures_tflite, lm, max_length=CACHE, batch_size=2, prompt_length=PROMPT),
}


def test_the_table_covers_what_each_variant_lists(variants):
    for name, (_, covered) in VARIANTS.items():
        d = variants(name)[0].describe()
        got = {w for w in WRITERS if capabilities.support(d, w, max_length=CACHE) is None}
        assert got == set(covered), (name, {w: capabilities.support(d, w, max_length=CACHE) for w in WRITERS})


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_writer_gives_keras_logits_or_says_why_not(variants, name, writer):
    lm, ids, want = variants(name)
    d = lm.describe()
    reason = capabilities.support(d, writer, max_length=CACHE)
    if reason is not None:
        assert writer not in VARIANTS[name][1]
        with pytest.raises(NotFusableError) as raised:
            CHECKS[writer](lm)
        assert str(raised.value) == reason
        return
    got, first = RUNNERS[writer](lm, ids)
    want = want[:, first:] if writer == "litertlm" else want
    terms = tolerance.LAYER_TERMS * d.num_layers
    tolerance.assert_close(got, want, scale=tolerance.magnitude(want), terms=terms, err_msg=f"{name}, {writer}")
    # Greedy tokens: equal wherever Keras's choice is clear of float32 rounding.
    top2 = np.sort(want, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * tolerance.bound(tolerance.magnitude(want), terms=terms)
    assert clear.mean() > 0.5, f"{name}: too few clear choices to compare"
    np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear], err_msg=f"{name}, {writer}")
