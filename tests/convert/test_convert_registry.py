"""The converter table (`keras_attn/convert/registry.py`) and the converter
interface: every family module has its row, refusals name the field and the
value, and a converter reads tensors from any name -> array mapping: a
`save_pretrained` folder read tensor by tensor (shards, bfloat16; no torch
model built) gives the same variables, bit for bit,
as the transformers model it was saved from; `dtype=` rounds them."""

import copy
import pathlib
import types

import numpy as np
import pytest

from keras_attn.convert import common
from keras_attn.convert import registry

CONVERT = pathlib.Path(registry.__file__).parent


def test_every_family_module_has_its_row():
    """Adding a family is adding a module and its row: a module that declares
    a `FAMILY` and is not in the table would never be found."""
    declared = sorted(p.stem for p in CONVERT.glob("*.py") if "\nFAMILY = " in p.read_text())
    listed = sorted(f.convert.__module__.rsplit(".", 1)[-1] for f in registry.FAMILIES)
    assert declared == listed
    assert set(registry.CONVERTERS) == {t for f in registry.FAMILIES for t in f.model_types}


def test_a_model_type_in_two_families_is_an_error():
    a = common.Family("A", ("x",), ("*",), lambda c, **k: None)
    b = common.Family("B", ("y", "x"), ("*",), lambda c, **k: None)
    with pytest.raises(ValueError, match="model_type='x'.*A and B"):
        registry._by_model_type((a, b))


def checkpoint(model_type, architecture):
    return common.Checkpoint(types.SimpleNamespace(model_type=model_type), architecture, {})


@pytest.mark.parametrize("model_type, architecture, match", [
    ("distilbert", "DistilBertModel", r"`model_type` must be one of .*Received: model_type='distilbert'"),
    (None, "Thing", r"Received: model_type=None \(Thing\)"),
    ("gpt2", "GPT2ForTokenClassification",
     r"for model_type='gpt2' supported are GPT2Model and GPT2LMHeadModel\. "
     r"Received: architecture='GPT2ForTokenClassification'"),
    ("mistral", "MistralModel", r"supported is \*ForCausalLM\. Received: architecture='MistralModel'"),
    ("roberta", "RobertaForMaskedLM", r"Received: architecture='RobertaForMaskedLM'"),
])
def test_refused_by_name_with_the_value(model_type, architecture, match):
    with pytest.raises(ValueError, match=match):
        registry.find(checkpoint(model_type, architecture))


@pytest.mark.parametrize("model_type, architecture, match", [
    ("qwen3_moe", "Qwen3MoeForCausalLM", r"`model_type`='qwen3_moe' is a mixture-of-experts"),
    ("qwen3_next", "Qwen3NextForCausalLM", r"`model_type`='qwen3_next' has linear-attention"),
    ("qwen3_5_text", "Qwen3_5ForCausalLM", r"`model_type`='qwen3_5_text' has linear-attention"),
    ("gemma3n_text", "Gemma3nForCausalLM", r"`model_type`='gemma3n_text' has AltUp and Laurel"),
    ("gemma3", "Gemma3ForConditionalGeneration",
     r"`model_type`='gemma3' has a vision tower.*Gemma3ForCausalLM"),
    ("phimoe", "PhimoeForCausalLM", r"`model_type`='phimoe' is a mixture-of-experts"),
    ("gemma4", "Gemma4ForConditionalGeneration",
     r"`model_type`='gemma4' has vision and audio towers.*Gemma4ForCausalLM"),
])
def test_relatives_that_cannot_be_represented_are_refused_by_what_they_have(
        model_type, architecture, match):
    with pytest.raises(ValueError, match=match):
        registry.find(checkpoint(model_type, architecture))


