"""`DecoderOnlyLM.describe()`: the one description the graph writers read.

The description must carry everything the model computes: a NumPy forward
pass written here from the description alone (float64) gives Keras's logits
on every variant of tests/export/decoder_variants.py that it can describe; the
options it cannot carry are named; weights are views of the variables.
Backend-agnostic: nothing here uses TensorFlow's graph.
"""

import math

import keras
import numpy as np
import pytest

from keras_attn import description as description_lib
from keras_attn.export import capabilities
from keras_attn.generation import DecoderOnlyLM
from tests import reference
from tests import tolerance
from tests.export.decoder_variants import VARIANTS
from tests.export.decoder_variants import VOCAB
from tests.export.decoder_variants import make_lm


def _norm(x, norm):
    if norm is None:
        return x
    scale = norm.scale.read().astype(np.float64)
    if norm.kind == "layer":
        return reference.layer_norm(x, scale, norm.bias.read().astype(np.float64), norm.epsilon)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + norm.epsilon) * scale


def _linear(x, dense):
    return reference.linear(x, dense.kernel.read(), None if dense.bias is None else dense.bias.read())


def _rotate(x, rotary, cos, sin):
    """Rotate-half over the first `rotary_dim` features of `x` `(T, H, D)`."""
    half = rotary.rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def numpy_logits(d, ids):
    """Logits `(T, V)` of one row `ids` computed from the description `d` only."""
    t = len(ids)
    x = d.embedding.read().astype(np.float64)[ids]
    if d.positions.kind == "learned":
        x = x + d.positions.table.read()[np.arange(t)]
    if d.embedding_scale is not None:
        x = x * d.embedding_scale
    for layer in d.layers:
        a = layer.attention
        h = _norm(x, layer.attention_norm)
        q = _linear(h, a.query).reshape(t, a.num_heads, a.head_dim)
        k = _linear(h, a.key).reshape(t, a.num_key_value_heads, a.head_dim)
        v = _linear(h, a.value).reshape(t, a.num_key_value_heads, a.head_dim)
        q, k = _norm(q, a.query_norm), _norm(k, a.key_norm)
        if a.rotary is not None:
            cos, sin = (c.astype(np.float64) for c in a.rotary.tables(t))
            q, k = _rotate(q, a.rotary, cos, sin), _rotate(k, a.rotary, cos, sin)
        mask = reference.causal(t)
        if a.window is not None:
            mask &= np.arange(t)[None, :] > np.arange(t)[:, None] - a.window
        k = np.repeat(k, a.num_heads // a.num_key_value_heads, axis=1)
        v = np.repeat(v, a.num_heads // a.num_key_value_heads, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(a.head_dim)
        if a.logit_soft_cap is not None:
            scores = a.logit_soft_cap * np.tanh(scores / a.logit_soft_cap)
        probs = reference.softmax(np.where(mask, scores, -np.inf))
        out = np.einsum("hqk,khd->qhd", probs, v).reshape(t, -1)
        x = x + _norm(_linear(out, a.output), layer.attention_post_norm)
        f = layer.feedforward
        h = _norm(x, layer.feedforward_norm)
        act = {"silu": lambda z: z / (1 + np.exp(-z)), "relu": reference.relu, "gelu": reference.gelu,
               "gelu_tanh": lambda z: 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
               }[f.activation]
        h = act(_linear(h, f.gate)) * _linear(h, f.up) if f.gate is not None else act(_linear(h, f.up))
        x = x + _norm(_linear(h, f.down), layer.feedforward_post_norm)
    h = _norm(x, d.final_norm)
    logits = h @ d.embedding.read().T.astype(np.float64) if d.tied else _linear(h, d.head)
    if d.final_logit_soft_cap is not None:
        logits = d.final_logit_soft_cap * np.tanh(logits / d.final_logit_soft_cap)
    return logits


# The variants a NumPy pass from the description can compute (not
# Gemma 4's shared keys, per-layer inputs and value norms, nor relative or
# sinusoidal positions, which no description field carries as numbers).
NUMPY_VARIANTS = sorted(n for n in VARIANTS if n not in ("gemma4", "relative", "sinusoidal"))


@pytest.mark.parametrize("name", NUMPY_VARIANTS)
def test_a_numpy_pass_over_the_description_gives_keras_logits(name):
    lm = make_lm(name)
    ids = np.random.default_rng(1).integers(1, VOCAB, (1, 12)).astype("int32")
    want = keras.ops.convert_to_numpy(lm(ids))[0]
    got = numpy_logits(lm.describe(), ids[0])
    tolerance.assert_close(want, got, terms=tolerance.LAYER_TERMS * lm.num_layers, err_msg=name)


def test_rotary_tables_are_the_textbook_angles():
    """Plain rotary: cos/sin of `p / base^(2i/D)`, computed here."""
    d = make_lm("llama").describe()
    rotary = d.layers[0].attention.rotary
    cos, sin = rotary.tables(20)
    base = rotary.layer.max_wavelength
    angles = np.arange(20)[:, None] * base ** (-2 * np.arange(rotary.rotary_dim // 2) / rotary.head_dim)
    tolerance.assert_close(cos, np.cos(angles), scale=1.0)
    tolerance.assert_close(sin, np.sin(angles), scale=1.0)


def test_every_model_option_is_described_or_named():
    """A new `DecoderOnlyLM` option must be added to `DESCRIBED_OPTIONS` (and
    to the description) or it is refused by name: never exported as if absent."""
    lm = make_lm("llama")
    assert set(lm.get_config()) <= DecoderOnlyLM.DESCRIBED_OPTIONS, (
        set(lm.get_config()) - DecoderOnlyLM.DESCRIBED_OPTIONS)

    class WithNewOption(DecoderOnlyLM):
        def get_config(self):
            return {**super().get_config(), "new_option": 3}

    new = WithNewOption(**{k: v for k, v in lm.get_config().items() if k not in ("name", "trainable", "dtype")})
    d = new.describe()
    assert d.unsupported == (("new_option", "a model option"),)
    for writer in capabilities.DECODERS:
        assert "new_option" in capabilities.support(d, writer)


def test_weights_are_views_of_the_variables_and_read_on_demand():
    lm = make_lm("qwen2")
    d = lm.describe()
    query = d.layers[0].attention.query
    assert query.kernel.shape == (48, 6 * 16) and query.bias.shape == (6 * 16,)
    assert d.layers[0].attention.output.kernel.shape == (6 * 16, 48)
    kernel = query.kernel.read()
    assert not kernel.flags.writeable
    if keras.backend.backend() in ("tensorflow", "torch", "jax"):
        assert description_lib.array_of(lm.blocks[0].self_attention.query_dense.kernel).base is not None
    np.testing.assert_array_equal(kernel, keras.ops.convert_to_numpy(
        lm.blocks[0].self_attention.query_dense.kernel).reshape(48, -1))
    # Read when asked: a change to the variable after describe() is seen.
    # (A view read before may see it too: torch assigns in place.)
    before = np.array(kernel)
    variable = lm.blocks[0].self_attention.query_dense.kernel
    variable.assign(variable + 1.0)
    np.testing.assert_array_equal(query.kernel.read(), before + 1.0)
    # The packed projection is a fresh array (writers scale it in place).
    packed = d.layers[0].attention.packed_kernel()
    assert packed.flags.writeable and packed.shape == (48, 6 * 16 + 2 * 2 * 16)


def test_lora_kernels_are_read_merged():
    """A LoRA-enabled kernel is served merged (PEFT-style, the default, as Keras
    does for its own LoRA): the description reads it so."""
    lm = make_lm("llama")
    lm.enable_lora(2)
    dense = lm.blocks[0].self_attention.query_dense
    dense.lora_kernel_b.assign(np.ones(dense.lora_kernel_b.shape, "float32"))
    got = lm.describe().layers[0].attention.query.kernel.read()
    want = keras.ops.convert_to_numpy(dense.kernel).reshape(48, -1)
    np.testing.assert_array_equal(got, want)
    assert np.abs(got - keras.ops.convert_to_numpy(dense._kernel).reshape(48, -1)).max() > 0


def test_cache_layout_per_layer():
    d = make_lm("gemma4").describe()
    layout = d.cache_layout(16)
    assert [(c.num_key_value_heads, c.head_dim, c.slots, c.ring, c.shares) for c in layout] == [
        (2, 16, 5, True, None), (1, 32, 16, False, None), (1, 32, 16, False, 1)]
    assert d.stacked_cache(16) == (16, False)
    assert make_lm("mistral").describe().stacked_cache(16) == (5, True)


def test_the_docs_show_the_capability_table():
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "generation.md").read_text()
    shown = re.search(r"<!-- capabilities:[^>]*-->\n(.*?)\n<!-- /capabilities -->", text, re.S).group(1)
    assert shown == capabilities.markdown_table()
