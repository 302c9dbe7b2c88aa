"""Every attention kernel against the float64 NumPy reference and the
`reference` kernel; the kernel choice (`select_kernel`) and its settings.

- Values and gradients of `reference`, `tf_cpu`, `blocked` and `keras`
  (`keras.ops.dot_product_attention`), forced through
  `keras_attn.config.attention_implementation`, with masks (key padding,
  full, fully masked rows), biases, causal and sliding windows, GQA, in
  float32, float16 and bfloat16.
- On a GPU (forced with `keras_attn.config.device_type("gpu")`), "auto"
  never picks the CPU-only kernel or the blocks' CPU LayerNorm.
- Forcing "reference" gives the same results (1e-5) on every public layer
  and block of tests/model_zoo.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_attn
from keras_attn import config
from keras_attn import ops as ka_ops
from keras_attn.ops import dispatch
from tests import model_zoo
from tests import reference as ref
from tests import tolerance

KERNELS = ["reference", "tf_cpu", "blocked", "keras"]

# name: (B, Tq, Tk, H, Hkv, causal, window, mask kind, bias)
CASES = {
    "plain": (2, 9, 9, 4, 4, False, None, None, False),
    "key_padding": (3, 7, 11, 4, 4, False, None, "keys", False),
    "full_mask_empty_rows": (2, 6, 8, 2, 2, False, None, "full", False),
    "gqa_causal_bias": (2, 9, 9, 8, 2, True, None, None, True),
    "mqa_causal_keys": (2, 10, 10, 4, 1, True, None, "keys", False),
    "causal_window": (1, 12, 12, 2, 2, True, 4, None, False),
    "symmetric_window_bias": (2, 11, 11, 2, 2, False, 3, None, True),
}

# Roundings of the compute dtype allowed (tests/tolerance.py): float32 sums
# over T*D terms; in float16/bfloat16 the final casts dominate.
TOLERANCE = {"float32": 64, "float16": 20, "bfloat16": 10}


@pytest.fixture
def auto_kernels():
    """For tests of the automatic kernel choice itself: "auto" even when the
    suite runs with KERAS_ATTN_ATTENTION_IMPLEMENTATION forced."""
    with config.attention_implementation("auto"):
        yield


def _case_inputs(name, rng):
    b, tq, tk, h, hkv, causal, window, kind, use_bias = CASES[name]
    d = 8
    arrays = dict(
        q=rng.normal(size=(b, tq, h, d)).astype("float32"),
        k=rng.normal(size=(b, tk, hkv, d)).astype("float32"),
        v=rng.normal(size=(b, tk, hkv, d)).astype("float32"),
        d_out=rng.normal(size=(b, tq, h, d)).astype("float32"),
        bias=rng.normal(size=(1, h, tq, tk)).astype("float32") if use_bias else None,
    )
    kwargs = dict(is_causal=causal, sliding_window=window)
    mask4 = np.ones((b, h, tq, tk), bool)
    q_pos, k_pos = np.arange(tq)[:, None], np.arange(tk)[None, :]
    if causal:
        mask4 &= q_pos >= k_pos
    if window is not None:
        mask4 &= np.abs(q_pos - k_pos) < window
    if kind == "keys":
        valid = rng.random((b, tk)) > 0.3
        valid[:, 0] = True
        kwargs["key_padding_mask"] = valid
        mask4 &= valid[:, None, None, :]
    elif kind == "full":
        full = rng.random((b, 1, tq, tk)) > 0.4
        full[0, 0, 2] = False  # a query row that sees no key
        full[1] = False  # an example that sees nothing
        kwargs["attention_mask"] = full
        mask4 &= full
    return arrays, kwargs, mask4


def _run(kernel, arrays, kwargs, dtype):
    cast = lambda a: tf.cast(tf.constant(a), dtype)  # noqa: E731
    q, k, v = (cast(arrays[n]) for n in "qkv")
    bias = None if arrays["bias"] is None else tf.constant(arrays["bias"])
    watched = [q, k, v] + ([bias] if bias is not None else [])
    with config.attention_implementation(kernel):
        with tf.GradientTape() as tape:
            tape.watch(watched)
            out = ka_ops.dot_product_attention(q, k, v, bias=bias, **kwargs)
            loss = tf.reduce_sum(tf.cast(out, "float32") * arrays["d_out"])
        ran = ka_ops.last_kernel()
    grads = tape.gradient(loss, watched)
    assert ran == kernel
    assert out.dtype == dtype
    return [np.asarray(tf.cast(x, "float32")) for x in [out] + grads], (q, k, v)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_values_and_gradients(kernel, name, dtype, rng):
    arrays, kwargs, mask4 = _case_inputs(name, rng)
    got, (q, k, v) = _run(kernel, arrays, kwargs, dtype)
    # The NumPy reference sees the same (rounded) inputs.
    q64, k64, v64 = (np.asarray(tf.cast(x, "float32")) for x in (q, k, v))
    scale = 1 / np.sqrt(q64.shape[-1])
    want = ref.attention_with_grads(q64, k64, v64, mask4, arrays["bias"], scale, arrays["d_out"])
    want = list(want[:4]) + ([want[4].sum(axis=0, keepdims=True)] if arrays["bias"] is not None else [])
    baseline, _ = _run("reference", arrays, kwargs, dtype)
    assert all(np.all(np.isfinite(g)) for g in got)
    terms = q64.shape[1] * q64.shape[-1] if dtype == "float32" else 1
    for label, other in (("NumPy", want), ("reference", baseline)):
        tolerance.assert_outputs_and_grads(
            got, other, ulps=TOLERANCE[dtype], terms=terms, dtype=dtype,
            err_msg=f"{kernel} {name} {dtype} vs {label}",
        )


@pytest.mark.parametrize("kernel", ["reference", "tf_cpu"])
def test_kernels_with_scores_and_dropout(kernel, rng):
    """Scores (all kernels that build them) against NumPy; dropout keeps the
    expected value of the output (mean over many draws)."""
    arrays, kwargs, mask4 = _case_inputs("full_mask_empty_rows", rng)
    with config.attention_implementation(kernel):
        out, scores = ka_ops.dot_product_attention(
            arrays["q"], arrays["k"], arrays["v"], return_attention_scores=True, **kwargs
        )
        assert ka_ops.last_kernel() == kernel
        want_out, want_probs = ref.attention(arrays["q"], arrays["k"], arrays["v"], mask=mask4)
        tolerance.assert_close(out, want_out, terms=tolerance.LAYER_TERMS)
        tolerance.assert_close(scores, want_probs, terms=tolerance.LAYER_TERMS)
        dropped = ka_ops.dot_product_attention(
            arrays["q"], arrays["k"], arrays["v"], dropout_rate=0.5, training=True, seed=1,
            **kwargs,
        )
        assert np.all(np.isfinite(dropped))
        np.testing.assert_array_equal(np.asarray(dropped)[1], 0.0)


def test_forced_kernels_that_need_no_scores_leave_scores_to_reference(rng):
    q = rng.normal(size=(1, 5, 2, 4)).astype("float32")
    for kernel in ("blocked", "keras"):
        with config.attention_implementation(kernel):
            ka_ops.dot_product_attention(q, q, q, return_attention_scores=True)
            assert ka_ops.last_kernel() == "reference"
            ka_ops.dot_product_attention(q, q, q)
            assert ka_ops.last_kernel() == kernel


def test_select_kernel_on_a_gpu_never_picks_cpu_kernels():
    """Every combination of sizes and options, on each backend's GPU."""
    for backend in ("tensorflow", "jax", "torch"):
        for lengths in ((8, 8), (None, None), (8192, 8192)):
            for chunk in (None, 0, (64, 64)):
                for needs in ((False, False), (True, False), (False, True)):
                    if chunk == (64, 64) and any(needs):
                        continue  # rejected by dot_product_attention
                    plan = dispatch.select_kernel(
                        query_length=lengths[0], key_length=lengths[1], chunk_size=chunk,
                        dropout_active=needs[0], return_attention_scores=needs[1],
                        implementation="auto", backend=backend, device="gpu",
                    )
                    kernel = plan.attention
                    assert not plan.cpu_kernels
                    assert kernel != "tf_cpu"
                    if backend in ("jax", "torch") and kernel != "blocked" and not any(needs):
                        assert kernel == "keras"
                    if any(needs):
                        assert kernel == "reference"
    assert dispatch.select_kernel(
        query_length=8, key_length=8, implementation="auto", backend="tensorflow", device="cpu"
    ) == dispatch.KernelPlan("tf_cpu", cpu_kernels=True, fused_projections=True)
    assert dispatch.select_kernel(
        query_length=8, key_length=8, implementation="auto", backend="jax", device="cpu"
    ) == dispatch.KernelPlan("reference", cpu_kernels=False, fused_projections=True)


