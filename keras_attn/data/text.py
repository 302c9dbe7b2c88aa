"""Text classification data: an offline generated review set, optional tfds sets.

`generate_reviews` writes short movie reviews whose label needs context, not
just a bag of words: a negation flips the adjective after it ("not good"),
and in "X, but Y" the clause after "but" decides. `load_text_classification`
returns a real tfds data set (e.g. `imdb_reviews`) when the machine can get
it and falls back to the generated one otherwise, saying so.
"""

import random

import keras
import numpy as np
import tensorflow as tf

from keras_attn import checks
from keras_attn.data.pipelines import AUTOTUNE, cache_shuffle_repeat

POSITIVE = ["good", "great", "wonderful", "moving", "brilliant", "funny", "superb", "charming"]
NEGATIVE = ["bad", "boring", "awful", "dull", "terrible", "weak", "clumsy", "tedious"]
SUBJECTS = ["the plot", "the acting", "the music", "the ending", "the script", "the film",
            "the cast", "the dialogue", "the pacing", "the camera work"]
VERBS = ["was", "is", "felt", "seemed"]
ADVERBS = ["", "", "really ", "truly ", "quite ", "very "]
FILLERS = ["", "", "i saw it last week. ", "my friends liked the trailer. ",
           "it is two hours long. ", "we went on a rainy day. "]


def _clause(rng):
    positive = rng.random() < 0.5
    negated = rng.random() < 0.35
    word = rng.choice(POSITIVE if positive != negated else NEGATIVE)
    text = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {'not ' if negated else ''}"
    return text + rng.choice(ADVERBS) + word, positive


def generate_reviews(num_examples, seed=0):
    """`num_examples` (text, label) pairs, label 1 = positive; deterministic from `seed`."""
    if not isinstance(num_examples, int) or num_examples < 0:
        raise ValueError(
            "Received an invalid value for argument `num_examples`, expected a "
            f"non-negative integer. Received: num_examples={num_examples!r}"
        )
    rng = random.Random(seed)
    out = []
    for _ in range(num_examples):
        text, label = _clause(rng)
        if rng.random() < 0.5:
            second, label = _clause(rng)
            text = f"{text}, but {second}"
        out.append((rng.choice(FILLERS) + text + ".", int(label)))
    return out


def _generated(num_train, num_test, seed):
    def to_ds(pairs):
        return tf.data.Dataset.from_tensor_slices(
            ([t for t, _ in pairs], np.array([y for _, y in pairs], np.int32))
        )

    return to_ds(generate_reviews(num_train, seed)), to_ds(generate_reviews(num_test, seed + 1))


def load_text_classification(name=None, num_train=8000, num_test=1000, seed=0, data_dir=None):
    """`(train, test, source)` of `(text, label)` pairs.

    With `name` (a tfds data set with `train`/`test` splits and
    `as_supervised` support, e.g. `imdb_reviews`) the real data set is tried
    first; if it cannot be loaded (no network, unknown name) the generated
    reviews are returned and `source` says why.
    """
    if name:
        try:
            import tensorflow_datasets as tfds

            train, test = tfds.load(
                name, split=["train", "test"], as_supervised=True, data_dir=data_dir
            )
            take = lambda ds, n: ds.take(n) if n else ds  # noqa: E731
            return (take(train, num_train), take(test, num_test), f"tfds:{name}")
        except Exception as error:  # network, DNS, unknown name: all fall back
            message = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
            print(
                f"Could not load tfds data set {name!r} ({type(error).__name__}: {message}); "
                "falling back to the offline generated reviews."
            )
    train, test = _generated(num_train, num_test, seed)
    return train, test, "generated"


def make_vectorizer(texts, max_tokens=2000, sequence_length=32):
    """A `TextVectorization` layer (lower-case, punctuation stripped) for `texts`.

    The vocabulary is counted here in Python and ordered by (-count, word), so
    it is the same on every run and every worker (ties never depend on
    hashing). `texts`: an iterable of Python strings or a dataset of strings.
    """
    import collections
    import re

    if isinstance(texts, tf.data.Dataset):
        texts = (t.decode("utf-8") for t in texts.as_numpy_iterator())
    counts = collections.Counter()
    for text in texts:
        counts.update(re.sub(r"[^\w\s]", " ", text.lower()).split())
    vocabulary = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    layer = keras.layers.TextVectorization(
        max_tokens=max_tokens, output_sequence_length=sequence_length,
        vocabulary=vocabulary[: max_tokens - 2],
    )
    return layer


def text_classification_pipeline(
    dataset, vectorizer, batch_size, training=False, shuffle_buffer=10_000, seed=0,
    cache=True, repeat=False, drop_remainder=False,
):
    """`(text, label)` -> batches of `(token_ids (B, T), label (B,))`, prefetched.

    Raw strings are batched first and vectorised a batch at a time (one
    `TextVectorization` call per batch is much faster than one per example).
    """
    checks.check_batch_size(batch_size)
    ds = cache_shuffle_repeat(dataset, cache, training, shuffle_buffer, seed, repeat)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    ds = ds.map(lambda x, y: (vectorizer(x), y), num_parallel_calls=AUTOTUNE,
                deterministic=True)
    return ds.prefetch(AUTOTUNE)
