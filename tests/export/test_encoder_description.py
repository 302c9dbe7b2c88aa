"""`description.read_encoder`: the one description the encoder writers read.

The description must carry everything the model computes: a NumPy forward
pass written here from the description alone (float64) gives Keras's
outputs on encoders with and without token types, post- and pre-norm,
causal, padded queries zeroed or not, Dense heads and a pooler's
`x[:, i, :]`; the settings the writers lack are found by the capability
table, whose reason each writer raises. Backend-agnostic: nothing here uses
TensorFlow's graph.
"""

import math

import keras
import numpy as np
import pytest

from keras_attn import description as description_lib
from keras_attn import layers as kal
from keras_attn.export import capabilities
from keras_attn.export import onnx_fused
from keras_attn.export import tflite_encoder
from keras_attn.export.capabilities import NotFusableError
from tests import reference
from tests import tolerance
from tests.model_zoo import bert_feed
from tests.model_zoo import bert_like
from tests.model_zoo import randomize

ACTIVATIONS = {
    "linear": lambda z: z, "relu": reference.relu, "tanh": np.tanh, "gelu": reference.gelu,
    "gelu_tanh": lambda z: 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3))),
}


def _read(weight):
    return None if weight is None else weight.read().astype(np.float64)


def _norm(x, norm):
    return x if norm is None else reference.layer_norm(x, _read(norm.scale), _read(norm.bias), norm.epsilon)


def _linear(x, dense):
    return reference.linear(x, _read(dense.kernel), _read(dense.bias))


def _block(step, x, padding):
    a, f = step.layer.attention, step.layer.feedforward
    b, t, _ = x.shape

    def attend(h):
        q, k, v = (_linear(h, p).reshape(b, t, a.num_heads, a.head_dim) for p in (a.query, a.key, a.value))
        mask = np.ones((b, 1, t, t), bool)
        if padding is not None:
            mask &= padding[:, None, None, :]
        if step.causal:
            mask &= reference.causal(t)
        out = reference.attention(q, k, v, mask)[0].reshape(b, t, -1)  # rows seeing no key: zeros
        if padding is not None and step.mask_padded_queries:
            out = out * padding[:, :, None]
        return _linear(out, a.output)

    def feedforward(h):
        return _linear(ACTIVATIONS[f.activation](_linear(h, f.up)), f.down)

    for fn, norm in ((attend, step.layer.attention_norm), (feedforward, step.layer.feedforward_norm)):
        x = x + fn(_norm(x, norm)) if step.normalize_first else _norm(x + fn(x), norm)
    return x


def numpy_outputs(d, feed):
    """The outputs of the encoder `d` on `feed` (input name -> array), from the description only."""
    values = {t.value: np.asarray(feed[t.name]) for t in d.inputs}
    for step in d.steps:
        if isinstance(step, description_lib.EmbeddingStep):
            ids = values[step.input]
            x = _read(step.tokens)[ids] + _read(step.positions.table)[:ids.shape[1]]
            if step.types is not None:
                x = x + (_read(step.types)[0] if step.type_ids is None else _read(step.types)[values[step.type_ids]])
            y = _norm(x, step.norm)
        elif isinstance(step, description_lib.BlockStep):
            padding = None if step.padding is None else values[step.padding].astype(bool)
            y = _block(step, values[step.input], padding)
        elif isinstance(step, description_lib.DenseStep):
            y = ACTIVATIONS[step.activation](_linear(values[step.input], step.dense))
        elif isinstance(step, description_lib.CompareStep):
            y = (values[step.input] == step.scalar) == step.equal
        elif isinstance(step, description_lib.GetItemStep):
            y = values[step.input][tuple(slice(None) if k is None else k for k in step.key)]
        else:
            y = values[step.input]
        values[step.output] = y
    return [values[t.value] for t in d.outputs]


def features_encoder():
    """Features in, no biases in the block, an `equal` padding mask, Dense
    heads on every position and on the last (a negative index)."""
    x_in = keras.Input((None, 32), name="features")
    mask = keras.Input((None,), dtype="int32", name="mask")
    x = kal.TransformerEncoderBlock(num_heads=4, intermediate_dim=48, activation="relu", normalize_first=True,
                                    attention_use_bias=False, feedforward_use_bias=False,
                                    name="block")(x_in, padding_mask=keras.ops.equal(mask, 1))
    heads = [keras.layers.Dense(16, activation="gelu", name="head")(x),
             keras.layers.Dense(3, activation="tanh", name="last")(x[:, -1, :])]
    model = keras.Model([x_in, mask], heads)
    randomize(model, 7)
    return model


def _features_feed():
    rng = np.random.default_rng(3)
    mask = np.ones((3, 9), "int32")
    mask[1, 6:] = 0
    mask[2] = 0  # no token: every key masked
    return {"features": rng.normal(size=(3, 9, 32)).astype("float32"), "mask": mask}


def _bert_feed():
    feed = bert_feed(batch=3, length=9, seed=11)
    feed["attention_mask"][2] = 0
    feed["attention_mask"][2, 2:6] = 1  # left padding: a causal first query sees no key
    return feed


