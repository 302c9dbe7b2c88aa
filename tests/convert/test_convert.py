"""`keras_attn.convert.from_huggingface` against Hugging Face `transformers`
itself: tiny random-init configs (no download), hidden states / logits to
1e-5 with padding, sharp attention (large initializer_range), greedy tokens
equal to `generate(do_sample=False)`, local checkpoint directories, export."""

import keras
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from keras_attn.convert import from_huggingface  # noqa: E402
from keras_attn.generation import greedy_search  # noqa: E402
from tests import tolerance  # noqa: E402
from tests.llm_runtime_models import assert_left_padded_greedy_equals_hf  # noqa: E402

VOCAB = 60


def assert_matches(got, want):
    """Ours (TensorFlow) against `transformers` (torch), both float32: two
    layers of sums over the hidden size, in different orders (tests/tolerance.py)."""
    tolerance.assert_close(got, want, terms=2 * 16)


def tiny_bert_config(cls=None, **overrides):
    cls = cls or transformers.BertConfig
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=24, max_position_embeddings=24, type_vocab_size=2,
        hidden_act="gelu", num_labels=3,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def tiny_gpt2_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=32,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    kwargs.update(overrides)
    return transformers.GPT2Config(**kwargs)


def hf_model(cls, config, seed=0):
    torch.manual_seed(seed)
    return cls(config).eval()


