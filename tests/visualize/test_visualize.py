"""keras_attn.visualize: every map equals the layer's own `return_attention_scores`
and an independent NumPy softmax; masked positions are exactly zero; converted
BERT/GPT-2 maps equal `transformers`' `output_attentions`; exploring changes
neither predictions nor exports; the HTML carries the maps and no network
resource; the callback writes TensorBoard images; the CLI writes both views."""

import json
import re

import keras
import numpy as np
import pytest

import keras_attn as ka
from keras_attn.generation import Seq2SeqLM
from keras_attn.visualize import (AttentionMapCallback, attention_maps, attention_rollout,
                                  html_view, plot_attention, plot_heads)
from tests import reference as ref
from tests import tolerance
from tests.environments import child_env

IDS = np.array([[5, 6, 7, 0, 0], [3, 4, 5, 6, 7]], np.int32)


@pytest.fixture(scope="module")
def encoder():
    keras.utils.set_random_seed(0)
    ids = keras.Input((None,), dtype="int32", name="tokens")
    h = ka.TokenAndPositionEmbedding(40, 16, 16, mask_zero=True, name="embedding")(ids)
    h = ka.TransformerEncoderBlock(num_heads=2, intermediate_dim=32, name="enc0")(h)
    h = ka.TransformerEncoderBlock(num_heads=2, intermediate_dim=32, num_key_value_heads=1,
                                   normalize_first=True, name="enc1")(h)
    model = keras.Model(ids, keras.layers.Dense(3, name="head")(h))
    for w in model.weights:  # sharp attention
        w.assign(w.numpy() * 3)
    return model


def test_encoder_maps_equal_return_attention_scores_and_numpy(encoder):
    maps = attention_maps(encoder, IDS)
    assert [m.name for m in maps] == ["enc0/self_attention", "enc1/self_attention"]
    embedding = encoder.get_layer("embedding")
    x = embedding(IDS)
    mask = IDS != 0
    for m, name in zip(maps, ("enc0", "enc1")):
        block = encoder.get_layer(name)
        x, scores = block(x, padding_mask=mask, return_attention_scores=True)
        np.testing.assert_array_equal(m.scores, np.asarray(scores))
    # Independent: softmax(QK^T / sqrt(d)) in NumPy on the first layer's input.
    x0 = np.asarray(embedding(IDS))
    attn = encoder.get_layer("enc0").self_attention
    _, probs = ref.mha(x0, x0, x0, ref.mha_weights(attn), 2, 2, mask=mask[:, None, None, :])
    valid = mask[:, None, :, None] & np.ones_like(probs, bool)
    tolerance.assert_close(maps[0].scores[valid], probs[valid], terms=tolerance.LAYER_TERMS)
    # Masked positions exactly zero, and marked.
    for m in maps:
        assert m.mask is not None and m.mask.shape == m.scores.shape[:1] + m.mask.shape[1:2] + m.scores.shape[2:]
        assert not np.any(np.broadcast_to(~m.mask, m.scores.shape) & (m.scores != 0))
        np.testing.assert_array_equal(m.key_padding(), ~mask)
        assert np.all(m.scores[0, :, :, 3:] == 0.0)
    assert np.abs(maps[0].scores[1].max(-1)).min() > 0.3, "attention too flat to test anything"


