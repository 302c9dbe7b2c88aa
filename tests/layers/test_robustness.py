"""Numerics at the edges, property-based checks, loading failures, security."""

import pathlib
import re
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keras_attn
from keras_attn import layers as kal
from keras_attn import ops as ka_ops
from keras_attn import saving
from tests import model_zoo
from tests import reference as ref
from tests import tolerance
from tests.environments import child_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


# --- Fully masked rows: zeros and zero gradients on every path --------------------

def _paths():
    return {
        "ops": lambda q, k, v, m, **kw: ka_ops.dot_product_attention(q, k, v, attention_mask=m, **kw),
        "ops_chunked": lambda q, k, v, m, **kw: ka_ops.dot_product_attention(
            q, k, v, attention_mask=m, chunk_size=2, **{k_: v_ for k_, v_ in kw.items() if k_ != "return_attention_scores"}
        ),
    }


# The blocked path has no attention dropout (it never builds the probabilities).
@pytest.mark.parametrize("path, dropout", [("ops", 0.0), ("ops", 0.3), ("ops_chunked", 0.0)])
def test_fully_masked_rows_ops_paths(rng, path, dropout):
    q = tf.Variable(rng.standard_normal((2, 5, 2, 4)).astype("float32"))
    k = tf.Variable(rng.standard_normal((2, 6, 2, 4)).astype("float32"))
    v = tf.Variable(rng.standard_normal((2, 6, 2, 4)).astype("float32"))
    mask = np.ones((2, 1, 5, 6), bool)
    mask[0, :, 3] = False
    mask[1] = False
    with tf.GradientTape() as tape:
        out = _paths()[path](q, k, v, mask, dropout_rate=dropout, training=True, seed=1)
        loss = tf.reduce_sum(out[0, 3] ** 2) + tf.reduce_sum(out[1] ** 2)
    assert np.all(np.isfinite(out.numpy()))
    np.testing.assert_array_equal(out.numpy()[0, 3], 0)
    np.testing.assert_array_equal(out.numpy()[1], 0)
    for g in tape.gradient(loss, [q, k, v]):
        assert g is None or not np.any(np.asarray(tf.convert_to_tensor(g)))


LAYER_PATHS = {
    "dot": lambda: kal.DotProductAttention(dropout=0.2),
    "additive": lambda: kal.AdditiveAttention(4, dropout=0.2),
    "mha": lambda: kal.MultiHeadAttention(2, 4, dropout=0.2, use_bias=False),
    "mha_chunked": lambda: kal.MultiHeadAttention(2, 4, num_key_value_heads=1, chunk_size=2, use_bias=False),
}
# The blocked path cannot return scores by design (it never builds them).
LAYER_CASES = [
    (name, training, scores)
    for name in LAYER_PATHS
    for training in (False, True)
    for scores in (False, True)
    if not (name == "mha_chunked" and scores)
]


@pytest.mark.parametrize("name, training, scores", LAYER_CASES)
def test_fully_masked_rows_layers(rng, name, training, scores):
    layer = LAYER_PATHS[name]()
    x = tf.Variable(rng.standard_normal((2, 4, 8)).astype("float32"))
    mask = np.ones((2, 4, 4), bool)
    mask[0, 1] = False
    with tf.GradientTape() as tape:
        result = layer(x, x, attention_mask=mask, training=training, return_attention_scores=scores)
        out = result[0] if scores else result
        loss = tf.reduce_sum(out[0, 1] ** 2)
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_array_equal(np.asarray(out)[0, 1], 0)
    grad = tape.gradient(loss, x)
    assert grad is None or not np.any(np.asarray(grad))
    if scores:
        s = np.asarray(result[1])
        row = s[0, 1] if s.ndim == 3 else s[0, :, 1]
        np.testing.assert_array_equal(row, 0)


# --- Low precision up to the dtype's range -----------------------------------------