def test_the_table_finds_each_family_by_model_type_and_architecture():
    assert registry.find(checkpoint("xlm-roberta", "XLMRobertaForSequenceClassification")).name == "BERT"
    assert registry.find(checkpoint("qwen3", "Qwen3ForCausalLM")).name == "Qwen3"
    assert registry.find(checkpoint("gemma3_text", "Gemma3ForCausalLM")).name == "Gemma 2/3"
    assert registry.find(checkpoint("gemma2", "Gemma2ForCausalLM")).name == "Gemma 2/3"
    assert registry.find(checkpoint("gemma4_text", "Gemma4ForCausalLM")).name == "Gemma 4"
    assert registry.find(checkpoint("smollm3", "SmolLM3ForCausalLM")).name == "SmolLM3"
    assert registry.find(checkpoint("phi3", "Phi3ForCausalLM")).name == "Phi-3"
    assert registry.find(checkpoint("qwen2", "Qwen2ForCausalLM")).name == "Llama"
    assert registry.find(checkpoint("gemma", "GemmaForCausalLM")).name == "Gemma"
    assert registry.find(checkpoint("t5", "T5EncoderModel")).name == "T5"


def test_weights_take_each_tensor_once_and_report_leftovers():
    tensors = {"bert.a.weight": np.ones((2, 3), "float16"), "bert.a.bias": np.zeros(2),
               "classifier.weight": np.ones((1, 2)), "bert.embeddings.position_ids": np.arange(3)}
    weights = common.Weights(tensors, "bert")
    assert "a.weight" in weights and "embeddings.position_ids" not in weights
    kernel, bias, name = weights.linear("a")
    assert kernel.shape == (3, 2) and kernel.dtype == np.float32 and bias.shape == (2,) and name == "a"
    with pytest.raises(ValueError, match=r"no keras_attn counterpart: \['classifier.weight'\]"):
        weights.check_all_used("BertForSequenceClassification")


def _tiny(transformers, name):
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=4, n_positions=16)
        return transformers.GPT2LMHeadModel(config)
    if name in ("llama", "llama_tied"):
        config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=24, tie_word_embeddings=name == "llama_tied")
        return transformers.LlamaForCausalLM(config)
    if name == "t5":
        config = transformers.T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=24, num_layers=2,
                                       num_heads=4, relative_attention_num_buckets=8,
                                       feed_forward_proj="gated-gelu", tie_word_embeddings=False)
        return transformers.T5ForConditionalGeneration(config)
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=24,
                                     max_position_embeddings=16, num_labels=3)
    return transformers.BertForSequenceClassification(config)


FAMILIES = ["gpt2", "llama", "llama_tied", "bert", "t5"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Per family: the transformers model in float32 and in bfloat16, and
    their `save_pretrained` folders (float32 in shards of a few tensors,
    bfloat16 in one file)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = {}
    for name in FAMILIES:
        torch.manual_seed(0)
        hf = _tiny(transformers, name).eval()
        sharded = tmp_path_factory.mktemp(name + "_f32")
        hf.save_pretrained(sharded, max_shard_size="4KB")
        assert (sharded / "model.safetensors.index.json").exists()
        hf16 = copy.deepcopy(hf).to(torch.bfloat16)
        single = tmp_path_factory.mktemp(name + "_bf16")
        hf16.save_pretrained(single)
        out[name] = {"float32": (hf, sharded), "bfloat16": (hf16, single)}
    return out


def _weights(model):
    return {v.path: np.asarray(v.numpy()) for v in model.weights}


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_streaming_conversion_equals_the_transformers_models_bit_for_bit(folders, monkeypatch, name, stored):
    """A `save_pretrained` folder (shards and an index; or bfloat16 tensors)
    converts, without building a torch model, into the same variables as the
    in-memory transformers model it was saved from."""
    from keras_attn.convert import from_huggingface
    from keras_attn.convert import huggingface

    hf, folder = folders[name][stored]
    want = _weights(from_huggingface(hf))
    monkeypatch.setattr(huggingface, "_load", lambda *a: pytest.fail("built a torch model"))
    got = _weights(from_huggingface(folder))
    assert sorted(got) == sorted(want)
    for path in want:
        assert got[path].dtype == np.float32, path
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)


def test_older_layer_norm_names_are_read_as_transformers_reads_them(folders, tmp_path):
    """Older BERT checkpoints name LayerNorm parameters `gamma`/`beta`;
    transformers renames them when loading, and so does the folder reader."""
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from keras_attn.convert import from_huggingface

    hf, folder = folders["bert"]["float32"]
    old = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
           for k, v in hf.state_dict().items()}
    assert any(k.endswith("LayerNorm.gamma") for k in old)
    safetensors_torch.save_file(old, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf.config.save_pretrained(tmp_path)
    loaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path, local_files_only=True)
    want = _weights(from_huggingface(loaded))
    got = _weights(from_huggingface(tmp_path))
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)