def test_exploring_changes_neither_predictions_nor_exports(encoder, tmp_path):
    from keras_attn.export import tflite

    before = np.asarray(encoder(IDS))
    weights = [w.copy() for w in encoder.get_weights()]
    config = json.dumps(encoder.get_config(), sort_keys=True, default=str)
    first, _ = tflite.convert(encoder)
    attention_maps(encoder, IDS)
    np.testing.assert_array_equal(np.asarray(encoder(IDS)), before)
    for a, b in zip(encoder.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    assert json.dumps(encoder.get_config(), sort_keys=True, default=str) == config
    again, _ = tflite.convert(encoder)
    assert again == first


def test_decoder_self_and_cross_maps():
    keras.utils.set_random_seed(1)
    model = Seq2SeqLM(30, 16, 16, num_layers=2, num_heads=4, intermediate_dim=32,
                      num_key_value_heads=2)
    enc = np.array([[5, 6, 7, 8, 0, 0], [3, 4, 5, 6, 7, 9]], np.int32)
    dec = np.array([[1, 4, 5], [1, 6, 7]], np.int32)
    maps = attention_maps(model, (enc, dec))
    names = [m.name for m in maps]
    assert names == ["encoder_0/self_attention", "encoder_1/self_attention",
                     "decoder_0/self_attention", "decoder_0/cross_attention",
                     "decoder_1/self_attention", "decoder_1/cross_attention"]
    encoded, mask = model.encode(enc)
    x = model.decoder_embedding(dec)
    for i, block in enumerate(model.blocks):
        x, scores = block(x, encoded, encoder_padding_mask=mask, return_attention_scores=True)
        by_name = {m.name: m for m in maps}
        np.testing.assert_array_equal(by_name[f"decoder_{i}/self_attention"].scores,
                                      np.asarray(scores["self_attention"]))
        cross = by_name[f"decoder_{i}/cross_attention"]
        np.testing.assert_array_equal(cross.scores, np.asarray(scores["cross_attention"]))
        assert cross.scores.shape == (2, 4, 3, 6)
        assert np.all(cross.scores[0, :, :, 4:] == 0.0)  # encoder padding
        causal = by_name[f"decoder_{i}/self_attention"].scores
        assert np.all(np.triu(np.ones((3, 3), bool), 1)[None, None] <= (causal == 0))


def test_converted_bert_and_gpt2_equal_transformers_attentions():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from keras_attn.convert import from_huggingface

    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=24, max_position_embeddings=16, initializer_range=0.3,
        attn_implementation="eager")).eval()
    ids = IDS.astype("int64")
    mask = (IDS != 0).astype("int64")
    with torch.no_grad():
        want = bert(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    token_type_ids=torch.zeros_like(torch.tensor(ids)),
                    output_attentions=True).attentions
    model = from_huggingface(bert)
    feed = {"input_ids": IDS, "attention_mask": mask.astype("int32"),
            "token_type_ids": np.zeros_like(IDS)}
    maps = attention_maps(model, [feed[i.name] for i in model.inputs])
    assert len(maps) == 2
    for m, w in zip(maps, want):
        w = w.numpy()
        tolerance.assert_close(m.scores[1], w[1], terms=2 * tolerance.LAYER_TERMS)
        # Row 0: HF gives padded keys ~1e-?? weights (additive -inf mask), ours exact zeros.
        assert np.all(m.scores[0, :, :, 3:] == 0.0)
        tolerance.assert_close(m.scores[0, :, :3, :3], w[0, :, :3, :3], terms=2 * tolerance.LAYER_TERMS)

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=40, n_embd=16, n_layer=2, n_head=4, n_positions=16, initializer_range=0.3,
        attn_implementation="eager")).eval()
    lm = from_huggingface(gpt2)
    with torch.no_grad():
        want = gpt2(input_ids=torch.tensor(IDS[1:].astype("int64")), output_attentions=True).attentions
    maps = attention_maps(lm, IDS[1:])
    assert [m.name for m in maps] == ["decoder_0/self_attention", "decoder_1/self_attention"]
    for m, w in zip(maps, want):
        tolerance.assert_close(m.scores, w.numpy(), terms=2 * tolerance.LAYER_TERMS)
        assert np.all(m.scores[0][:, np.triu(np.ones((5, 5), bool), 1)] == 0.0)


def test_rollout_matches_numpy(encoder):
    maps = attention_maps(encoder, IDS)
    got = attention_rollout(maps)
    for b in range(2):
        want = np.eye(5)
        for m in maps:
            a = m.scores[b].astype(np.float64).mean(0) + np.eye(5)
            a = a / a.sum(-1, keepdims=True)
            want = a @ want
        np.testing.assert_allclose(got[b], want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-12)
    with pytest.raises(ValueError, match="one shape"):
        attention_rollout([maps[0].scores, maps[0].scores[:, :, :3, :3]])


def test_pictures(encoder, tmp_path):
    import matplotlib.pyplot as plt

    maps = attention_maps(encoder, IDS)
    fig = plot_heads(maps, list("abcde"))
    drawn = [ax for ax in fig.axes if ax.images]  # the colour bar's axes hold no image
    assert len(drawn) == 4  # 2 layers x 2 heads
    labels = [t.get_text() for t in drawn[-1].get_xticklabels()]
    assert labels == list("abcde")
    fig.savefig(tmp_path / "heads.png")
    fig.savefig(tmp_path / "heads.svg")
    assert (tmp_path / "heads.png").stat().st_size > 1000
    plt.close("all")
    one = plot_attention(maps[0].scores[1, 0], list("abcde"))
    image = one.axes[0].images[0].get_array()
    np.testing.assert_array_equal(np.asarray(image), maps[0].scores[1, 0])
    with pytest.raises(ValueError, match="query_tokens"):
        plot_attention(maps[0].scores[1, 0], list("abc"))
    with pytest.raises(ValueError, match="one head"):
        plot_attention(maps[0].scores[1])
    plt.close("all")


