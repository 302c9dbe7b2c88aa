"""LoRA with PEFT's meaning (`enable_lora`'s default style) and PEFT folders
both ways (`save_peft_adapter`, `from_huggingface(adapter=...)`).

The layer math against NumPy written here (an adapter over the whole input
and output of query, output and feed-forward projections, dropout on the
adapter's input only); the trainable-parameter count against PEFT's; the
merged kernel the description and `.keras` files see; and converted tiny
random Llama/Mistral/Qwen2/Qwen3/Gemma models against
`peft.PeftModel` with trained (non-zero B) adapters, each direction. Whole
models back to `transformers` (`save_huggingface`), every decoder family
that converts, against the `transformers` model loading the folder.
"""

import contextlib
import json
import os
import warnings

import keras
import numpy as np
import pytest

from keras_attn.generation import DecoderOnlyLM
from keras_attn.generation import Seq2SeqLM
from keras_attn.generation import lora
from keras_attn.layers import MultiHeadAttention
from tests import tolerance


def tiny_lm(**overrides):
    kwargs = dict(
        vocabulary_size=40, sequence_length=16, hidden_dim=24, num_layers=2, num_heads=6,
        num_key_value_heads=2, intermediate_dim=20, position="rotary", normalization="rms_norm",
        use_gated_feedforward=True, activation="silu", attention_use_bias=True,
        feedforward_use_bias=True, lm_head_use_bias=False,
    )
    kwargs.update(overrides)
    lm = DecoderOnlyLM(**kwargs)
    lm(np.ones((1, 3), "int32"))
    return lm


def _randomise_b(layers, seed=0, scale=0.5):
    rng = np.random.default_rng(seed)
    for layer in layers:
        layer.lora_kernel_b.assign(rng.standard_normal(layer.lora_kernel_b.shape).astype("float32") * scale)


# --- the layer math against NumPy ---------------------------------------------


def test_adapters_span_every_head_and_match_numpy():
    """Query `(D, H, d)`: A `(D, r)`, B `(r, H*d)`; output `(H, d, D)`: A
    `(H*d, r)`; gate Dense with its activation after the update. Each layer's
    output is `act(x @ W + alpha/r * x @ A @ B + b)` with heads flattened in
    C order, in float64 NumPy."""
    lm = tiny_lm()
    layers = lm.enable_lora(3, target_names=("q_proj", "o_proj", "feedforward_gate_dense"), lora_alpha=6)
    block = lm.blocks[0]
    query, output = block.self_attention.query_dense, block.self_attention.output_dense
    gate = block.feedforward_gate_dense
    assert tuple(query.lora_kernel_a.shape) == (24, 3) and tuple(query.lora_kernel_b.shape) == (3, 6 * 4)
    assert tuple(output.lora_kernel_a.shape) == (6 * 4, 3) and tuple(output.lora_kernel_b.shape) == (3, 24)
    assert tuple(gate.lora_kernel_a.shape) == (24, 3) and tuple(gate.lora_kernel_b.shape) == (3, 20)
    _randomise_b(layers)
    rng = np.random.default_rng(1)
    for layer, x in ((query, rng.standard_normal((2, 5, 24))), (output, rng.standard_normal((2, 5, 6, 4))),
                     (gate, rng.standard_normal((2, 5, 24)))):
        x = x.astype("float32")
        w = np.asarray(layer._kernel.numpy(), np.float64)
        a, b = (np.asarray(v.numpy(), np.float64) for v in (layer.lora_kernel_a, layer.lora_kernel_b))
        in_size = a.shape[0]
        flat_x = x.reshape(2, 5, in_size).astype(np.float64)
        want = flat_x @ w.reshape(in_size, -1) + 2.0 * flat_x @ a @ b + np.asarray(layer.bias.numpy()).reshape(-1)
        if layer is gate:
            want = want / (1 + np.exp(-want))  # silu
        got = keras.ops.convert_to_numpy(layer(x)).reshape(want.shape)
        tolerance.assert_close(got, want, terms=in_size, err_msg=layer.name)


def test_only_a_and_b_train_and_outputs_start_unchanged():
    lm = tiny_lm()
    ids = np.random.default_rng(0).integers(1, 40, (2, 7)).astype("int32")
    before = keras.ops.convert_to_numpy(lm(ids))
    layers = lm.enable_lora(4, target_names=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                             "up_proj", "down_proj"))
    assert len(layers) == 7 * 2
    assert sorted({v.path.split("/")[-1] for v in lm.trainable_weights}) == ["lora_kernel_a", "lora_kernel_b"]
    for layer in layers:
        assert not layer.bias.trainable and not layer._kernel.trainable
        in_size = layer.lora_kernel_a.shape[0]
        # PEFT's kaiming_uniform_(a=sqrt(5)) on (r, in): uniform in +-1/sqrt(in).
        a = layer.lora_kernel_a.numpy()
        assert np.abs(a).max() <= 1 / np.sqrt(in_size) and np.abs(a).max() > 0.5 / np.sqrt(in_size)
        assert not np.any(layer.lora_kernel_b.numpy())
        assert (layer.lora_rank, layer.lora_alpha) == (4, lora.PEFT_ALPHA)
    queries = [block.self_attention.query_dense.lora_kernel_a.numpy() for block in lm.blocks]
    assert not np.array_equal(*queries), "every layer started from the same A"
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(lm(ids)), before)