def test_kernel_plan_flash_and_reference():
    """`flash_attention=True` is a plan of the "keras" kernel on any setting; the
    "reference" setting turns every optimisation off, fused projections too."""
    for implementation in ("auto", "reference", "blocked"):
        plan = dispatch.select_kernel(query_length=8, key_length=8, flash_attention=True,
                                      implementation=implementation)
        assert (plan.attention, plan.flash) == ("keras", True)
    plan = dispatch.select_kernel(implementation="reference", backend="tensorflow", device="cpu")
    assert plan == dispatch.KernelPlan("reference", cpu_kernels=False, fused_projections=False)


@pytest.mark.usefixtures("auto_kernels")
def test_device_override_drives_dot_product_attention_and_layer_norm(rng):
    """TensorFlow with a (forced) GPU: the reference kernel and Keras'
    LayerNorm, the same numbers as on the CPU kernels."""
    q = rng.normal(size=(2, 6, 2, 4)).astype("float32")
    block = keras_attn.layers.TransformerEncoderBlock(num_heads=2, intermediate_dim=16)
    x = rng.normal(size=(2, 6, 8)).astype("float32")
    cpu_block = np.asarray(block(x))
    cpu_out = ka_ops.dot_product_attention(q, q, q, is_causal=True)
    assert ka_ops.last_kernel() == "tf_cpu"
    assert dispatch.select_kernel().cpu_kernels
    with config.device_type("gpu"):
        assert config.get_device_type() == "gpu"
        assert not dispatch.select_kernel().cpu_kernels
        gpu_out = ka_ops.dot_product_attention(q, q, q, is_causal=True)
        assert ka_ops.last_kernel() == "reference"
        assert ka_ops.explain_kernel(q, q, q) == "reference"
        assert ka_ops.explain_kernel(q, q, q, chunk_size=4) == "blocked"
        gpu_block = np.asarray(block(x))
    assert config.get_device_type() == "cpu"
    tolerance.assert_close(gpu_out, cpu_out, terms=tolerance.LAYER_TERMS)
    tolerance.assert_close(gpu_block, cpu_block, terms=tolerance.LAYER_TERMS)