@pytest.mark.parametrize("dtype, logit", [("float16", 6.0e4), ("bfloat16", 1.0e38)])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_logits_up_to_dtype_range_are_finite(rng, dtype, logit, chunk_size):
    d = 16
    # q.k * (1/sqrt(d)) = logit on the diagonal, -logit off it.
    value = np.sqrt(logit * np.sqrt(d) / d)
    q = np.tile(np.array([1, -1, 1, -1], "float32")[:, None] * value, (1, d))[None, :, None, :]
    k = q.copy()
    v = rng.standard_normal((1, 4, 1, 3)).astype("float32")
    cast = lambda a: keras.ops.cast(a, dtype)  # noqa: E731
    out = ka_ops.dot_product_attention(cast(q), cast(k), cast(v), is_causal=True, chunk_size=chunk_size)
    out = np.asarray(keras.ops.cast(out, "float32"))
    assert np.all(np.isfinite(out))
    # Rows 0 and 2 have the same sign pattern: row 2 attends to keys 0 and 2 (ties), row 0 to key 0.
    vv = np.asarray(keras.ops.cast(cast(v), "float32"))
    # An average of the values, rounded to the dtype (a few roundings of |v|).
    scale = tolerance.magnitude(vv)
    tolerance.assert_close(out[0, 0, 0], vv[0, 0, 0], scale=scale, ulps=4, dtype=dtype)
    tolerance.assert_close(out[0, 2, 0], (vv[0, 0, 0] + vv[0, 2, 0]) / 2, scale=scale, ulps=4, dtype=dtype)


# --- Empty batches and length-1 sequences -------------------------------------------

@pytest.mark.parametrize("name", sorted(model_zoo.ALL))
@pytest.mark.parametrize("batch, length", [(0, 5), (2, 1)])
def test_empty_batch_and_length_one(name, batch, length):
    model = model_zoo.ALL[name]()
    out = model(model_zoo.sample_inputs(model, batch=batch, length=length))
    for t in tf.nest.flatten(out):
        assert t.shape[0] == batch
        assert np.all(np.isfinite(np.asarray(t)))


# --- Property-based checks against the NumPy reference ------------------------------

@st.composite
def attention_case(draw):
    b = draw(st.integers(1, 3))
    tq, tk = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    hkv = draw(st.sampled_from([1, 2]))
    h = hkv * draw(st.sampled_from([1, 2, 3]))
    d = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    mask_kind = draw(st.sampled_from(["none", "key", "full"]))
    causal = draw(st.booleans())
    chunk = draw(st.sampled_from([None, 1, 2, 4]))
    return b, tq, tk, h, hkv, d, rng, mask_kind, causal, chunk


@PROPERTY
@given(attention_case(), st.sampled_from(["float32", "float16", "bfloat16"]))
def test_property_dot_product_attention(case, dtype):
    b, tq, tk, h, hkv, d, rng, mask_kind, causal, chunk = case
    q = rng.standard_normal((b, tq, h, d)).astype("float32")
    k = rng.standard_normal((b, tk, hkv, d)).astype("float32")
    v = rng.standard_normal((b, tk, hkv, 3)).astype("float32")
    mask = None
    full = np.ones((b, 1, tq, tk), bool)
    if mask_kind == "key":
        mask = rng.random((b, 1, 1, tk)) > 0.3   # may mask whole rows
        full = full & mask
    elif mask_kind == "full":
        mask = rng.random((b, h, tq, tk)) > 0.5
        full = full & mask
    if causal:
        full = full & ref.causal(tq, tk)[None, None]
    cast = lambda a: keras.ops.cast(a, dtype)  # noqa: E731
    qc, kc, vc = (np.asarray(keras.ops.cast(cast(a), "float32")) for a in (q, k, v))
    out = ka_ops.dot_product_attention(
        cast(q), cast(k), cast(v), attention_mask=mask, is_causal=causal, chunk_size=chunk
    )
    out = np.asarray(keras.ops.cast(out, "float32"))
    want, _ = ref.attention(qc, kc, vc, mask=full)
    # float32: sums over D and T_k; float16/bfloat16: the inputs are already
    # rounded (the reference sees them), the output cast dominates.
    low = dtype != "float32"
    tolerance.assert_close(out, want, scale=tolerance.magnitude(vc), ulps=20 if low else 64,
                           terms=1 if low else d * tk, dtype=dtype)


@PROPERTY
@given(attention_case())
def test_property_attention_layers(case):
    b, tq, tk, h, hkv, d, rng, mask_kind, causal, _ = case
    q = rng.standard_normal((b, tq, 6)).astype("float32")
    v = rng.standard_normal((b, tk, 6)).astype("float32")
    value_mask = rng.random((b, tk)) > 0.3 if mask_kind != "none" else None
    full = np.ones((b, 1, tq, tk), bool)
    if value_mask is not None:
        full = full & value_mask[:, None, None, :]
    if causal:
        full = full & ref.causal(tq, tk)[None, None]
    mha = kal.MultiHeadAttention(h, d, num_key_value_heads=hkv)
    out = mha(q, v, value_mask=value_mask, use_causal_mask=causal)
    want, _ = ref.mha(q, v, v, ref.mha_weights(mha), h, hkv, mask=full)
    tolerance.assert_close(out, want, terms=tolerance.LAYER_TERMS)
    dpa = kal.DotProductAttention()(q, v, value_mask=value_mask, use_causal_mask=causal)
    want_dpa, _ = ref.attention(q[:, :, None], v[:, :, None], v[:, :, None], mask=full)
    tolerance.assert_close(dpa, want_dpa[:, :, 0], terms=tolerance.LAYER_TERMS)