def test_dropout_is_on_the_adapter_input_only():
    lm = tiny_lm()
    query = lm.enable_lora(2, target_names="query", dropout=0.5)[0]
    x = np.random.default_rng(0).standard_normal((2, 5, 24)).astype("float32")
    # B = 0: dropping the adapter's input changes nothing (the base is not dropped).
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(query(x, training=True)),
                                  keras.ops.convert_to_numpy(query(x, training=False)))
    _randomise_b([query])
    train = [keras.ops.convert_to_numpy(query(x, training=True)) for _ in range(2)]
    infer = [keras.ops.convert_to_numpy(query(x, training=False)) for _ in range(2)]
    np.testing.assert_array_equal(infer[0], infer[1])
    assert not np.array_equal(train[0], infer[0]) and not np.array_equal(train[0], train[1])


def test_trainable_count_at_qwen2_5_0_5b_shape_is_peft_s():
    """Qwen2.5-0.5B: hidden 896, 14 query heads and 2 key/value heads of 64,
    24 layers. PEFT's LoraConfig(r=16, target_modules=["q_proj", "v_proj"])
    trains 24 * 16 * ((896 + 896) + (896 + 128)) = 1,081,344 parameters (one
    layer built here at the real shape, times 24); Keras's per-head LoRA,
    biases still trainable, 5.2 times as many."""
    def one_layer(style):
        layer = MultiHeadAttention(14, 64, num_key_value_heads=2, use_bias=True)
        layer.build((1, 4, 896), (1, 4, 896))
        if style == "peft":
            lora.adapt(layer, [layer.query_dense, layer.value_dense], 16, 32)
        else:
            layer.query_dense.enable_lora(16)
            layer.value_dense.enable_lora(16)
        return sum(int(np.prod(v.shape)) for d in (layer.query_dense, layer.value_dense)
                   for v in d.trainable_weights)

    assert 24 * one_layer("peft") == 1_081_344
    # The count before this change: per-head adapters and the q/v biases.
    assert 24 * one_layer("keras") == 5_578_752


def test_keras_style_stays_available_per_head():
    lm = tiny_lm()
    layers = lm.enable_lora(2, target_names=("query",), style="keras")
    query = layers[0]
    assert not isinstance(query, lora.LoRALayer)
    assert tuple(query.lora_kernel_a.shape) == (24, 6, 2) and tuple(query.lora_kernel_b.shape) == (2, 4)
    assert query.lora_alpha == 2  # Keras's default: rank


def test_merge_unmerge_and_the_merged_kernel_everyone_reads(tmp_path):
    lm = tiny_lm()
    ids = np.random.default_rng(0).integers(1, 40, (2, 7)).astype("int32")
    layers = lm.enable_lora(2, target_names=("query", "value", "down_proj"), lora_alpha=4)
    _randomise_b(layers)
    query = lm.blocks[0].self_attention.query_dense
    original = query._kernel.numpy().copy()
    want_kernel = original.reshape(24, -1) + 2.0 * query.lora_kernel_a.numpy() @ query.lora_kernel_b.numpy()
    # The description (every writer's input) reads the kernel merged.
    read = lm.describe().layers[0].attention.query.kernel.read()
    tolerance.assert_close(read, want_kernel, terms=2)
    active = keras.ops.convert_to_numpy(lm(ids))
    lm.predict(ids, verbose=0)  # a traced predict, which must not outlive the merge
    lm.merge_lora()
    assert all(layer.lora_merged for layer in layers)
    tolerance.assert_close(query._kernel.numpy().reshape(24, -1), want_kernel, terms=2)
    tolerance.assert_close(lm.describe().layers[0].attention.query.kernel.read(), want_kernel, terms=2)
    tolerance.assert_close(keras.ops.convert_to_numpy(lm(ids)), active, terms=2 * 64)
    tolerance.assert_close(lm.predict(ids, verbose=0), active, terms=2 * 64)
    lm.unmerge_lora()
    tolerance.assert_close(query._kernel.numpy(), original, scale=np.abs(want_kernel).max(), terms=2)
    tolerance.assert_close(keras.ops.convert_to_numpy(lm(ids)), active, terms=2 * 64)

    # `.keras` holds the merged kernels: the reloaded model has no adapters
    # and the same logits.
    path = str(tmp_path / "lm.keras")
    lm.save(path)
    back = keras.saving.load_model(path)
    assert not lora.adapted_layers(back)
    tolerance.assert_close(keras.ops.convert_to_numpy(back(ids)), active, terms=2 * 64)


