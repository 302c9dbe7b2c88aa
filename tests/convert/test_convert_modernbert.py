"""ModernBERT, EuroBERT and Gemma 3's text model (bidirectional,
EmbeddingGemma's backbone) from `transformers`, converted with
`from_huggingface`: hidden states, masked-LM logits and classifier logits
within float32 rounding of
`attn_implementation="eager"` on right- and left-padded batches longer
than the local windows, and what cannot be represented refused by name.

Random-init models (nothing is downloaded), seeded, with weights scaled so
that attention is sharp (`hf_family(sharpen=True)`): 4 ModernBERT layers
with global attention on layers 0 and 3 and a local window of 8 tokens
(4 each side) on 1 and 2, sequences of 24; Gemma 3 with windows of 8 on 2
of 3 layers. The `*_are_active` tests show that the window and both rotary
bases change transformers' outputs at these sizes, so the comparisons
check them.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from keras_attn.convert import from_huggingface  # noqa: E402
from tests import tolerance  # noqa: E402
from tests.llm_runtime_models import hf_family  # noqa: E402

VOCAB = 61
LENGTH = 24
COMMON = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              attn_implementation="eager")
MODERNBERT = dict(
    hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
    local_attention=8, global_attn_every_n_layers=3, global_rope_theta=1000.0,
    local_rope_theta=50.0, cls_token_id=1, sep_token_id=2, num_labels=3,
)
# Every bias ModernBERT can have, mean pooling, an untied decoder.
BIASED = dict(MODERNBERT, norm_bias=True, attention_bias=True, mlp_bias=True,
              classifier_bias=True, classifier_pooling="mean", hidden_activation="gelu_new",
              classifier_activation="silu", tie_word_embeddings=False)
GEMMA3 = dict(
    hidden_size=36, intermediate_size=52, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=10, sliding_window=8, sliding_window_pattern=2,
    query_pre_attn_scalar=16, rope_local_base_freq=100.0, rope_theta=1000.0,
    rope_scaling=dict(rope_type="linear", factor=2.0),
)
EUROBERT = dict(
    hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, rope_theta=100.0, mlp_bias=True, attention_bias=True,
)
NOMIC = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
             rope_theta=100.0, layer_norm_eps=1e-12)
FAMILIES = {
    "modernbert": ("ModernBertModel", "ModernBertConfig", MODERNBERT),
    "modernbert_biased": ("ModernBertModel", "ModernBertConfig", BIASED),
    "modernbert_mlm": ("ModernBertForMaskedLM", "ModernBertConfig", MODERNBERT),
    "modernbert_mlm_biased": ("ModernBertForMaskedLM", "ModernBertConfig", BIASED),
    "modernbert_cls": ("ModernBertForSequenceClassification", "ModernBertConfig", MODERNBERT),
    "modernbert_mean": ("ModernBertForSequenceClassification", "ModernBertConfig", BIASED),
    "gemma3_bidirectional": ("Gemma3TextModel", "Gemma3TextConfig",
                             dict(GEMMA3, use_bidirectional_attention=True)),
    "gemma3_causal": ("Gemma3TextModel", "Gemma3TextConfig", GEMMA3),
    "eurobert": ("EuroBertModel", "EuroBertConfig", EUROBERT),
    "eurobert_mlm": ("EuroBertForMaskedLM", "EuroBertConfig", EUROBERT),
    "eurobert_mlm_tied": ("EuroBertForMaskedLM", "EuroBertConfig",
                          dict(EUROBERT, mlp_bias=False, tie_word_embeddings=True)),
    "nomic_bert": ("NomicBertModel", "NomicBertConfig", NOMIC),
}


def hf_model(name, **changes):
    return hf_family(name, FAMILIES, COMMON, sharpen=True, random_biases=True, **changes)


def padded_batch():
    """Rows right-padded (17 tokens), left-padded (19) and full, of LENGTH."""
    rng = np.random.default_rng(7)
    ids = rng.integers(3, VOCAB, size=(3, LENGTH)).astype("int32")
    mask = np.ones_like(ids)
    mask[0, 17:] = 0
    mask[1, :5] = 0
    ids[mask == 0] = 0
    return ids, mask


def inputs(name, ids, mask):
    """The batch as inputs; NomicBERT's also has token types (a second type
    from position 10, so that the type table is checked)."""
    feed = {"input_ids": ids, "attention_mask": mask}
    if name.startswith("nomic"):
        feed["token_type_ids"] = np.broadcast_to(np.arange(ids.shape[1]) >= 10, ids.shape).astype("int32")
    return feed


def hf_output(hf, feed):
    with torch.no_grad():
        out = hf(**{key: torch.tensor(value, dtype=torch.long) for key, value in feed.items()})
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).numpy()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    hf = hf_model(request.param)
    return request.param, hf, from_huggingface(hf)


def test_outputs_equal_transformers_on_padded_batches(family):
    name, hf, model = family
    ids, mask = padded_batch()
    feed = inputs(name, ids, mask)
    want = hf_output(hf, feed)
    got = np.asarray(model(feed))
    assert got.shape == want.shape
    # Padded positions are computed by both but used by neither (keys are
    # masked); compare the tokens. "cls" pooling reads position 0, which
    # in the left-padded row is a pad whose local window holds no token
    # (transformers then averages every value, keras_attn none): that row
    # is left out.
    if want.ndim == 3:
        got, want = got[mask == 1], want[mask == 1]
    elif getattr(hf.config, "classifier_pooling", None) == "cls":
        got, want = got[mask[:, 0] == 1], want[mask[:, 0] == 1]
    layers = hf.config.num_hidden_layers
    tolerance.assert_close(got, want, terms=(layers + 1) * 64, err_msg=name)
    assert np.abs(want).max() > 1.0, "outputs too flat to test anything"


@pytest.mark.parametrize("name, change", [
    ("modernbert", dict(local_attention=10)),
    ("modernbert", dict(local_rope_theta=500.0)),
    ("modernbert", dict(global_rope_theta=100.0)),
    ("gemma3_bidirectional", dict(sliding_window=10)),
    ("gemma3_bidirectional", dict(rope_local_base_freq=1000.0)),
    ("gemma3_bidirectional", dict(use_bidirectional_attention=False)),
])
def test_windows_and_rotary_bases_are_active(name, change):
    """The same weights with one of these fields changed give other hidden
    states on the test batch: the comparisons above check each of them."""
    ids, mask = padded_batch()
    base, changed = hf_model(name), hf_model(name, **change)
    valid = mask == 1
    feed = inputs(name, ids, mask)
    before, after = hf_output(base, feed)[valid], hf_output(changed, feed)[valid]
    assert np.abs(before - after).max() > 0.01 * np.abs(before).max()


@pytest.mark.parametrize("name", ["modernbert_mlm", "eurobert_mlm_tied"])
def test_tied_masked_lm_from_a_safetensors_folder(tmp_path, name):
    """`save_pretrained` leaves the tied decoder out: the table serves."""
    hf = hf_model(name)
    hf.save_pretrained(tmp_path)
    ids, mask = padded_batch()
    feed = inputs(name, ids, mask)
    got = np.asarray(from_huggingface(str(tmp_path))(feed))
    want = hf_output(hf, feed)
    tolerance.assert_close(got[mask == 1], want[mask == 1], terms=5 * 64)


def _refused(name, changes, match, **model_changes):
    hf = hf_model(name, **model_changes)
    for field, value in changes.items():
        setattr(hf.config, field, value)
    with pytest.raises(ValueError, match=match):
        from_huggingface(hf)


@pytest.mark.parametrize("changes, match", [
    (dict(hidden_activation="softplus"), "`hidden_activation`='softplus'"),
    (dict(layer_types=["full_attention", "chunked_attention", "full_attention", "full_attention"]),
     "`layer_types`=.*chunked_attention"),
    (dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e3},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}),
     "`rope_scaling`=.*linear"),
])
def test_modernbert_refuses_what_it_cannot_represent(changes, match):
    _refused("modernbert", changes, match)


def test_modernbert_refuses_other_heads_and_classifier_options():
    token = hf_family("m", {"m": ("ModernBertForTokenClassification", "ModernBertConfig", MODERNBERT)}, COMMON)
    with pytest.raises(ValueError, match="ModernBertForTokenClassification"):
        from_huggingface(token)
    _refused("modernbert_cls", dict(problem_type="ranking"), "`problem_type`='ranking'")
    _refused("modernbert_mlm", dict(classifier_activation="softplus"), "`classifier_activation`='softplus'")


def test_eurobert_and_nomic_bert_refuse_what_they_cannot_represent():
    _refused("eurobert", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 100.0}),
             "`rope_scaling`=.*yarn")
    _refused("nomic_bert", dict(hidden_act="softplus"), "`hidden_act`='softplus'")
    pooled = transformers.NomicBertModel(transformers.NomicBertConfig(**COMMON, **NOMIC), add_pooling_layer=True)
    with pytest.raises(ValueError, match=r"NomicBertModel: these checkpoint tensors .*pooler\.dense"):
        from_huggingface(pooled)


@pytest.mark.slow
@pytest.mark.tensorflow_only
@pytest.mark.parametrize("name", ["modernbert_mlm", "gemma3_bidirectional"])
def test_exports_equal_transformers(tmp_path, name):
    """ONNX run by onnxruntime against transformers; TFLite of builtin ops
    only, checked against Keras by the exporter."""
    import onnxruntime as ort

    from keras_attn import export as kx

    hf = hf_model(name)
    model = from_huggingface(hf)
    onx = kx.export_onnx(model, tmp_path / "model.onnx")
    tfl = kx.export_tflite(model, tmp_path / "model.tflite")
    assert not [op for op in tfl.ops if "FLEX" in op.upper() or op == "CUSTOM"]
    assert tfl.max_abs_error <= tfl.atol
    ids, mask = padded_batch()
    feed = inputs(name, ids, mask)
    session = ort.InferenceSession(onx.path, providers=["CPUExecutionProvider"])
    got = session.run(None, feed)[0]
    want = hf_output(hf, feed)
    tolerance.assert_close(got[mask == 1], want[mask == 1], terms=(hf.config.num_hidden_layers + 1) * 64)
