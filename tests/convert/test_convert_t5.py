"""T5 from `transformers` (v1.0: ReLU, tied head with its rescale; v1.1:
gated GELU, untied head), converted with `from_huggingface`: logits against
a float64 run of the Hugging Face model, greedy tokens equal to
`generate(do_sample=False)`, T5EncoderModel's hidden states, and the
exported prefill/decode reproducing Hugging Face's tokens."""

import keras
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from keras_attn.convert import from_huggingface  # noqa: E402
from keras_attn.generation import greedy_search  # noqa: E402
from keras_attn.runtimes import signatures as gen_export  # noqa: E402
from tests import tolerance  # noqa: E402
from tests.model_zoo import ort_runner  # noqa: E402

VOCAB = 53
VARIANTS = {
    # Few buckets and a short max distance: the log-spaced buckets and the
    # last bucket are reached at the test lengths. Decoder deeper than encoder.
    "v1_0_relu_tied": dict(feed_forward_proj="relu", tie_word_embeddings=True, num_decoder_layers=3),
    "v1_1_gated_gelu": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}


def hf_t5(name, cls=None, seed=0):
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=6, d_ff=24, num_layers=2, num_heads=3,
        relative_attention_num_buckets=8, relative_attention_max_distance=20,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **VARIANTS[name])
    torch.manual_seed(seed)
    model = (cls or transformers.T5ForConditionalGeneration)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "relative_attention_bias" in pname:
                p.mul_(5.0)  # position-dependent attention
            elif p.dim() == 2:
                p.mul_(3.0)
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def t5(request):
    hf = hf_t5(request.param)
    return request.param, hf, from_huggingface(hf)


def encoder_batch():
    rng = np.random.default_rng(2)
    ids = rng.integers(2, VOCAB, size=(2, 26)).astype("int32")  # longer than max_distance
    ids[1, 9:] = 0
    return ids, (ids != 0).astype("int32")


def test_logits_against_float64_hugging_face(t5):
    name, hf, lm = t5
    enc, mask = encoder_batch()
    dec = np.random.default_rng(3).integers(2, VOCAB, size=(2, 24)).astype("int32")
    dec[:, 0] = 0  # decoder start
    hf64 = hf_t5(name).double()
    with torch.no_grad():
        want = hf64(input_ids=torch.tensor(enc, dtype=torch.long), attention_mask=torch.tensor(mask),
                    decoder_input_ids=torch.tensor(dec, dtype=torch.long)).logits.numpy()
    got = np.asarray(lm((enc, dec)))
    # Float32 against float64: one rounding budget per block (tests/tolerance.py).
    blocks = hf.config.num_layers + hf.config.num_decoder_layers
    tolerance.assert_close(got, want, terms=blocks * tolerance.LAYER_TERMS)
    assert np.abs(want).max() > 1.0


def test_greedy_tokens_equal_hf_generate():
    hf = hf_t5("v1_1_gated_gelu")
    lm = from_huggingface(hf)
    enc, mask = encoder_batch()
    with torch.no_grad():
        want = hf.generate(torch.tensor(enc, dtype=torch.long), attention_mask=torch.tensor(mask),
                           do_sample=False, max_length=12, eos_token_id=None).numpy()
    got = greedy_search(lm, np.zeros((2, 1), "int32"), 12, encoder_ids=enc).numpy()
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got[:, 1:])) > 3, "degenerate generation tests nothing"


def test_encoder_model_hidden_states():
    hf = hf_t5("v1_1_gated_gelu", cls=transformers.T5EncoderModel)
    model = from_huggingface(hf)
    enc, mask = encoder_batch()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(enc, dtype=torch.long),
                  attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    got = np.asarray(model([enc, mask]))
    valid = mask.astype(bool)
    tolerance.assert_close(got[valid], want[valid], terms=2 * tolerance.LAYER_TERMS)


def _artifact_greedy(prefill, decode, encoder_ids, max_length):
    batch = encoder_ids.shape[0]
    tokens = np.zeros((batch, max_length), np.int32)
    out = prefill(token_ids=tokens[:, :1], encoder_ids=encoder_ids)
    state = {k: out[k] for k in ("cache", "cross_cache", "encoder_padding_mask")}
    for i in range(1, max_length):
        out = decode(token_ids=tokens[:, i - 1:i], index=np.array(i - 1, np.int32), **state)
        state["cache"] = out["cache"]
        tokens[:, i] = np.argmax(out["logits"][:, 0], axis=-1)
    return tokens


@pytest.mark.slow
def test_exported_prefill_decode_reproduce_hf_tokens(tmp_path):
    import onnxruntime as ort
    from ai_edge_litert import interpreter as litert

    hf = hf_t5("v1_1_gated_gelu")
    lm = from_huggingface(hf)
    enc, mask = encoder_batch()
    with torch.no_grad():
        want = hf.generate(torch.tensor(enc, dtype=torch.long), attention_mask=torch.tensor(mask),
                           do_sample=False, max_length=10, eos_token_id=None).numpy()
    path = gen_export.export_tflite(lm, str(tmp_path / "t5.tflite"), max_length=10, batch_size=2,
                                    prompt_length=1, encoder_length=enc.shape[1])
    interpreter = litert.Interpreter(model_path=path)
    ops = {d["op_name"] for d in interpreter._get_ops_details()}
    assert not [o for o in ops if o.startswith("Flex") or o == "CUSTOM"], ops
    got = _artifact_greedy(interpreter.get_signature_runner("prefill"),
                           interpreter.get_signature_runner("decode"), enc, 10)
    np.testing.assert_array_equal(got, want)

    paths = gen_export.export_onnx(lm, str(tmp_path / "t5_onnx"), max_length=10)
    sessions = {k: ort.InferenceSession(p, providers=["CPUExecutionProvider"])
                for k, p in paths.files.items()}

    got = _artifact_greedy(ort_runner(sessions["prefill"]), ort_runner(sessions["decode"]), enc, 10)
    np.testing.assert_array_equal(got, want)


def test_saves_and_loads(tmp_path, t5):
    name, hf, lm = t5
    enc, _ = encoder_batch()
    dec = np.array([[0, 5, 6], [0, 7, 8]], "int32")
    path = str(tmp_path / f"{name}.keras")
    lm.save(path)
    again = keras.saving.load_model(path)
    np.testing.assert_array_equal(np.asarray(again((enc, dec))), np.asarray(lm((enc, dec))))


def test_refuses_other_heads():
    config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_layers=1,
                                   num_heads=4)
    with pytest.raises(ValueError, match="T5ForConditionalGeneration and T5EncoderModel"):
        from_huggingface(transformers.T5ForSequenceClassification(config))