def test_seq2seq_adapts_encoder_self_and_cross_attention():
    model = Seq2SeqLM(40, 12, 16, num_layers=2, num_heads=4, intermediate_dim=24, position="rotary")
    ids = np.random.default_rng(0).integers(1, 40, (2, 6)).astype("int32")
    before = keras.ops.convert_to_numpy(model((ids, ids)))
    layers = model.enable_lora(2, target_names=("q_proj", "attention_output"))
    # Per layer: the encoder's self-attention, the decoder's self- and cross-attention.
    assert len(layers) == 2 * 3 * 2 and all(isinstance(layer, lora.LoRALayer) for layer in layers)
    assert sorted({v.path.split("/")[-1] for v in model.trainable_weights}) == ["lora_kernel_a", "lora_kernel_b"]
    _randomise_b(layers)
    active = keras.ops.convert_to_numpy(model((ids, ids)))
    assert np.abs(active - before).max() > 0.1 * np.abs(before).max()
    model.merge_lora()
    tolerance.assert_close(keras.ops.convert_to_numpy(model((ids, ids))), active, terms=4 * 64)


def test_mixed_precision_keeps_float32_adapters():
    """Under mixed_bfloat16 the adapters stay float32 variables (as Keras keeps
    its own) and the layer's output is the float32 layer's to bfloat16."""
    keras.utils.set_random_seed(0)
    reference = tiny_lm()
    _randomise_b(reference.enable_lora(2, target_names=("query", "down_proj")))
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    lm = tiny_lm()
    layers = lm.enable_lora(2, target_names=("query", "down_proj"))
    for target, source in zip(lm.weights, reference.weights):
        target.assign(source)
    assert {layer.lora_kernel_a.dtype for layer in layers} == {"float32"}
    x = np.random.default_rng(0).standard_normal((2, 5, 24)).astype("float32")
    query, want_query = lm.blocks[0].self_attention.query_dense, reference.blocks[0].self_attention.query_dense
    got = query(x)
    assert keras.backend.standardize_dtype(got.dtype) == "bfloat16"
    want = keras.ops.convert_to_numpy(want_query(x))
    tolerance.assert_close(keras.ops.convert_to_numpy(keras.ops.cast(got, "float32")), want,
                           ulps=4, terms=24, dtype="bfloat16")


def _int8_weight(layer, float_kernel):
    """`layer`'s int8 kernel dequantized in NumPy, `(in, out)`, checked to be
    `float_kernel` (the kernel before `quantize`) rounded per output channel:
    within half a quantization step of it."""
    k = np.asarray(layer._kernel.numpy(), np.float64)
    in_size = int(np.prod([k.shape[i] for i in layer._lora_in_axes]))
    scale = np.asarray(layer.kernel_scale.numpy(), np.float64).reshape(-1)
    w = k.reshape(in_size, -1) / scale
    assert np.all(np.abs(w - np.asarray(float_kernel, np.float64).reshape(in_size, -1)) <= 0.5001 / scale)
    return w


