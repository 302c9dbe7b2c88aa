"""Conversion into deferred variables (`common.values_from_checkpoint`):
each Keras variable is made once, from its checkpoint tensor, with no random
initial value and no eager forward call. The result equals, bit for bit, the
build-then-assign conversion (the model built with its random initial
values, then each tensor assigned), for sharded float32 and single-file
bfloat16 folders, `dtype=` float32, bfloat16 and float16, and in-memory
`transformers` models, on every Keras backend.
"""

import contextlib

import keras
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from keras_attn.convert import common  # noqa: E402
from keras_attn.convert import from_huggingface  # noqa: E402

SMALL = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _tiny(name):
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=40, n_embd=16, n_layer=2, n_head=4, n_positions=16))
    if name == "bert":
        return transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
            intermediate_size=24, max_position_embeddings=16, num_labels=3))
    if name == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=40, d_model=16, d_kv=4, d_ff=24, num_layers=1, num_heads=4,
            relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
            tie_word_embeddings=False))
    if name == "qwen2_tied":  # biased q/k/v, tied head
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, tie_word_embeddings=True))
    if name == "gemma2":  # norms stored as w, converted as 1 + w; sandwich norms
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **SMALL, head_dim=4, sliding_window=4, tie_word_embeddings=False))
    if name == "phi3":  # fused q/k/v and gate/up projections, split on conversion
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(
            **SMALL, tie_word_embeddings=False))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, tie_word_embeddings=False))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """`{(name, stored): folder}`: float32 in shards of a few tensors,
    bfloat16 in one file; and `{name: model}` of the float32 models."""
    paths, models = {}, {}
    for name in ("gpt2", "bert", "t5", "llama", "qwen2_tied", "gemma2", "phi3"):
        torch.manual_seed(0)
        hf = _tiny(name).eval()
        models[name] = hf
        sharded = tmp_path_factory.mktemp(name + "_f32")
        hf.save_pretrained(sharded, max_shard_size="4KB")
        assert (sharded / "model.safetensors.index.json").exists()
        single = tmp_path_factory.mktemp(name + "_bf16")
        hf.to(torch.bfloat16).save_pretrained(single)
        hf.float()
        paths[name, "float32"], paths[name, "bfloat16"] = sharded, single
    return paths, models


def _weights(model):
    return {v.path: keras.ops.convert_to_numpy(v.value) for v in model.weights}


def _built_then_assigned(source, dtype, monkeypatch):
    """The conversion with every variable made first (random initial values)
    and the tensors assigned after."""
    with monkeypatch.context() as patch:
        patch.setattr(common, "values_from_checkpoint", contextlib.nullcontext)
        return _weights(from_huggingface(source, dtype=dtype))


def _assert_equal(got, want):
    assert sorted(got) == sorted(want)
    for path, value in want.items():
        assert got[path].dtype == value.dtype, path
        # Compared as bits: equal values and equal NaN-free patterns alike.
        np.testing.assert_array_equal(got[path].view(f"u{value.itemsize}"),
                                      value.view(f"u{value.itemsize}"), err_msg=path)


CASES = [
    ("gpt2", "float32", "float32"),
    ("bert", "bfloat16", "float32"),
    ("bert", "float32", "float16"),
    ("t5", "bfloat16", "bfloat16"),
    ("llama", "float32", "bfloat16"),
    ("qwen2_tied", "bfloat16", "float16"),
    ("gemma2", "bfloat16", "float32"),
    ("phi3", "float32", "bfloat16"),
]


# Every family on TensorFlow; on JAX and torch (where the deferred variables
# are the backend's own) one case per stored dtype and target dtype, to keep
# CI's time: the families differ in their converters, which no backend changes.
@pytest.mark.parametrize("name, stored, dtype", CASES if keras.backend.backend() == "tensorflow" else [
    ("gpt2", "float32", "float32"), ("t5", "bfloat16", "bfloat16"), ("qwen2_tied", "bfloat16", "float16")])
def test_deferred_variables_equal_build_then_assign_bit_for_bit(folders, monkeypatch, name, stored, dtype):
    paths, _ = folders
    with monkeypatch.context() as patch:  # every value given at creation, none assigned after
        patch.setattr(keras.Variable, "assign", lambda *a: pytest.fail("a variable assigned after its creation"))
        got = _weights(from_huggingface(paths[name, stored], dtype=dtype))
    assert {str(v.dtype) for v in got.values()} == {dtype}
    _assert_equal(got, _built_then_assigned(paths[name, stored], dtype, monkeypatch))


@pytest.mark.parametrize("name, dtype", [("qwen2_tied", "float32"), ("gpt2", "bfloat16")])
def test_an_in_memory_model_converts_into_deferred_variables_alike(folders, monkeypatch, name, dtype):
    _, models = folders
    _assert_equal(_weights(from_huggingface(models[name], dtype=dtype)),
                  _built_then_assigned(models[name], dtype, monkeypatch))