def test_setting_environment_variable_and_context_manager(monkeypatch):
    assert config.get_attention_implementation() in config.IMPLEMENTATIONS
    monkeypatch.setenv(config.ENV_VAR, "reference")
    assert config.get_attention_implementation() == "reference"
    with config.attention_implementation("blocked"):
        assert config.get_attention_implementation() == "blocked"
        config.set_attention_implementation("tf_cpu")
        assert config.get_attention_implementation() == "tf_cpu"
    assert config.get_attention_implementation() == "reference"
    monkeypatch.setenv(config.ENV_VAR, "flash")
    with pytest.raises(ValueError, match=config.ENV_VAR + ".*flash"):
        config.get_attention_implementation()
    with pytest.raises(ValueError, match="'fast'"):
        config.set_attention_implementation("fast")
    with pytest.raises(ValueError, match="device_type"):
        config.set_device_type("npu")


def _outputs_and_grads(model, inputs):
    with tf.GradientTape() as tape:
        out = model(inputs, training=True)
        flat = tf.nest.flatten(out)
        loss = tf.add_n([tf.reduce_sum(tf.cast(o, "float32") ** 2) for o in flat])
    grads = tape.gradient(loss, model.trainable_weights)
    return [np.asarray(o) for o in flat] + [
        np.asarray(tf.convert_to_tensor(g)) for g in grads if g is not None
    ]