def test_int8_base_dequantizes_per_channel_and_matches_numpy():
    """`quantize("int8")` then `enable_lora`: each layer computes
    `act(x @ (K / s) + alpha/r * x @ A @ B + b)` with the int8 kernel `K` and
    its per-output-channel scales `s` (weight-only; the activations are not
    quantized), in float64 NumPy; the int8 kernels stay frozen."""
    lm = tiny_lm()
    block = lm.blocks[0]
    query, output = block.self_attention.query_dense, block.self_attention.output_dense
    gate = block.feedforward_gate_dense
    floats = {id(layer): layer.kernel.numpy() for layer in (query, output, gate)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras names each layer it cannot quantize
        lm.quantize("int8")
    layers = lm.enable_lora(3, target_names=("q_proj", "o_proj", "feedforward_gate_dense"), lora_alpha=6)
    assert {layer.quantization_mode for layer in layers} == {"int8"}
    assert not any(v.trainable for layer in layers for v in (layer._kernel, layer.kernel_scale))
    _randomise_b(layers)
    rng = np.random.default_rng(1)
    for layer, x in ((query, rng.standard_normal((2, 5, 24))), (output, rng.standard_normal((2, 5, 6, 4))),
                     (gate, rng.standard_normal((2, 5, 24)))):
        x = x.astype("float32")
        w = _int8_weight(layer, floats[id(layer)])
        a, b = (np.asarray(v.numpy(), np.float64) for v in (layer.lora_kernel_a, layer.lora_kernel_b))
        flat_x = x.reshape(2, 5, w.shape[0]).astype(np.float64)
        want = flat_x @ w + 2.0 * flat_x @ a @ b + np.asarray(layer.bias.numpy()).reshape(-1)
        if layer is gate:
            want = want / (1 + np.exp(-want))  # silu
        got = keras.ops.convert_to_numpy(layer(x)).reshape(want.shape)
        tolerance.assert_close(got, want, terms=w.shape[0], err_msg=layer.name)


def test_int8_base_gradients_match_numpy():
    """One SGD step (learning rate 1) on `sum((y - t)^2) / 2` through two
    adapted int8 layers: A and B of both move by their gradients, the first
    layer's through the second's input gradient (the custom gradient that
    rebuilds the dequantized kernel), against the chain rule in float64 NumPy.

    The loss depends on `y` on purpose: with one linear in `y` no gradient
    needs the forward pass, and TensorFlow's graph optimizer (its dependency
    optimization) may then read a variable after the step has updated it.
    """
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, name="first"),
                              keras.layers.EinsumDense("ab,bcd->acd", (2, 3), bias_axes="cd", name="second")])
    floats = [layer.kernel.numpy() for layer in model.layers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.quantize("int8")
    first, second = lora.adapt(model, model.layers, rank=2, alpha=4)
    _randomise_b([first, second], seed=4)
    w1, w2 = (_int8_weight(layer, f) for layer, f in zip((first, second), floats))
    a1, b1, a2, b2 = (np.asarray(v.numpy(), np.float64) for v in (
        first.lora_kernel_a, first.lora_kernel_b, second.lora_kernel_a, second.lora_kernel_b))
    bias1, bias2 = (np.asarray(layer.bias.numpy(), np.float64).reshape(-1) for layer in (first, second))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 6)).astype("float32")
    t = rng.standard_normal((4, 2, 3)).astype("float32")
    model.compile(keras.optimizers.SGD(1.0), loss=lambda t, y: keras.ops.sum(keras.ops.square(y - t)) / 2)
    with _gradients():
        model.train_on_batch(x, t)
    s, x64 = 2.0, x.astype(np.float64)
    h = x64 @ w1 + s * x64 @ a1 @ b1 + bias1
    dy = h @ w2 + s * h @ a2 @ b2 + bias2 - t.reshape(4, 6)
    dh = dy @ w2.T + s * dy @ b2.T @ a2.T
    want = {"a2": a2 - s * h.T @ (dy @ b2.T), "b2": b2 - s * (h @ a2).T @ dy,
            "a1": a1 - s * x64.T @ (dh @ b1.T), "b1": b1 - s * (x64 @ a1).T @ dh}
    got = {"a1": first.lora_kernel_a, "b1": first.lora_kernel_b,
           "a2": second.lora_kernel_a, "b2": second.lora_kernel_b}
    for name, variable in got.items():
        tolerance.assert_close(variable.numpy(), want[name], terms=4 * 6 * 3, err_msg=name)


def test_fused_projections_add_the_low_rank_update_apart():
    """Self-attention's query, key and value run as one matmul on the frozen
    kernels, each adapter's `x @ A @ B` added apart: the same logits as the
    layers called one by one (the reference setting), and on TensorFlow the
    backward pass forms no gradient of the whole `(hidden, q + k + v)`
    kernel (the merged kernel would need one to reach A and B)."""
    from keras_attn import config

    lm = tiny_lm(vocabulary_size=50)
    layers = lm.enable_lora(3, target_names=("q_proj", "v_proj"))
    _randomise_b(layers)
    ids = np.random.default_rng(2).integers(1, 50, (2, 7)).astype("int32")
    fused = keras.ops.convert_to_numpy(lm(ids))
    with config.attention_implementation("reference"):
        one_by_one = keras.ops.convert_to_numpy(lm(ids))
    tolerance.assert_close(fused, one_by_one, ulps=8, terms=24 * 2)
    if keras.backend.backend() != "tensorflow":
        return
    import tensorflow as tf

    @tf.function
    def gradients(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(lm(ids)))
        return tape.gradient(loss, [w for layer in layers for w in layer.trainable_weights])

    function = gradients.get_concrete_function(tf.constant(ids))
    # The ops the returned gradients depend on (TensorFlow prunes the rest,
    # such as the frozen kernel's own gradient, before running).
    needed, stack = set(), [t.op for t in function.outputs]
    while stack:
        op = stack.pop()
        if op.name not in needed:
            needed.add(op.name)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
    whole = [op.name for op in function.graph.get_operations() if op.name in needed
             and op.type in ("MatMul", "BatchMatMulV2", "Einsum") and op.outputs[0].shape.as_list() == [24, 40]]
    assert not whole, whole