@pytest.mark.parametrize("name, dtype", [("llama_tied", "bfloat16"), ("t5", "float16")])
def test_dtype_rounds_the_float32_conversion_to_nearest_even(folders, name, dtype):
    """`dtype=` gives the float32 conversion's variables rounded by torch
    (round to nearest even), and the model computes in that dtype."""
    torch = pytest.importorskip("torch")
    from keras_attn.convert import from_huggingface

    hf, folder = folders[name]["bfloat16"]
    want = _weights(from_huggingface(folder))
    model = from_huggingface(folder, dtype=dtype)
    got = _weights(model)
    for path, value in want.items():
        rounded = torch.from_numpy(value).to(getattr(torch, dtype)).float().numpy()
        assert str(got[path].dtype) == dtype, path
        np.testing.assert_array_equal(got[path].astype("float32"), rounded, err_msg=path)
    assert model.dtype_policy.name == dtype


def test_dtype_is_checked_by_name(folders):
    from keras_attn.convert import from_huggingface

    with pytest.raises(ValueError, match=r"`dtype`.*'float32', 'bfloat16', 'float16'.*Received: dtype='int8'"):
        from_huggingface(folders["gpt2"]["float32"][1], dtype="int8")


def test_safetensors_tensors_reads_each_dtype_exactly(tmp_path):
    """Our reader of the file format against the `safetensors` library's
    writer: float tensors come back as float32 (bfloat16 and float16
    exactly), integer ones as they are; a dtype it does not read and bytes
    that do not match the shape are refused by name."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    import ml_dtypes

    rng = np.random.default_rng(0)
    tensors = {
        "a.bf16": rng.normal(size=(3, 5)).astype(ml_dtypes.bfloat16),
        "b.f16": rng.normal(size=(7,)).astype("float16"),
        "c.f32": rng.normal(size=(2, 2, 3)).astype("float32"),
        "d.i64": np.arange(6, dtype="int64"),
        "e.scalar": np.array(1.5, "float32"),
    }
    safetensors_numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    read = common.SafetensorsTensors(str(tmp_path))
    assert sorted(read) == sorted(tensors) and len(read) == 5
    for key, value in tensors.items():
        got = read[key]
        want = value.astype("float32") if value.dtype != np.int64 else value
        assert got.dtype == want.dtype and got.shape == want.shape, key
        np.testing.assert_array_equal(got, want, err_msg=key)
    assert read.dtype("a.bf16") == ml_dtypes.bfloat16

    safetensors_numpy.save_file({"x": np.zeros(3, "complex64")}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"`x`.*dtype C64"):
        common.SafetensorsTensors(str(tmp_path))
    with pytest.raises(ValueError, match=r"No safetensors checkpoint"):
        common.SafetensorsTensors(str(tmp_path / "missing"))


def test_safetensors_tensors_reads_big_tensors_in_blocks(tmp_path, monkeypatch):
    """A tensor bigger than a read block comes back whole."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    import ml_dtypes

    value = np.random.default_rng(1).normal(size=(37, 11)).astype(ml_dtypes.bfloat16)
    safetensors_numpy.save_file({"t": value}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(common, "_READ_BLOCK", 10)  # 5 elements per read
    np.testing.assert_array_equal(common.SafetensorsTensors(str(tmp_path))["t"], value.astype("float32"))


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_a_converter_reads_any_name_to_array_mapping(folders, name):
    """A family converter reads `checkpoint.tensors` and nothing else: here a
    plain dict of the torch model's tensors as float16."""
    from keras_attn.convert import from_huggingface

    hf, _ = folders[name]["float32"]
    tensors = {k: v.detach().numpy().astype("float16") for k, v in hf.state_dict().items()}
    streamed = registry.convert(common.Checkpoint(hf.config, type(hf).__name__, tensors))
    reference = from_huggingface(copy.deepcopy(hf).half().float())
    got, want = _weights(streamed), _weights(reference)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)