# --- Serialization beyond .keras: checkpoints, fresh process, corrupt files --------

def test_tf_checkpoint_round_trip(tmp_path):
    model = model_zoo.encoder_decoder()
    inputs = model_zoo.sample_inputs(model)
    before = np.asarray(model(inputs))
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    fresh = model_zoo.encoder_decoder()
    fresh(inputs)
    tf.train.Checkpoint(model=fresh).restore(path).assert_existing_objects_matched()
    np.testing.assert_array_equal(np.asarray(fresh(inputs)), before)


def test_loads_in_fresh_process_that_imports_only_keras_attn(tmp_path):
    model = model_zoo.encoder_decoder()
    inputs = model_zoo.sample_inputs(model)
    model.save(tmp_path / "m.keras")
    np.save(tmp_path / "want.npy", np.asarray(model(inputs)))
    np.savez(tmp_path / "inputs.npz", *inputs)
    script = (
        "import sys, numpy as np, keras_attn\n"
        f"m = keras_attn.saving.load_model({str(tmp_path / 'm.keras')!r})\n"
        f"x = np.load({str(tmp_path / 'inputs.npz')!r})\n"
        "out = np.asarray(m([x['arr_0'], x['arr_1']]))\n"
        f"np.testing.assert_array_equal(out, np.load({str(tmp_path / 'want.npy')!r}))\n"
        "assert 'tests' not in sys.modules\n"
        "print('OK')\n"
    )
    # This checkout's keras_attn, whichever copy is installed.
    env = child_env(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "missing_config"])
def test_corrupt_keras_file_gives_clear_error(tmp_path, damage):
    model = model_zoo.multi_head_attention()
    good = tmp_path / "good.keras"
    model.save(good)
    bad = tmp_path / "bad.keras"
    data = good.read_bytes()
    if damage == "truncate":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        bad.write_bytes(data[:100] + bytes(200) + data[300:])
    else:
        with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
            for item in src.namelist():
                if item != "config.json":
                    dst.writestr(item, src.read(item))
    with pytest.raises(saving.CorruptFileError, match="bad.keras"):
        saving.load_model(bad)


def test_corrupt_weights_leave_model_unchanged(tmp_path):
    model = model_zoo.encoder_classifier()
    inputs = model_zoo.sample_inputs(model)
    model.save_weights(tmp_path / "w.weights.h5")
    before = np.asarray(model(inputs))
    data = (tmp_path / "w.weights.h5").read_bytes()
    (tmp_path / "t.weights.h5").write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises((saving.CorruptFileError, ValueError)):
        saving.load_weights(model, tmp_path / "t.weights.h5")
    np.testing.assert_array_equal(np.asarray(model(inputs)), before)
    other = model_zoo.decoder_only()
    other.save_weights(tmp_path / "other.weights.h5")
    with pytest.raises(ValueError):
        saving.load_weights(model, tmp_path / "other.weights.h5")
    np.testing.assert_array_equal(np.asarray(model(inputs)), before)


# --- Security --------------------------------------------------------------------

def test_no_eval_pickle_or_lambda_in_the_package():
    pattern = re.compile(r"\b(eval|exec)\(|\bpickle\b|\bmarshal\b|layers\.Lambda\(|safe_mode=False|enable_unsafe_deserialization")
    offenders = []
    for path in (ROOT / "keras_attn").rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) and "noqa: security" not in line:
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_unsafe_files_are_refused_by_default(tmp_path):
    inp = keras.Input((3,))
    model = keras.Model(inp, keras.layers.Lambda(lambda t: t * 2)(inp))
    model.save(tmp_path / "lambda.keras")
    with pytest.raises(ValueError, match="(?i)unsafe|safe_mode|lambda"):
        saving.load_model(tmp_path / "lambda.keras")
    assert keras_attn.saving.load_model is saving.load_model
