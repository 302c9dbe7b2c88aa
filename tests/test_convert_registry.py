"""The converter table (`keras_attn/convert/registry.py`) and the converter
interface: every family module has its row, refusals name the field and the
value, and a converter reads tensors from any name -> array mapping (here
safetensors files opened lazily, the config read alone: no torch model is
built for the conversion), with the same numbers as `from_huggingface`."""

import collections.abc
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


class SafetensorsTensors(collections.abc.Mapping):
    """What a streaming reader gives a converter: tensors read one at a time
    from the files of a `save_pretrained` folder."""

    def __init__(self, folder):
        from safetensors import safe_open

        self._files = [safe_open(str(p), framework="np") for p in sorted(folder.glob("*.safetensors"))]
        self._where = {name: f for f in self._files for name in f.keys()}

    def __getitem__(self, name):
        return self._where[name].get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


def _tiny(transformers, name):
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=4, n_positions=16)
        return transformers.GPT2LMHeadModel(config)
    if name == "llama":
        config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=24, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(config)
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=24,
                                     max_position_embeddings=16, num_labels=3)
    return transformers.BertForSequenceClassification(config)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_a_converter_reads_any_name_to_array_mapping(tmp_path, name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from keras_attn.convert import from_huggingface

    torch.manual_seed(0)
    hf = _tiny(transformers, name).eval()
    hf.save_pretrained(tmp_path)  # safetensors; tied tensors are written once
    config = transformers.AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    streamed = registry.convert(common.Checkpoint(config, config.architectures[0], SafetensorsTensors(tmp_path)))
    loaded = from_huggingface(hf)
    ids = np.array([[5, 7, 9, 11, 3]], "int32")
    if name == "bert":
        inputs = [ids, np.ones_like(ids), np.zeros_like(ids)]
        np.testing.assert_array_equal(np.asarray(streamed(inputs)), np.asarray(loaded(inputs)))
    else:
        np.testing.assert_array_equal(np.asarray(streamed(ids)), np.asarray(loaded(ids)))