def batch(seed=0, length=9, padded=(6, 9)):
    """Right-padded ids (no id 0 in valid positions), mask and token types."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, size=(len(padded), length)).astype("int32")
    mask = np.zeros_like(ids)
    for row, n in enumerate(padded):
        mask[row, :n] = 1
        ids[row, n:] = 0
    types = np.zeros_like(ids)
    types[:, length // 2 :] = 1
    return ids, mask, types


def torch_run(model, ids, mask, types=None):
    kwargs = dict(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask))
    if types is not None:
        kwargs["token_type_ids"] = torch.tensor(types, dtype=torch.long)
    with torch.no_grad():
        return model(**kwargs)


def run(model, ids, mask, types=None):
    feed = {"input_ids": ids, "attention_mask": mask}
    if types is not None and "token_type_ids" in [i.name for i in model.inputs]:
        feed["token_type_ids"] = types
    outputs = model([feed[i.name] for i in model.inputs])
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return dict(zip(model.output_names, (np.asarray(y) for y in outputs)))


# ---------------------------------------------------------------------------
# BERT family


@pytest.mark.parametrize("initializer_range", [0.02, 0.5])
@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new", "relu"])
def test_bert_hidden_states_and_pooler(initializer_range, hidden_act):
    config = tiny_bert_config(initializer_range=initializer_range, hidden_act=hidden_act, layer_norm_eps=1e-12)
    hf = hf_model(transformers.BertModel, config)
    model = from_huggingface(hf)
    assert sorted(model.output_names) == ["last_hidden_state", "pooler_output"]
    ids, mask, types = batch()
    want = torch_run(hf, ids, mask, types)
    got = run(model, ids, mask, types)
    # Every position, padded ones included (BERT computes them).
    assert_matches(got["last_hidden_state"], want.last_hidden_state.numpy())
    assert_matches(got["pooler_output"], want.pooler_output.numpy())


def mean_max_attention(initializer_range):
    config = tiny_bert_config(initializer_range=initializer_range, attn_implementation="eager")
    hf = hf_model(transformers.BertModel, config)
    ids, mask, types = batch()
    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
            token_type_ids=torch.tensor(types, dtype=torch.long), output_attentions=True,
        )
    return float(out.attentions[-1].max(-1).values.mean())


def test_large_weights_give_sharp_attention():
    """What the 0.5 configs above test: attention far from uniform (1/6 to 1/9
    here), where a wrong mask, scale or position would show."""
    assert mean_max_attention(0.02) < 0.3
    assert mean_max_attention(0.5) > 0.5


def test_bert_classifier_logits():
    config = tiny_bert_config(initializer_range=0.3)
    hf = hf_model(transformers.BertForSequenceClassification, config)
    model = from_huggingface(hf)
    assert model.output_names == ["logits"]
    ids, mask, types = batch(seed=1)
    assert_matches(
        run(model, ids, mask, types)["logits"], torch_run(hf, ids, mask, types).logits.numpy())


@pytest.mark.parametrize("cls_name", ["RobertaModel", "RobertaForSequenceClassification", "XLMRobertaModel"])
def test_roberta_family(cls_name):
    config_cls = transformers.XLMRobertaConfig if cls_name.startswith("XLM") else transformers.RobertaConfig
    config = tiny_bert_config(config_cls, initializer_range=0.3, pad_token_id=1, type_vocab_size=1,
                              max_position_embeddings=26, layer_norm_eps=1e-5)
    hf = hf_model(getattr(transformers, cls_name), config)
    model = from_huggingface(hf)
    assert [i.name for i in model.inputs] == ["input_ids", "attention_mask"]
    ids, mask, _ = batch(seed=2)
    ids[mask == 0] = config.pad_token_id
    want = torch_run(hf, ids, mask)
    got = run(model, ids, mask)
    if "Classification" in cls_name:
        assert_matches(got["logits"], want.logits.numpy())
    else:
        # RoBERTa gives padded tokens position pad_token_id: compare the real tokens.
        valid = mask.astype(bool)
        assert_matches(
            got["last_hidden_state"][valid], want.last_hidden_state.numpy()[valid])
        assert_matches(got["pooler_output"], want.pooler_output.numpy())


# ---------------------------------------------------------------------------
# GPT-2 family


GPT2_VARIANTS = {
    "default": {},
    "sharp_gelu_inverse_layer_scale": dict(
        initializer_range=0.5, activation_function="gelu", scale_attn_by_inverse_layer_idx=True
    ),
    "unscaled_untied": dict(
        initializer_range=0.2, scale_attn_weights=False, tie_word_embeddings=False,
        activation_function="gelu_pytorch_tanh", layer_norm_epsilon=1e-6,
    ),
}


@pytest.fixture(scope="module", params=sorted(GPT2_VARIANTS))
def gpt2(request):
    hf = hf_model(transformers.GPT2LMHeadModel, tiny_gpt2_config(**GPT2_VARIANTS[request.param]))
    return hf, from_huggingface(hf)


def test_gpt2_logits_with_padding(gpt2):
    hf, lm = gpt2
    ids, mask, _ = batch(seed=3, length=10, padded=(7, 10))
    want = torch_run(hf, ids, mask).logits.numpy()
    got = np.asarray(lm(ids, padding_mask=mask.astype(bool)))
    valid = mask.astype(bool)
    assert_matches(got[valid], want[valid])
    assert lm.tie_embeddings == bool(hf.config.tie_word_embeddings)


def test_gpt2_greedy_tokens_equal_hf_generate(gpt2):
    hf, lm = gpt2
    prompts = np.random.default_rng(4).integers(3, VOCAB, size=(3, 5)).astype("int32")
    with torch.no_grad():
        want = hf.generate(
            torch.tensor(prompts, dtype=torch.long),
            attention_mask=torch.ones(prompts.shape, dtype=torch.long),
            do_sample=False, max_length=20, pad_token_id=0, eos_token_id=None,
        ).numpy()
    got = np.asarray(greedy_search(lm, prompts, max_length=20, pad_token_id=0))
    np.testing.assert_array_equal(got, want)
    # Not a degenerate sequence: the model produces several distinct tokens.
    assert len(np.unique(got[:, 5:])) > 3


def test_gpt2_left_padded_batch_equals_hf_generate(gpt2):
    hf, lm = gpt2
    assert_left_padded_greedy_equals_hf(hf, lm, VOCAB, max_length=16, lengths=(2, 5, 4), width=5)


def test_gpt2_base_model_converts_to_a_tied_lm():
    hf = hf_model(transformers.GPT2Model, tiny_gpt2_config(initializer_range=0.3))
    lm = from_huggingface(hf)
    ids, mask, _ = batch(seed=5, padded=(9, 9))
    hidden = torch_run(hf, ids, mask).last_hidden_state.numpy()
    want = hidden @ hf.wte.weight.detach().numpy().T
    assert_matches(np.asarray(lm(ids)), want)


# ---------------------------------------------------------------------------
# Local checkpoint directories, refusals, export


def test_local_directory_uses_the_same_call(tmp_path):
    bert = hf_model(transformers.BertForSequenceClassification, tiny_bert_config(initializer_range=0.3))
    bert.save_pretrained(tmp_path / "bert")
    gpt = hf_model(transformers.GPT2LMHeadModel, tiny_gpt2_config(initializer_range=0.3))
    gpt.save_pretrained(tmp_path / "gpt2")
    ids, mask, types = batch(seed=6)
    model = from_huggingface(tmp_path / "bert")
    assert_matches(
        run(model, ids, mask, types)["logits"], torch_run(bert, ids, mask, types).logits.numpy())
    lm = from_huggingface(str(tmp_path / "gpt2"))
    ids, mask, _ = batch(seed=6, padded=(9, 9))
    assert_matches(np.asarray(lm(ids)), torch_run(gpt, ids, mask).logits.numpy())


def test_converted_encoder_saves_and_loads(tmp_path):
    model = from_huggingface(hf_model(transformers.BertForSequenceClassification, tiny_bert_config()))
    model.save(tmp_path / "bert.keras")
    loaded = keras.saving.load_model(tmp_path / "bert.keras")
    ids, mask, types = batch(seed=7)
    np.testing.assert_array_equal(run(loaded, ids, mask, types)["logits"], run(model, ids, mask, types)["logits"])


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: hf_model(transformers.BertModel, tiny_bert_config(hidden_act="gelu_10")), "hidden_act.*gelu_10"),
        (
            lambda: hf_model(transformers.BertModel, tiny_bert_config(position_embedding_type="relative_key")),
            "position_embedding_type.*relative_key",
        ),
        (lambda: hf_model(transformers.BertForMaskedLM, tiny_bert_config()), "BertForMaskedLM"),
        (lambda: hf_model(transformers.BertLMHeadModel, tiny_bert_config()), "BertLMHeadModel"),
        (
            lambda: hf_model(transformers.GPT2LMHeadModel, tiny_gpt2_config(add_cross_attention=True)),
            "add_cross_attention",
        ),
        (
            lambda: hf_model(transformers.GPT2LMHeadModel, tiny_gpt2_config(activation_function="gelu_10")),
            "activation_function.*gelu_10",
        ),
        (
            lambda: hf_model(
                transformers.DistilBertModel,
                transformers.DistilBertConfig(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, hidden_dim=24),
            ),
            "model_type.*distilbert",
        ),
    ],
)
def test_refuses_what_it_cannot_represent(build, match):
    with pytest.raises(ValueError, match=match):
        from_huggingface(build())


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="model_or_local_dir.*nothing is downloaded"):
        from_huggingface(tmp_path / "missing")
    with pytest.raises(TypeError, match="model_or_local_dir"):
        from_huggingface(42)


@pytest.mark.slow
def test_converted_bert_exports_with_hf_parity(tmp_path):
    """TFLite (builtins) and ONNX of the converted model against HF itself."""
    import onnxruntime as ort
    from ai_edge_litert.interpreter import Interpreter

    from keras_attn import export as kx

    hf = hf_model(transformers.BertForSequenceClassification, tiny_bert_config(initializer_range=0.3))
    model = from_huggingface(hf)
    tfl = kx.export_tflite(model, tmp_path / "bert.tflite")
    onx = kx.export_onnx(model, tmp_path / "bert.onnx")
    assert not [op for op in tfl.ops if "FLEX" in op.upper() or op == "CUSTOM"]
    ids, mask, types = batch(seed=8)
    want = torch_run(hf, ids, mask, types).logits.numpy()
    feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    session = ort.InferenceSession(onx.path, providers=["CPUExecutionProvider"])
    assert_matches(session.run(["logits"], feed)[0], want)
    interpreter = Interpreter(model_path=tfl.path)
    details = {d["name"]: d for d in interpreter.get_input_details()}
    for name, value in feed.items():
        interpreter.resize_tensor_input(details[f"serving_default_{name}:0"]["index"], value.shape)
    interpreter.allocate_tensors()
    got = interpreter.get_signature_runner("serving_default")(**feed)["logits"]
    assert_matches(got, want)


def test_fully_padded_rows_and_empty_batches_stay_finite():
    model = from_huggingface(hf_model(transformers.BertModel, tiny_bert_config(initializer_range=0.3)))
    ids, mask, types = batch(seed=9)
    mask[1] = 0  # a row with no token at all
    out = run(model, ids, mask, types)
    assert all(np.all(np.isfinite(v)) for v in out.values())
    empty = np.zeros((0, 5), "int32")
    out = run(model, empty, empty, empty)
    assert out["last_hidden_state"].shape == (0, 5, 16)