@pytest.fixture(scope="module")
def zoo():
    keras.utils.set_random_seed(7)
    return {name: build() for name, build in model_zoo.ALL.items()}


@pytest.mark.parametrize("name", list(model_zoo.ALL))
def test_forcing_reference_gives_the_same_results_on_every_layer(name, zoo):
    model = zoo[name]
    inputs = model_zoo.sample_inputs(model, batch=3, length=9)
    with config.attention_implementation("auto"):
        auto = _outputs_and_grads(model, inputs)
    for kernel in ("reference", "blocked"):
        with config.attention_implementation(kernel):
            forced = _outputs_and_grads(model, inputs)
        assert len(forced) == len(auto)
        n_out = len(tf.nest.flatten(model.outputs))
        # Outputs against their own magnitude; weight gradients (sums over
        # the batch and the sequence, in another order) against the largest
        # gradient of the model: some are ~0 by cancellation (a key bias's
        # gradient is exactly 0 in exact arithmetic) and carry the rounding
        # of the terms they were summed from.
        tolerance.assert_all_close(forced[:n_out], auto[:n_out], err_msg=f"{kernel} output")
        tolerance.assert_all_close(
            forced[n_out:], auto[n_out:], terms=3 * 9, err_msg=f"{kernel} gradient"
        )


@pytest.mark.parametrize("layer_name", ["mha", "dot_product"])
def test_rank2_layer_mask_does_not_depend_on_the_batch_size(layer_name, rng):
    """A rank-2 `attention_mask` is `(T_q, T_k)` for the whole batch (as Keras
    MHA broadcasts it), also when batch == T_q: eager, `tf.function` with an
    unknown batch and XLA agree, and match the same mask given per example."""
    batch = t = 4
    x = rng.normal(size=(batch, t, 8)).astype("float32")
    mask = rng.random((t, t)) > 0.4
    mask[:, 0] = True
    if layer_name == "mha":
        layer = keras_attn.layers.MultiHeadAttention(2, 4)
    else:
        layer = keras_attn.layers.DotProductAttention()
    per_example = np.asarray(layer(x, x, attention_mask=np.broadcast_to(mask, (batch, t, t))))
    eager = np.asarray(layer(x, x, attention_mask=mask))
    spec = [tf.TensorSpec((None, t, 8)), tf.TensorSpec((t, t), tf.bool)]
    graph = tf.function(lambda a, m: layer(a, a, attention_mask=m), input_signature=spec)
    xla = tf.function(lambda a, m: layer(a, a, attention_mask=m), input_signature=spec,
                      jit_compile=True)
    for label, got in (("eager", eager), ("graph", graph(x, mask)), ("xla", xla(x, mask))):
        tolerance.assert_close(np.asarray(got), per_example, terms=tolerance.LAYER_TERMS, err_msg=label)
    # Not what reading the mask as (B, T_k) key padding would give.
    as_padding = np.asarray(layer(x, x, value_mask=mask))
    assert np.abs(as_padding - per_example).max() > 1e-3