VARIANTS = {
    "post_norm": (lambda: bert_like(normalize_first=False, activation="gelu", layers=2, seed=1), _bert_feed),
    "pre_norm_causal": (lambda: bert_like(normalize_first=True, activation="gelu_tanh", layers=1, seed=2,
                                          mask_padded_queries=True, causal=True), _bert_feed),
    "post_norm_padded_queries": (lambda: bert_like(normalize_first=False, activation="relu", layers=1, seed=4,
                                                   mask_padded_queries=True), _bert_feed),
    "features": (features_encoder, _features_feed),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_numpy_pass_over_the_description_gives_keras_outputs(name):
    make, feed = VARIANTS[name]
    model, feed = make(), feed()
    d = description_lib.read_encoder(model)
    assert not d.unsupported and capabilities.support(d, "onnx_encoder") is None
    want = [keras.ops.convert_to_numpy(w) for w in model(feed, training=False)]
    got = numpy_outputs(d, feed)
    tolerance.assert_all_close(got, want, terms=tolerance.LAYER_TERMS * len(d.layers), err_msg=name)


def test_steps_name_their_values_and_weights_are_views():
    d = description_lib.read_encoder(bert_like(normalize_first=False, activation="gelu", layers=1, seed=1))
    kinds = [type(s).__name__ for s in d.steps]
    assert kinds == ["EmbeddingStep", "Step", "CompareStep", "BlockStep", "GetItemStep", "DenseStep",
                     "Step", "Step"], kinds
    embedding, _, padding, block, first = d.steps[:5]
    assert (embedding.input, embedding.type_ids) == ("input_ids", "token_type_ids")
    assert block.padding == padding.output and not padding.equal and first.key == (None, 0, None)
    assert [t.name for t in d.outputs] == ["last_hidden_state", "pooler_output"]
    assert [(t.name, t.vocabulary) for t in d.inputs] == [
        ("input_ids", 50), ("attention_mask", None), ("token_type_ids", None)]
    assert block.layer.attention.query.kernel.shape == (32, 32)
    tokens = embedding.tokens.read()
    assert not tokens.flags.writeable
    if keras.backend.backend() in ("tensorflow", "torch", "jax"):
        assert tokens.base is not None


def _block_model(**options):
    inputs = keras.Input((None, 32), name="x")
    return keras.Model(inputs, kal.TransformerEncoderBlock(num_heads=4, intermediate_dim=48, **options)(inputs))


def _write(writer, model, tmp_path):
    if writer == "onnx_encoder":
        return onnx_fused.direct_model_proto(model)
    return tflite_encoder.write_encoder_tflite(model, tmp_path / "m.tflite")


# The settings of the converted families (rotary, windows, grouped heads,
# QK-norm, sandwich and RMS norms, gated feed-forwards, SiLU) are written:
# tests/export/test_encoder_families_direct.py.
@pytest.mark.parametrize("options, text", [
    (dict(logit_soft_cap=2.0), "logit_soft_cap=2.0"),
    (dict(activation="elu"), "activation='elu'"),
])
@pytest.mark.parametrize("writer", sorted(capabilities.ENCODERS))
def test_block_settings_the_writers_lack_are_refused_with_the_tables_reason(options, text, writer, tmp_path):
    model = _block_model(**options)
    reason = capabilities.support(description_lib.read_encoder(model), writer)
    assert reason is not None and text in reason and capabilities.WRITERS[writer] in reason, reason
    with pytest.raises(NotFusableError) as raised:
        _write(writer, model, tmp_path)
    assert str(raised.value) == reason


def test_calls_the_description_does_not_carry_are_named():
    ids = keras.Input((None,), dtype="int32", name="ids")
    embedding = kal.TokenAndPositionEmbedding(20, 8, 16, position="learned", mask_zero=True, name="embed")
    x = embedding(ids)
    x = kal.TransformerEncoderBlock(2, intermediate_dim=8, name="block")(x)  # the Keras mask as padding
    x = keras.layers.Dropout(0.1, name="drop")(x, training=True)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    d = description_lib.read_encoder(keras.Model(ids, pooled))
    assert d.unsupported == (("block", "inherits a Keras mask"), ("drop", "called with training=True"),
                             ("pool", "GlobalAveragePooling1D layer"))
    assert d.steps[0].mask_zero
    for writer in capabilities.ENCODERS:
        assert "embed: mask_zero=True" in capabilities.support(d, writer)


def test_what_one_encoder_writer_covers_and_the_other_not():
    """A negative index and a rank-1 input: ONNX's Gather takes them, the
    TFLite writer's tensors (sequences kept as rows) do not."""
    d = description_lib.read_encoder(features_encoder())
    assert capabilities.support(d, "onnx_encoder") is None
    assert "key (None, -1, None) (negative indices)" in capabilities.support(d, "tflite_encoder")
    scalar = keras.Input((), name="scale")
    d = description_lib.read_encoder(keras.Model(scalar, keras.layers.Identity()(scalar)))
    assert capabilities.support(d, "onnx_encoder") is None
    assert "input scale of shape (None,)" in capabilities.support(d, "tflite_encoder")


def test_a_description_goes_to_writers_of_its_kind():
    d = description_lib.read_encoder(_block_model())
    with pytest.raises(ValueError, match="reads a Decoder, not an Encoder"):
        capabilities.support(d, "litertlm")
    with pytest.raises(NotFusableError, match="takes a functional Keras model, not Sequential"):
        capabilities.describe(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), "onnx_encoder")


def test_the_docs_show_the_encoder_writers_table():
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "export_serving.md").read_text()
    shown = re.search(r"<!-- capabilities:[^>]*-->\n(.*?)\n<!-- /capabilities -->", text, re.S).group(1)
    assert shown == capabilities.markdown_table(capabilities.ENCODERS)