def test_html_is_offline_and_carries_the_maps(encoder, tmp_path):
    maps = attention_maps(encoder, IDS)
    path = html_view(maps, list("abcde"), str(tmp_path / "view.html"), title="test <view>")
    page = open(path, encoding="utf-8").read()
    # No network: no external scripts, styles, images or fonts.
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:""", page)
    assert not re.search(r"url\(\s*['\"]?https?:", page)
    assert "<link" not in page and "@import" not in page
    assert "test &lt;view&gt;" in page
    payload = re.search(r'<script type="application/json" id="attention-data">(.*?)</script>',
                        page, re.S).group(1)
    data = json.loads(payload.replace("<\\/", "</"))
    assert data["batch"] == 2 and [m["name"] for m in data["maps"]] == [m.name for m in maps]
    for embedded, m in zip(data["maps"], maps):
        np.testing.assert_allclose(np.array(embedded["scores"]), m.scores, atol=5.1e-5)
        assert embedded["query_tokens"] == list("abcde")
        assert embedded["key_padding"] == m.key_padding().tolist()


@pytest.mark.tensorflow_only
def test_callback_writes_tensorboard_images(encoder, tmp_path):
    import tensorflow as tf

    model = keras.models.clone_model(encoder)
    model.set_weights(encoder.get_weights())
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callback = AttentionMapCallback(IDS[:1], str(tmp_path), every_n_epochs=2)
    model.fit(IDS, np.zeros((2, 5), "int32"), epochs=3, verbose=0, callbacks=[callback])
    steps = []
    for path in (tmp_path / "attention").glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag == "attention_heads":
                    steps.append(event.step)
                    image = tf.io.decode_png(value.image.encoded_image_string)
                    assert image.shape[0] > 50 and image.shape[1] > 50
                    assert (value.image.height, value.image.width) == tuple(image.shape[:2])
    assert sorted(steps) == [0, 2]
    with pytest.raises(ValueError, match="every_n_epochs"):
        AttentionMapCallback(IDS, str(tmp_path), every_n_epochs=0)


def test_cli_writes_png_and_html(encoder, tmp_path):
    import subprocess
    import sys

    path = tmp_path / "enc.keras"
    encoder.save(path)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["<pad>"] + [f"w{i}" for i in range(1, 40)]) + "\n")
    # The host's environment as it is (a CPU pinning it needs included).
    env = child_env(KERAS_BACKEND="tensorflow")
    for args in (["--ids", "5,6,7"], ["--text", "w5 w6 w7", "--vocab", str(vocab)]):
        out = tmp_path / args[0].strip("-")
        result = subprocess.run([sys.executable, "-m", "keras_attn.cli", "attention", str(path),
                                 *args, "--out", str(out)], capture_output=True, text=True,
                                env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "enc0/self_attention" in result.stdout
        assert (out / "attention_heads.png").stat().st_size > 1000
        page = (out / "attention.html").read_text()
        data = json.loads(re.search(r'id="attention-data">(.*?)</script>', page, re.S)
                          .group(1).replace("<\\/", "</"))
        want = attention_maps(encoder, np.array([[5, 6, 7]], np.int32))[0].scores
        np.testing.assert_allclose(np.array(data["maps"][0]["scores"]), want, atol=5.1e-5)
    bad = subprocess.run([sys.executable, "-m", "keras_attn.cli", "attention", str(path),
                          "--text", "w5 zz", "--vocab", str(vocab)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "not in --vocab" in bad.stderr


def test_maps_during_cached_decoding():
    """A decoding step's maps (over the cache slots) are the last row of the
    full call's maps; slots not yet written are masked (exactly 0)."""
    from keras_attn.generation import DecoderOnlyLM

    keras.utils.set_random_seed(2)
    lm = DecoderOnlyLM(30, 16, 16, num_layers=2, num_heads=2, intermediate_dim=16,
                       position="rotary")
    prompt = np.array([[3, 4, 5]], np.int32)
    lm(prompt)
    _, cache = lm.call_with_cache(prompt, lm.init_cache(1, 8), 0)
    step = attention_maps(lambda t: lm.call_with_cache(t, cache, 3), np.array([[7]], np.int32))
    full = attention_maps(lm, np.array([[3, 4, 5, 7]], np.int32))
    assert len(step) == len(full) == 2
    for s, f in zip(step, full):
        assert s.scores.shape == (1, 2, 1, 8)
        tolerance.assert_close(s.scores[0, :, 0, :4], f.scores[0, :, 3, :4],
                               terms=tolerance.LAYER_TERMS)
        assert np.all(s.scores[..., 4:] == 0.0) and not s.mask[..., 4:].any()