def _int8_chain(seed=3):
    """first (Dense) -> middle (Dense) -> last (EinsumDense), quantized to int8."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(5, name="first"), keras.layers.Dense(4, name="middle"),
        keras.layers.EinsumDense("ab,bcd->acd", (2, 3), bias_axes="cd", name="last")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.quantize("int8")
    return model


def test_int8_frozen_layers_keep_keras_numbers():
    """Adapting `first` of an int8 chain leaves `middle` and `last` frozen
    with Keras's int8 forward pass (inputs quantized too) and Keras's input
    gradient, written so TensorFlow rebuilds their dequantized kernels only
    in their turn: one SGD step moves `first`'s A and B exactly as the same
    chain run by Keras's own int8 layers does."""
    x = np.random.default_rng(5).standard_normal((4, 6)).astype("float32")
    t = np.random.default_rng(6).standard_normal((4, 2, 3)).astype("float32")
    results = []
    for keep_keras in (False, True):
        model = _int8_chain()
        (first,) = lora.adapt(model, model.layers[:1], rank=2, alpha=4)
        frozen = model.layers[1:]
        assert all(isinstance(layer, lora.FrozenInt8Layer) for layer in frozen)
        assert [type(layer).__mro__[2] for layer in frozen] == [keras.layers.Dense, keras.layers.EinsumDense]
        if keep_keras:  # the reference: Keras's own int8 layers
            for layer in frozen:
                layer.__class__ = type(layer).__mro__[2]
        _randomise_b([first], seed=4)
        forward = keras.ops.convert_to_numpy(model(x))
        model.compile(keras.optimizers.SGD(1.0), loss=lambda t, y: keras.ops.sum(keras.ops.square(y - t)) / 2)
        with _gradients():
            model.train_on_batch(x, t)
        results.append([forward] + [v.numpy() for v in (first.lora_kernel_a, first.lora_kernel_b)])
    for got, want, name in zip(*results, ("outputs", "A", "B")):
        tolerance.assert_close(got, want, ulps=2, terms=6 * 5 * 4, err_msg=name)
    assert not np.array_equal(results[0][1], _int8_chain_a_start()), "A did not move"


def _int8_chain_a_start():
    model = _int8_chain()
    (first,) = lora.adapt(model, model.layers[:1], rank=2, alpha=4)
    return first.lora_kernel_a.numpy()


def test_int8_adapting_twice_keeps_one_class_per_layer():
    """A second `adapt` turns a frozen int8 layer into a LoRA layer of its own
    Keras class, and leaves the others frozen once (not wrapped twice)."""
    model = _int8_chain()
    lora.adapt(model, model.layers[:1], rank=2, alpha=4)
    lora.adapt(model, model.layers[1:2], rank=2, alpha=4)
    first, middle, last = model.layers
    assert type(middle).__mro__[1:3] == (lora.LoRALayer, keras.layers.Dense)
    assert type(last).__mro__[1:3] == (lora.FrozenInt8Layer, keras.layers.EinsumDense)
    x = np.ones((2, 6), "float32")
    assert keras.ops.convert_to_numpy(model(x)).shape == (2, 2, 3)


def test_int8_layers_with_keras_lora_keep_keras_call():
    """A layer given Keras's own LoRA (`style="keras"`) stays Keras's layer
    when another is adapted PEFT-style: its call keeps adding its update."""
    model = _int8_chain()
    model.layers[1].enable_lora(2)
    lora.adapt(model, model.layers[:1], rank=2, alpha=4)
    middle, last = model.layers[1:]
    assert type(middle) is keras.layers.Dense and middle.lora_enabled
    assert isinstance(last, lora.FrozenInt8Layer)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's executor order")
def test_int8_input_gradients_wait_for_their_upstream():
    """In the traced backward pass every int8 kernel is cast to float only
    after its layer's upstream gradient exists (a control dependency), not
    as soon as the backward pass starts."""
    import tensorflow as tf

    model = _int8_chain()
    lora.adapt(model, model.layers[::2], rank=2, alpha=4)  # first and last adapted, middle frozen
    x = tf.constant(np.ones((4, 6), "float32"))

    @tf.function
    def gradients(x):
        with tf.GradientTape() as tape:
            y = model(x)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, model.trainable_variables)

    graph = gradients.get_concrete_function(x).graph
    # The forward pass's ops are under the model's name scope; the backward
    # pass's are not. `first`'s input gradient is not needed: two casts.
    casts = [op for op in graph.get_operations() if op.type == "Cast" and op.inputs[0].dtype == tf.int8
             and not op.name.startswith(model.name)]
    assert len(casts) == 2, [op.name for op in casts]
    for op in casts:
        source = op.inputs[0].op
        assert source.type == "Identity" and source.control_inputs, (op.name, source.type)


