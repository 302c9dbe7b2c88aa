"""Causal-LM fine-tuning data (`keras_attn.data.causal_lm_dataset`) and its fit.

The rows are checked against a construction written here (position by
position over the token stream, and one small case by hand); the loss only
sees responses (zero gradient at prompt positions); `DecoderOnlyLM.fit`
learns a copy task from it; `Trainer` resumes from a checkpoint with the
weights an uninterrupted run reaches.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_attn.data import causal_lm_arrays, causal_lm_dataset
from keras_attn.generation import DecoderOnlyLM
from keras_attn.runtimes.tokenizers import character_tokenizer
from keras_attn.training import Trainer
from tests import tolerance

ALPHABET = "abc=:u\n"
SPECIALS = ("<pad>", "<eos>")
PAD, EOS = 0, 1


def char_ids(text):
    """The character tokenizer's ids, independently: specials first, then the alphabet."""
    return [len(SPECIALS) + ALPHABET.index(c) for c in text]


def reference_rows(documents, length, packing):
    """Rows from `[(ids, learned)]` documents, position by position.

    A target is learned when its token is learned and is not the first of
    its document (which in a packed row would follow another document).
    """
    def rows_of(stream, learned):
        count = max(1, -(-(len(stream) - 1) // length))
        x = [[PAD] * length for _ in range(count)]
        y = [[PAD] * length for _ in range(count)]
        w = [[0.0] * length for _ in range(count)]
        for r in range(count):
            for j in range(length):
                k = r * length + j
                if k < len(stream):
                    x[r][j] = stream[k]
                if k + 1 < len(stream):
                    y[r][j] = stream[k + 1]
                    w[r][j] = 1.0 if learned[k + 1] else 0.0
        return x, y, w

    marked = [(ids, [flag and i > 0 for i, flag in enumerate(learned)])
              for ids, learned in documents]
    if packing:
        parts = [rows_of(sum((ids for ids, _ in marked), []),
                         sum((flags for _, flags in marked), []))]
    else:
        parts = [rows_of(ids[: length + 1], flags[: length + 1]) for ids, flags in marked]
    return tuple(np.array(sum((p[i] for p in parts), [])) for i in range(3))


def random_text(rng, low, high):
    return "".join(rng.choice(list("abc"), size=int(rng.integers(low, high))))


def test_packed_pairs_by_hand():
    tok = character_tokenizer(ALPHABET, special_tokens=SPECIALS)
    x, y, w = causal_lm_arrays([("ab=", "ba"), ("c=", "cc")], tok, 4, eos_token_id=EOS)
    a, b, c, eq = char_ids("abc=")
    # stream: a b = | b a EOS || c = | c c EOS   (| prompt/response, || documents)
    np.testing.assert_array_equal(x, [[a, b, eq, b], [a, EOS, c, eq], [c, c, EOS, PAD]])
    np.testing.assert_array_equal(y, [[b, eq, b, a], [EOS, c, eq, c], [c, EOS, PAD, PAD]])
    # The second row's `c` follows the first document's EOS: not learned.
    np.testing.assert_array_equal(w, [[0, 0, 1, 1], [1, 0, 0, 1], [1, 1, 0, 0]])
    assert x.dtype == np.int32 and y.dtype == np.int32 and w.dtype == np.float32


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("kind", ["texts", "pairs"])
def test_rows_match_the_construction(rng, kind, packing):
    tok = character_tokenizer(ALPHABET, special_tokens=SPECIALS)
    if kind == "texts":
        examples = [random_text(rng, 0, 12) for _ in range(7)]
        documents = [(char_ids(t) + [EOS], [True] * (len(t) + 1)) for t in examples]
    else:
        examples = [(random_text(rng, 1, 6) + "=", random_text(rng, 0, 6)) for _ in range(7)]
        documents = [(char_ids(p) + char_ids(r) + [EOS], [False] * len(p) + [True] * (len(r) + 1))
                     for p, r in examples]
    length = 5
    got = causal_lm_arrays(examples, tok, length, packing=packing, eos_token_id=EOS)
    want = reference_rows(documents, length, packing)
    for g, expected, name in zip(got, want, ("token_ids", "targets", "sample_weights")):
        np.testing.assert_array_equal(g, expected, err_msg=name)

    ds = causal_lm_dataset(examples, tok, length, batch_size=3, packing=packing,
                           eos_token_id=EOS)
    batches = list(ds.as_numpy_iterator())
    assert [len(b[0]) for b in batches[:-1]] == [3] * (len(batches) - 1)
    for i in range(3):
        np.testing.assert_array_equal(np.concatenate([b[i] for b in batches]), want[i])


def test_shuffle_permutes_rows_per_epoch_whatever_the_global_seed(rng):
    tok = character_tokenizer(ALPHABET, special_tokens=SPECIALS)
    examples = [random_text(rng, 1, 9) for _ in range(10)]
    rows = causal_lm_arrays(examples, tok, 4, packing=False, eos_token_id=EOS)[0]

    def two_epochs(global_seed):
        tf.random.set_seed(global_seed)
        ds = causal_lm_dataset(examples, tok, 4, batch_size=5, packing=False, eos_token_id=EOS,
                               shuffle=True, seed=7, repeat=True)
        return np.concatenate([b[0] for b in ds.take(4).as_numpy_iterator()])

    got = two_epochs(1)
    np.testing.assert_array_equal(got, two_epochs(2))
    first, second = got[:10], got[10:]
    key = lambda a: sorted(map(tuple, a.tolist()))  # noqa: E731
    assert key(first) == key(rows) and key(second) == key(rows)
    assert not np.array_equal(first, second) and not np.array_equal(first, rows)


@pytest.mark.parametrize("from_folder", [False, True])
def test_chat_template_learns_the_answer_and_its_end_of_turn(tmp_path, from_folder):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=character_tokenizer(ALPHABET, special_tokens=SPECIALS),
        eos_token="<eos>", pad_token="<pad>",
    )
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    if from_folder:  # as a converted model's folder holds it
        tok.save_pretrained(tmp_path)
        tok = tmp_path
    x, y, w = causal_lm_arrays([("ab", "ba")], tok, 12, use_chat_template=True, packing=False)
    # "u:ab\na:" is the prompt, "ba\n" the answer and its end of turn; no EOS is added.
    stream = char_ids("u:ab\na:") + char_ids("ba\n")
    np.testing.assert_array_equal(x[0], stream + [PAD] * 2)
    np.testing.assert_array_equal(y[0], stream[1:] + [PAD] * 3)
    np.testing.assert_array_equal(w[0], [0] * 6 + [1] * 3 + [0] * 3)


def tiny_lm(vocabulary_size, length, seed=0):
    keras.utils.set_random_seed(seed)
    lm = DecoderOnlyLM(vocabulary_size, length, 32, num_layers=2, num_heads=2,
                       intermediate_dim=32)
    lm(np.zeros((1, length), "int32"))
    return lm


def test_loss_sees_only_the_responses(rng):
    tok = character_tokenizer(ALPHABET, special_tokens=SPECIALS)
    examples = [(random_text(rng, 2, 5) + "=", random_text(rng, 1, 4)) for _ in range(6)]
    x, y, w = causal_lm_arrays(examples, tok, 8, eos_token_id=EOS)
    vocabulary = tok.get_vocab_size()
    lm = tiny_lm(vocabulary, 8)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    logits = tf.convert_to_tensor(lm(x))
    assert tuple(logits.shape) == (*x.shape, vocabulary)
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = loss_fn(y, logits, sample_weight=w)
    grad = tape.gradient(loss, logits).numpy()
    assert 0 < w.sum() < w.size
    np.testing.assert_array_equal(grad[w == 0], 0.0)
    assert (np.abs(grad[w == 1]).max(axis=-1) > 0).all()
    # Other target ids where the weight is 0 (prompts, padding, boundaries): the same loss.
    changed = np.where(w == 0, rng.integers(0, vocabulary, size=y.shape), y).astype("int32")
    assert (changed != y).any()
    assert float(loss_fn(changed, logits, sample_weight=w)) == float(loss)


def test_fit_learns_a_copy_task(rng):
    tok = character_tokenizer("abc=", special_tokens=SPECIALS)
    examples = []
    for _ in range(64):
        text = random_text(rng, 3, 4)
        examples.append((text + "=", text))
    ds = causal_lm_dataset(examples, tok, 8, batch_size=16, packing=False, eos_token_id=EOS,
                           shuffle=True)
    lm = tiny_lm(tok.get_vocab_size(), 8)
    lm.compile(keras.optimizers.Adam(1e-2),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # shuffle=False: the pipeline shuffles (fit cannot shuffle a dataset).
    history = lm.fit(ds, epochs=6, verbose=0, shuffle=False).history["loss"]
    assert history[-1] < 0.6 * history[0], history


def pairs_and_stream(rng):
    tok = character_tokenizer("abc=", special_tokens=SPECIALS)
    examples = [(random_text(rng, 2, 5) + "=", random_text(rng, 1, 5)) for _ in range(12)]

    def make_dataset(_context=None):
        return causal_lm_dataset(examples, tok, 8, batch_size=4, eos_token_id=EOS,
                                 shuffle=True, seed=3, repeat=True)

    return tok.get_vocab_size(), make_dataset


def train(vocabulary, make_dataset, steps, directory=None, seed=0, jit_compile=False):
    lm = tiny_lm(vocabulary, 8, seed=seed)
    trainer = Trainer(lm, keras.optimizers.Adam(1e-2),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      global_batch_size=4, checkpoint_dir=directory and str(directory),
                      checkpoint_every=100, log_every=1, jit_compile=jit_compile)
    losses = []
    trainer.fit(make_dataset, steps, on_step_end=lambda s, v: losses.append(v), verbose=False)
    return lm, trainer, losses


@pytest.mark.parametrize("jit_compile", [False, True])
def test_trainer_loss_is_the_weighted_mean_over_positions(rng, jit_compile):
    vocabulary, make_dataset = pairs_and_stream(rng)
    x, y, w = next(make_dataset().as_numpy_iterator())
    logits = np.asarray(tiny_lm(vocabulary, 8)(x), np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    cross_entropy = -np.take_along_axis(log_softmax, y[..., None], axis=-1)[..., 0]
    # model.fit's default reduction: the weighted sum over every position.
    want = float((w * cross_entropy).sum() / w.size)
    _, _, losses = train(vocabulary, make_dataset, 1, jit_compile=jit_compile)
    tolerance.assert_close(losses[0], want, terms=64)


def test_trainer_resumes_from_the_checkpoint_with_the_uninterrupted_weights(tmp_path, rng):
    vocabulary, make_dataset = pairs_and_stream(rng)
    full, _, _ = train(vocabulary, make_dataset, 6, tmp_path / "full")
    halfway, _, _ = train(vocabulary, make_dataset, 3, tmp_path / "resumed")
    # Another initialisation: the checkpoint must overwrite it.
    resumed, trainer, _ = train(vocabulary, make_dataset, 6, tmp_path / "resumed", seed=1)
    assert [step for step, _ in trainer.history] == [4, 5, 6]
    # Steps 4-6 moved the weights: resuming is not a no-op that happens to match.
    assert any(not np.array_equal(h.numpy(), f.numpy())
               for h, f in zip(halfway.weights, full.weights))
    for a, b in zip(resumed.weights, full.weights):
        tolerance.assert_close(a.numpy(), b.numpy(), err_msg=a.path)


@pytest.mark.parametrize("call, argument", [
    (lambda tok: causal_lm_arrays([], tok, 8, eos_token_id=EOS), "examples"),
    (lambda tok: causal_lm_arrays([("ab", "c"), ("a",)], tok, 8, eos_token_id=EOS),
     r"examples\[1\]"),
    (lambda tok: causal_lm_arrays([("ab", "c"), "abc"], tok, 8, eos_token_id=EOS),
     r"examples\[1\]"),
    (lambda tok: causal_lm_arrays(["abc"], tok, 1, eos_token_id=EOS), "sequence_length"),
    (lambda tok: causal_lm_arrays(["abc"], tok, 8), "eos_token_id"),
    (lambda tok: causal_lm_arrays([("a", "b")], tok, 8, use_chat_template=True),
     "use_chat_template"),
    (lambda tok: causal_lm_arrays(["abc"], tok, 8, eos_token_id=EOS, use_chat_template=True),
     "use_chat_template"),
    (lambda tok: causal_lm_dataset(["abc"], tok, 8, batch_size=0, eos_token_id=EOS),
     "batch_size"),
])
def test_bad_input_names_the_argument(call, argument):
    tok = character_tokenizer("abc", special_tokens=SPECIALS)
    with pytest.raises(ValueError, match=argument):
        call(tok)


def test_a_tokenizer_without_encode_is_a_type_error():
    with pytest.raises(TypeError, match="tokenizer"):
        causal_lm_arrays(["abc"], {"a": 1}, 8, eos_token_id=EOS)
    with pytest.raises(ValueError, match="tokenizer"):
        causal_lm_arrays(["abc"], "no/such/folder", 8, eos_token_id=EOS)