def test_the_values_are_the_checkpoints_and_nothing_is_left_deferred(folders):
    """Against the checkpoint itself (torch's own values, transposed as a
    Keras kernel), and the converted model then runs and trains like any
    other: no variable is left without a value."""
    _, models = folders
    hf = models["llama"]
    lm = from_huggingface(hf)
    want = hf.model.layers[1].mlp.down_proj.weight.detach().numpy().T
    got = keras.ops.convert_to_numpy(lm.blocks[1].feedforward_output_dense.kernel.value)
    np.testing.assert_array_equal(got, want)
    ids = np.array([[3, 5, 7]], "int32")
    logits = keras.ops.convert_to_numpy(lm(ids))
    assert logits.shape == (1, 3, 40) and np.isfinite(logits).all()
    new_kernel = np.ones(tuple(lm.blocks[0].feedforward_output_dense.kernel.shape), "float32")
    lm.blocks[0].feedforward_output_dense.kernel.assign(new_kernel)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(lm.blocks[0].feedforward_output_dense.kernel.value), new_kernel)


def test_a_refused_checkpoint_leaves_no_deferred_variable(folders, tmp_path):
    """A conversion that fails part way (a tensor without counterpart) still
    ends the scope: later models get their values as usual."""
    _, models = folders
    hf = models["llama"]
    tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    tensors["model.extra.weight"] = np.zeros(3, "float32")
    from keras_attn.convert import registry

    with pytest.raises(ValueError, match=r"no keras_attn counterpart: \['model.extra.weight'\]"):
        registry.convert(common.Checkpoint(hf.config, "LlamaForCausalLM", tensors))
    dense = keras.layers.Dense(2, kernel_initializer="ones")
    dense.build((None, 3))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(dense.kernel.value), np.ones((3, 2)))


@pytest.mark.parametrize("nbytes", [12, 3 * 2**20])
def test_aligned_empty_gives_aligned_writable_arrays_from_the_heap_or_own_pages(nbytes):
    """Small arrays from the heap, big ones from their own pages
    (`_OWN_PAGES`): either way C-contiguous, 64-byte aligned and writable."""
    out = common.aligned_empty((nbytes // 4,), "float32")
    assert out.flags.c_contiguous and out.flags.writeable and out.ctypes.data % 64 == 0
    out[...] = np.arange(out.size, dtype="float32")
    np.testing.assert_array_equal(out, np.arange(out.size, dtype="float32"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_variables_made_on_the_tensors_own_memory_equal_and_share_it_with_nothing(folders, monkeypatch, dtype):
    """Every tensor in pages of its own (`_OWN_PAGES`, forced small here), so
    on TensorFlow each variable adopts its tensor's memory: the same values
    as build-then-assign, and writing the converted model's variables leaves
    the transformers model it came from untouched."""
    monkeypatch.setattr(common, "_OWN_PAGES", 1)
    paths, models = folders
    hf = models["qwen2_tied"]
    kept = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    lm = from_huggingface(hf, dtype=dtype)
    _assert_equal(_weights(lm), _built_then_assigned(hf, dtype, monkeypatch))
    _assert_equal(_weights(from_huggingface(paths["qwen2_tied", "bfloat16"], dtype=dtype)),
                  _built_then_assigned(paths["qwen2_tied", "bfloat16"], dtype, monkeypatch))
    for variable in lm.weights:
        variable.assign(np.full(tuple(variable.shape), 7.0, "float32"))
    for name, value in hf.state_dict().items():
        assert torch.equal(value, kept[name]), name
    assert all((keras.ops.convert_to_numpy(v.value) == 7).all() for v in lm.weights)


@pytest.mark.parametrize("rows,columns", [(600, 520), (3, 700), (257, 1)])
def test_assign_takes_transposed_checkpoint_kernels_in_c_order(rows, columns):
    """A checkpoint's `(out, in)` kernel, transposed (a view read against its
    memory order, copied in tiles past 256), lands in a Dense kernel as it
    is, and in an attention kernel `(in, heads, head_dim)` as NumPy's C-order
    reshape; a value of another shape is refused unless `reshape` is asked."""
    checkpoint = np.random.default_rng(0).standard_normal((columns, rows)).astype("float32")
    kernel = keras.Variable(np.zeros((rows, columns), "float32"))
    common.assign(kernel, checkpoint.T, "dense.weight")
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(kernel), checkpoint.T)
    if columns % 2 == 0:
        heads = keras.Variable(np.zeros((rows, 2, columns // 2), "float32"))
        common.assign(heads, checkpoint.T, "q_proj.weight", reshape=True)
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(heads),
                                      np.reshape(checkpoint.T, (rows, 2, columns // 2)))
        with pytest.raises(ValueError, match=r"q_proj.weight` has shape .* expects"):
            common.assign(heads, checkpoint.T, "q_proj.weight")
    if rows != columns:
        with pytest.raises(ValueError, match="dense.weight"):
            common.assign(kernel, checkpoint, "dense.weight", reshape=False)