def test_int8_base_refuses_what_would_requantize(tmp_path):
    """Merging into an int8 kernel, saving a Keras file (which holds merged
    kernels) and quantizing after `enable_lora` each raise, naming the way
    out; the adapters themselves still save (PEFT folder tested below)."""
    lm = tiny_lm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm.quantize("int8")
    lm.enable_lora(2, target_names=("q_proj", "v_proj"))
    with pytest.raises(ValueError, match="merge.*int8.*save_peft_adapter"):
        lm.merge_lora()
    with pytest.raises(ValueError, match="int8 kernel.*save_peft_adapter.*FitCheckpoint"):
        lm.save_weights(str(tmp_path / "lm.weights.h5"))
    with pytest.raises(ValueError, match="Quantize the model first"):
        lm.blocks[0].self_attention.query_dense.quantize("int8")
    plain = tiny_lm()
    plain.enable_lora(2)
    with pytest.raises(ValueError, match="Quantize the model first"):
        plain.quantize("int8")


@pytest.mark.tensorflow_only
def test_a_search_traced_before_merge_lora_does_not_add_the_update_twice():
    """A traced search holds the adapter path: after `merge_lora` (the update
    now in the kernel) it must be traced anew (`keras_attn.structure`), else
    the update counts twice."""
    from keras_attn.generation import greedy_search

    lm = tiny_lm()
    _randomise_b(lm.enable_lora(2, target_names=("query", "value", "down_proj")), scale=2.0)
    prompt = np.random.default_rng(0).integers(1, 40, (2, 4)).astype("int32")
    before = np.asarray(greedy_search(lm, prompt, 12))
    lm.merge_lora()
    np.testing.assert_array_equal(np.asarray(greedy_search(lm, prompt, 12)), before)
    lm.unmerge_lora()
    np.testing.assert_array_equal(np.asarray(greedy_search(lm, prompt, 12)), before)


def test_weights_loaded_into_an_adapted_model_are_its_frozen_kernels(tmp_path):
    """Keras's rule (the file holds merged kernels) with A restarted, not
    zeroed: the outputs are the saved model's and B still gets gradients."""
    lm = tiny_lm()
    ids = np.random.default_rng(0).integers(1, 40, (2, 7)).astype("int32")
    _randomise_b(lm.enable_lora(2, target_names=("query", "up_proj")))
    want = keras.ops.convert_to_numpy(lm(ids))
    lm.save_weights(str(tmp_path / "lm.weights.h5"))
    twin = tiny_lm()
    layers = twin.enable_lora(2, target_names=("query", "up_proj"))
    twin.load_weights(str(tmp_path / "lm.weights.h5"))
    tolerance.assert_close(keras.ops.convert_to_numpy(twin(ids)), want, terms=2 * 64)
    for layer in layers:
        assert not np.any(layer.lora_kernel_b.numpy()) and np.abs(layer.lora_kernel_a.numpy()).max() > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(target_names=("qkv",)), r"target_names.*\['query'.*'q_proj'"),
    (dict(target_names=("gate_proj",)), "no projection of this model"),
    (dict(style="torch"), "style"),
    (dict(dropout=1.0), "dropout"),
    (dict(lora_alpha=0), "lora_alpha"),
    (dict(style="keras", dropout=0.1), "dropout"),
])
def test_errors_name_the_argument(kwargs, match):
    lm = tiny_lm(use_gated_feedforward=False)
    with pytest.raises(ValueError, match=match):
        lm.enable_lora(2, **kwargs)
    assert not lora.adapted_layers(lm)


# --- PEFT folders both ways -----------------------------------------------------

VOCAB = 53


# 6 query heads over 2 key/value heads; each family's own switches.
FAMILIES = {
    "llama": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=8)),
    "gemma": ("GemmaConfig", dict(head_dim=8)),
    # query_pre_attn_scalar != head_dim: the converter folds a factor into the
    # queries; windows shorter than IDS; soft caps that bite.
    "gemma2": ("Gemma2Config", dict(head_dim=8, query_pre_attn_scalar=16, sliding_window=4,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3_text": ("Gemma3TextConfig", dict(
        head_dim=8, query_pre_attn_scalar=16, sliding_window=4, final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "smollm3": ("SmolLM3Config", dict(no_rope_layers=[1, 0], pad_token_id=0)),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5, pad_token_id=0, tie_word_embeddings=False)),
}