def test_sliding_window_means_the_same_band_in_ops_and_layers(rng):
    """MHA's `sliding_window` (with and without a causal mask) against the
    NumPy band `|i - j| < W`, unblocked and blocked."""
    t, w = 13, 3
    x = rng.normal(size=(2, t, 8)).astype("float32")
    band = np.abs(np.arange(t)[:, None] - np.arange(t)[None, :]) < w
    for causal in (False, True):
        allowed = band & (np.tril(np.ones((t, t), bool)) if causal else True)

        for chunk in (0, (4, 4)):
            layer = keras_attn.layers.MultiHeadAttention(2, 4, sliding_window=w, chunk_size=chunk)
            plain = keras_attn.layers.MultiHeadAttention(2, 4, chunk_size=0)
            plain(x, x)
            layer(x, x)
            layer.set_weights(plain.get_weights())
            got = np.asarray(layer(x, x, use_causal_mask=causal))
            want = np.asarray(plain(x, x, attention_mask=np.broadcast_to(allowed, (2, t, t))))
            tolerance.assert_close(got, want, terms=tolerance.LAYER_TERMS, err_msg=f"{causal} {chunk}")


_OTHER_BACKEND_SCRIPT = """
import numpy as np, keras
from keras_attn import config, ops as ka
from tests import reference as ref
from tests import tolerance
rng = np.random.default_rng(0)
q = rng.normal(size=(2, 9, 4, 8)).astype("float32")
k = rng.normal(size=(2, 9, 2, 8)).astype("float32")
valid = rng.random((2, 9)) > 0.3
valid[:, 0] = True
band = np.abs(np.arange(9)[:, None] - np.arange(9)[None, :]) < 4
mask = valid[:, None, None, :] & np.tril(band)[None, None]
want, _ = ref.attention(q, k, k, mask=mask)
for kernel in ["reference", "keras", "blocked"]:
    with config.attention_implementation(kernel):
        out = ka.dot_product_attention(
            q, k, k, key_padding_mask=valid, is_causal=True, sliding_window=4)
        assert ka.last_kernel() == kernel, (kernel, ka.last_kernel())
    tolerance.assert_close(keras.ops.convert_to_numpy(out), want, terms=9 * 8, err_msg=kernel)
# Gradients of the blocked kernel (its custom gradient) against NumPy's
# finite differences of the reference formula, on this backend.
def loss_of(kernel, qq):
    with config.attention_implementation(kernel):
        out = ka.dot_product_attention(qq, k, k, key_padding_mask=valid, is_causal=True,
                                       sliding_window=4, chunk_size=(4, 4))
    return keras.ops.sum(out * out)
if keras.backend.backend() == "torch":
    import torch
    qt = torch.tensor(q, requires_grad=True)
    loss_of("blocked", qt).backward()
    grad = qt.grad.numpy()
else:
    import jax
    grad = np.asarray(jax.grad(lambda qq: loss_of("blocked", qq))(q))
eps, num = 1e-2, np.zeros_like(q)
for idx in [(0, 3, 1, 2), (1, 8, 3, 7), (0, 0, 0, 0), (1, 5, 2, 4)]:
    d = np.zeros_like(q); d[idx] = eps
    up, _ = ref.attention(q + d, k, k, mask=mask)
    down, _ = ref.attention(q - d, k, k, mask=mask)
    num[idx] = (np.sum(up.astype("float64") ** 2) - np.sum(down.astype("float64") ** 2)) / (2 * eps)
    assert abs(grad[idx] - num[idx]) < 2e-2 * max(1.0, abs(num[idx])), (idx, grad[idx], num[idx])
assert ka.explain_kernel(q, k, k) == "reference"  # auto on a CPU
with config.device_type("gpu"):
    assert ka.explain_kernel(q, k, k) == "keras"
    assert ka.explain_kernel(q, k, k, return_attention_scores=True) == "reference"
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_kernels_and_choice_on_jax_and_torch(backend):
    """JAX and torch: the kernels against NumPy (the blocked kernel's custom
    gradient against finite differences), and "auto" on a (forced) GPU picks
    `keras.ops.dot_product_attention`."""
    import subprocess
    import sys

    pytest.importorskip(backend)
    from tests.environments import ROOT, child_env

    env = child_env(drop=(config.ENV_VAR,), KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-c", _OTHER_BACKEND_SCRIPT], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
