"""Fine-tuning converted decoders: LoRA on the projections (PEFT-style, the
default; against the merged-kernel formula written here) and a `keras.distribution` layout map
(sharded on 8 virtual JAX CPU devices, same loss and gradients as one)."""

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from keras_attn.generation import DecoderOnlyLM
from tests import tolerance
from tests.environments import ROOT, child_env


def llama_like(**overrides):
    kwargs = dict(
        vocabulary_size=48, sequence_length=32, hidden_dim=32, num_layers=2, num_heads=4,
        num_key_value_heads=2, intermediate_dim=40, position="rotary", normalization="rms_norm",
        use_gated_feedforward=True, activation="silu", attention_use_bias=False,
        feedforward_use_bias=False, lm_head_use_bias=False,
    )
    kwargs.update(overrides)
    return DecoderOnlyLM(**kwargs)


def test_lora_trains_only_the_adapters_and_merges_as_the_formula(rng):
    keras.utils.set_random_seed(1)
    lm = llama_like()
    ids = rng.integers(1, 48, size=(8, 10)).astype("int32")
    before = np.asarray(lm(ids))
    frozen = {v.path: v.numpy().copy() for v in lm.weights}
    adapted = lm.enable_lora(4, target_names=("query", "value", "feedforward_gate_dense"))
    assert len(adapted) == 3 * lm.num_layers
    names = sorted({v.path.split("/")[-1] for v in lm.trainable_weights})
    assert names == ["lora_kernel_a", "lora_kernel_b"], names
    assert len(lm.trainable_weights) == 2 * len(adapted)
    # lora_kernel_b starts at zero: the outputs are unchanged.
    np.testing.assert_array_equal(np.asarray(lm(ids)), before)

    lm.compile(keras.optimizers.Adam(1e-2),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = lm.fit(ids[:, :-1], ids[:, 1:], epochs=5, batch_size=8, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    for v in lm.weights:  # every pre-existing variable is untouched
        if v.path in frozen:
            np.testing.assert_array_equal(v.numpy(), frozen[v.path], err_msg=v.path)

    # Reference: a model without LoRA whose kernels are W + A @ B * alpha / rank.
    merged = llama_like()
    merged(ids)
    for target, source in zip(merged.weights, [v for v in lm.weights if v.path in frozen]):
        target.assign(source)
    for layer in adapted:
        a, b = layer.lora_kernel_a.numpy(), layer.lora_kernel_b.numpy()
        assert np.abs(b).max() > 0, "the adapters did not train"
        delta = (a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)) * (layer.lora_alpha / layer.lora_rank)
        twin = {l.path.split("/", 1)[-1]: l for l in merged._flatten_layers() if l.path}[
            layer.path.split("/", 1)[-1]]
        twin.kernel.assign(layer._kernel.numpy() + delta.reshape(layer._kernel.shape))
    tolerance.assert_close(np.asarray(lm(ids)), np.asarray(merged(ids)), terms=2 * 64)


def test_lora_errors():
    lm = llama_like()
    with pytest.raises(ValueError, match="target_names"):
        lm(np.ones((1, 2), "int32"))
        lm.enable_lora(2, target_names=("qkv",))
    with pytest.raises(ValueError, match="rank"):
        lm.enable_lora(0)


_SHARDED = textwrap.dedent('''
    import os, sys, json
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, keras, numpy as np
    sys.path.insert(0, sys.argv[1])
    from tests.generation.test_lm_finetuning import llama_like
    assert len(jax.devices()) == 8, jax.devices()
    SIZES = dict(num_heads=8, num_key_value_heads=4)  # divisible by the 4 model shards

    def loss_and_grads(distribution):
        keras.utils.set_random_seed(0)
        ids = np.random.default_rng(0).integers(1, 48, size=(8, 12)).astype("int32")
        if distribution is None:
            lm = llama_like(**SIZES)
            lm(ids[:, :-1])
        else:
            with distribution.scope():
                lm = llama_like(**SIZES)
                lm(ids[:, :-1])
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        variables = [v.value for v in lm.trainable_variables]

        def loss(values):
            logits, _ = lm.stateless_call(values, [v.value for v in lm.non_trainable_variables],
                                          ids[:, :-1])
            return loss_fn(ids[:, 1:], logits)

        value, grads = jax.value_and_grad(loss)(variables)
        shards = {v.path: str(getattr(v.value.sharding, "spec", "")) for v in lm.trainable_variables}
        return float(value), [np.asarray(g) for g in grads], shards

    single = loss_and_grads(None)
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"], keras.distribution.list_devices())
    probe = llama_like(**SIZES)
    layout = probe.get_layout_map(mesh)
    parallel = keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="data")
    sharded = loss_and_grads(parallel)
    scale = max(np.abs(g).max() for g in single[1])
    print(json.dumps({
        "loss": [single[0], sharded[0]],
        "max_grad_diff": max(float(np.abs(a - b).max()) for a, b in zip(single[1], sharded[1])),
        "grad_scale": float(scale),
        "sharded": sorted(k for k, s in sharded[2].items() if "model" in s),
    }))
''')


@pytest.mark.slow
def test_layout_map_shards_heads_and_feedforward_with_the_same_gradients(tmp_path):
    """8 virtual CPU devices in a (data=2, model=4) mesh, on the JAX backend
    (a fresh process: the device count is fixed when JAX starts)."""
    import json

    script = tmp_path / "sharded.py"
    script.write_text(_SHARDED)
    root = str(ROOT)
    env = child_env(drop=("KERAS_BACKEND", "XLA_FLAGS"))
    result = subprocess.run([sys.executable, str(script), root], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    single, sharded = report["loss"]
    tolerance.assert_close(sharded, single, terms=2 * 64)
    assert report["max_grad_diff"] <= tolerance.bound(report["grad_scale"], terms=4 * 64)
    kinds = {path.split("/")[-2] for path in report["sharded"]}
    assert {"query", "key", "value", "attention_output", "feedforward_gate_dense",
            "feedforward_intermediate_dense", "feedforward_output_dense"} <= kinds, kinds