def _hf_base(name, folder):
    """A random tiny `*ForCausalLM` saved to `folder` (converted from the
    folder: PEFT wraps the torch model's layers in place)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config_name, extra = FAMILIES[name]
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, intermediate_size=28,
        num_attention_heads=6, num_key_value_heads=2, attn_implementation="eager", **extra)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _hf_model(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, attn_implementation="eager").eval()


def _gradients():
    """On torch, gradients back on for `fit` (tests/conftest.py runs this
    backend-agnostic file's tests under `torch.no_grad`)."""
    if keras.backend.backend() != "torch":
        return contextlib.nullcontext()
    import torch

    return torch.enable_grad()


def _logits(torch_model, ids):
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        return torch_model(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()


ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = np.random.default_rng(3).integers(1, VOCAB, (2, 9)).astype("int32")


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_peft_adapter_loads_with_peft_s_logits(name, tmp_path):
    """Random A and B set in PEFT, saved by PEFT, loaded onto the converted
    model: the logits are PeftModel's, the adapters active and not merged."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from keras_attn.convert import from_huggingface

    base = _hf_base(name, str(tmp_path / "base"))
    targets = ALL if name == "llama" else ["q_proj", "v_proj", "down_proj"]
    peft_model = peft.get_peft_model(_hf_model(base), peft.LoraConfig(
        r=4, lora_alpha=12, lora_dropout=0.1, target_modules=targets, task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param_name, param in peft_model.named_parameters():
            if "lora_" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    want = _logits(peft_model.eval(), IDS)
    plain = _logits(_hf_model(base), IDS)

    lm = from_huggingface(base, adapter=str(tmp_path / "adapter"))
    adapted = lora.adapted_layers(lm)
    assert len(adapted) == len(targets) * 2 and not any(layer.lora_merged for layer in adapted)
    assert {(layer.lora_rank, layer.lora_alpha, layer.lora_dropout) for layer in adapted} == {(4, 12, 0.1)}
    # Trainable parameters: PEFT's count.
    ours = sum(int(np.prod(v.shape)) for v in lm.trainable_weights)
    assert ours == sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    got = keras.ops.convert_to_numpy(lm(IDS))
    assert np.abs(want - plain).max() > 0.1 * np.abs(want).max(), "the adapter changes nothing: no test"
    tolerance.assert_close(got, want, terms=2 * 64)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_our_trained_adapter_loads_into_peft(name, tmp_path):
    """Ours enabled and trained a few steps, saved by `save_peft_adapter`,
    loaded by `PeftModel.from_pretrained`: the logits are ours."""
    peft = pytest.importorskip("peft")
    from keras_attn.convert import from_huggingface
    from keras_attn.convert import save_peft_adapter

    base = _hf_base(name, str(tmp_path / "base"))
    lm = from_huggingface(base)
    targets = ("query", "v_proj", "o_proj", "up_proj") if name == "llama" else ("q_proj", "value")
    adapted = lm.enable_lora(4, target_names=targets, lora_alpha=16)
    lm.compile(keras.optimizers.Adam(0.05), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with _gradients():
        lm.fit(IDS[:, :-1], IDS[:, 1:], epochs=4, verbose=0)
    assert all(np.abs(layer.lora_kernel_b.numpy()).max() > 0 for layer in adapted), "did not train"
    got = keras.ops.convert_to_numpy(lm(IDS))

    folder = save_peft_adapter(lm, str(tmp_path / "adapter"), base_model_name_or_path=base)
    config = json.load(open(os.path.join(folder, "adapter_config.json")))
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 16, base)
    want_targets = ["o_proj", "q_proj", "up_proj", "v_proj"] if name == "llama" else ["q_proj", "v_proj"]
    assert config["target_modules"] == want_targets
    peft_model = peft.PeftModel.from_pretrained(_hf_model(base), folder).eval()
    a = dict(peft_model.named_parameters())[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"]
    assert tuple(a.shape) == (4, 24)  # PEFT's (r, in)
    tolerance.assert_close(got, _logits(peft_model, IDS), terms=2 * 64)
    # Merged on our side, the same adapter is written.
    lm.merge_lora()
    save_peft_adapter(lm, str(tmp_path / "merged"))
    again = peft.PeftModel.from_pretrained(_hf_model(base), str(tmp_path / "merged")).eval()
    tolerance.assert_close(got, _logits(again, IDS), terms=2 * 64)


def test_adapters_that_are_not_plain_lora_are_refused(tmp_path):
    peft = pytest.importorskip("peft")
    from keras_attn.convert import from_huggingface
    from keras_attn.convert import save_peft_adapter

    base = _hf_base("qwen2", str(tmp_path / "base"))
    peft.get_peft_model(_hf_model(base), peft.LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(
        str(tmp_path / "adapter"))
    path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        from_huggingface(base, adapter=str(tmp_path / "adapter"))
    with pytest.raises(ValueError, match="adapter_config.json"):
        from_huggingface(base, adapter=str(tmp_path))
    gemma2 = tiny_lm(name="gemma2_keras_attn")  # its query kernel holds Gemma 2's logit scale
    gemma2.enable_lora(2)
    with pytest.raises(ValueError, match="Gemma 2/3"):
        save_peft_adapter(gemma2, str(tmp_path / "none"))
    lm = from_huggingface(base)
    with pytest.raises(ValueError, match="no PEFT-style"):
        save_peft_adapter(lm, str(tmp_path / "none"))
    lm.enable_lora(2, style="keras")
    with pytest.raises(ValueError, match="style='keras'"):
        save_peft_adapter(lm, str(tmp_path / "none"))


# --- whole models back to transformers ----------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_save_huggingface_with_merged_lora_gives_our_logits(name, tmp_path):
    """Converted, adapted (random B: the merge matters), written: transformers
    loads our logits, and so does converting the written folder again."""
    from keras_attn.convert import from_huggingface
    from keras_attn.convert import save_huggingface

    base = _hf_base(name, str(tmp_path / "base"))
    lm = from_huggingface(base)
    # Every projection, fused ones (Phi-3) and rescaled ones (Gemma 2) too.
    _randomise_b(lm.enable_lora(4, target_names=ALL), scale=0.3)
    assert len(lora.adapted_layers(lm)) == 2 * len(ALL)
    got = keras.ops.convert_to_numpy(lm(IDS))
    assert np.abs(got - _logits(_hf_model(base), IDS)).max() > 0.1 * np.abs(got).max(), "LoRA changes nothing"
    folder = save_huggingface(lm, str(tmp_path / "written"))
    written = _hf_model(folder)
    assert type(written).__name__ == type(_hf_model(base)).__name__
    tolerance.assert_close(got, _logits(written, IDS), terms=2 * 64)
    again = from_huggingface(folder)
    assert again.name == lm.name
    tolerance.assert_close(keras.ops.convert_to_numpy(again(IDS)), got, terms=2 * 64)


_GEMMA = dict(activation="gelu_pytorch_tanh", embedding_scale=float(np.float32(24**0.5)),
              use_sandwich_norm=True, attention_use_bias=False, feedforward_use_bias=False, head_dim=8)


@pytest.mark.parametrize("model_type, options", [
    ("gemma2", _GEMMA),  # no window: every layer full
    ("gemma3_text", dict(_GEMMA, use_qk_norm=True)),  # no local base: the full one
    ("qwen3", dict(use_qk_norm=True, attention_use_bias=False, feedforward_use_bias=False,
                   sliding_window=[None, 4])),
    # IDS are longer than the original context: the long factors and the attention factor.
    ("phi3", dict(attention_use_bias=False, feedforward_use_bias=False, partial_rotary_factor=0.5,
                  rope_scaling={"rope_type": "longrope", "short_factor": [1.5], "long_factor": [3.0],
                                "original_max_position_embeddings": 8, "attention_factor": 1.2})),
])
def test_save_huggingface_writes_models_built_here(model_type, options, tmp_path):
    """Models not converted (random weights everywhere, norms included),
    written with the settings a checkpoint would not show: transformers'
    logits are ours."""
    from keras_attn.convert import save_huggingface

    lm = tiny_lm(name=f"{model_type}_keras_attn", vocabulary_size=VOCAB, **options)
    rng = np.random.default_rng(1)
    for variable in lm.weights:
        variable.assign(rng.standard_normal(variable.shape).astype("float32") * 0.3)
    written = _hf_model(save_huggingface(lm, str(tmp_path / "written")))
    assert written.config.model_type == model_type
    tolerance.assert_close(keras.ops.convert_to_numpy(lm(IDS)), _logits(written, IDS), terms=2 * 64)


def test_save_huggingface_refuses_what_the_config_cannot_say(tmp_path):
    from keras_attn.convert import save_huggingface

    with pytest.raises(ValueError, match="use_qk_norm"):
        save_huggingface(tiny_lm(use_qk_norm=True), str(tmp_path / "a"))
    with pytest.raises(ValueError, match="attention_use_bias"):
        save_huggingface(tiny_lm(feedforward_use_bias=False), str(tmp_path / "b"), model_type="qwen2")
    with pytest.raises(ValueError, match="model_type"):
        save_huggingface(tiny_lm(), str(tmp_path / "c"), model_type="gpt2")
    plain = dict(attention_use_bias=False, feedforward_use_bias=False)
    refused = [
        ("qwen3", dict(plain), "use_qk_norm"),
        ("qwen3", dict(plain, use_qk_norm=True, sliding_window=[3, 4]), "sliding_window"),
        ("gemma", dict(plain, embedding_scale=2.0), "embedding_scale"),
        ("gemma", dict(plain, feedforward_use_bias=True, embedding_scale=float(np.float32(24**0.5))),
         "feedforward_use_bias"),
        ("gemma3_text", dict(_GEMMA, use_qk_norm=True, attention_logit_soft_cap=5.0), "attention_logit_soft_cap"),
        ("gemma3_text", dict(_GEMMA, use_qk_norm=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
         "local_rope_max_wavelength"),
        ("gemma2", dict(_GEMMA, use_sandwich_norm=False), "use_sandwich_norm"),
        ("smollm3", dict(plain, use_qk_norm=True), "use_qk_norm"),
        ("phi3", dict(plain, attention_use_bias=True), "attention_use_bias"),
        ("phi3", dict(plain, sliding_window=[3, None]), "sliding_window"),
    ]
    for model_type, options, option in refused:
        with pytest.raises(ValueError, match=f"as {model_type!r}: `{option}`"):
            save_huggingface(tiny_lm(**options), str(tmp_path / "d"), model_type=model_type)
