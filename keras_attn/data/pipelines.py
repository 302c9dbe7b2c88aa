"""`tf.data` pipelines: tokenisation, padding/bucketing, shuffle, cache, prefetch.

Two tasks: the dates task (character tokens, encoder-decoder inputs) and
text classification (word tokens from `keras.layers.TextVectorization`).
Every pipeline takes a `batch_size` that is the batch of one input pipeline;
`distributed_input_fn` turns a pipeline factory into the
`input_fn(input_context)` that `strategy.distribute_datasets_from_function`
calls once per worker, with the per-replica batch size and sharding.
"""

import keras
import numpy as np
import tensorflow as tf

from keras_attn import checks
from keras_attn.data import dates

AUTOTUNE = tf.data.AUTOTUNE
PAD_ID = 0
START_TOKEN = "[START]"
PADDING_CHOICES = ("fixed", "batch", "buckets")


class CharTokenizer:
    """Characters <-> ids with a fixed alphabet; id 0 is padding.

    Args:
        alphabet: the known characters (a string).
        special_tokens: tokens placed before the characters (e.g. `[START]`).
        oov: reserve id 1 for unknown characters (after padding).
    """

    def __init__(self, alphabet, special_tokens=(), oov=True):
        if not isinstance(alphabet, str) or not alphabet:
            raise ValueError(
                "Received an invalid value for argument `alphabet`, expected a "
                f"non-empty string. Received: alphabet={alphabet!r}"
            )
        self.alphabet = alphabet
        self.special_tokens = tuple(special_tokens)
        self.vocabulary = list(self.special_tokens) + list(alphabet)
        self.lookup = keras.layers.StringLookup(
            vocabulary=self.vocabulary, mask_token="", num_oov_indices=1 if oov else 0
        )
        # Ids as StringLookup assigns them: "" -> 0, [UNK] -> 1 (if oov), then vocabulary.
        self.id_to_token = (["", "[UNK]"] if oov else [""]) + self.vocabulary
        self.token_to_id = {t: i for i, t in enumerate(self.id_to_token)}

    @property
    def vocabulary_size(self):
        return len(self.id_to_token)

    def __call__(self, text):
        """tf.string scalar or vector -> int32 ids (ragged for a vector)."""
        chars = tf.strings.unicode_split(text, "UTF-8")
        return tf.cast(self.lookup(chars), tf.int32)

    def encode(self, text):
        """A Python string -> list of ids (same ids as the tf path)."""
        unk = self.token_to_id.get("[UNK]", PAD_ID)
        return [self.token_to_id.get(c, unk) for c in text]

    def decode(self, ids):
        """Ids -> string; padding and special tokens are dropped."""
        out = []
        for i in np.asarray(ids).reshape(-1).tolist():
            token = self.id_to_token[i] if 0 <= i < len(self.id_to_token) else ""
            if token and token not in self.special_tokens and token != "[UNK]":
                out.append(token)
        return "".join(out)


def dates_tokenizers():
    """(input tokenizer, target tokenizer) for the dates task.

    Target ids: 0 padding, 1 `[START]`, then `-0123456789`.
    """
    source = CharTokenizer(dates.INPUT_ALPHABET)
    target = CharTokenizer(dates.TARGET_ALPHABET, special_tokens=(START_TOKEN,), oov=False)
    return source, target


def _check_padding(padding):
    if padding not in PADDING_CHOICES:
        raise ValueError(
            "Received an invalid value for argument `padding`, expected one of "
            f"{PADDING_CHOICES}. Received: padding={padding!r}"
        )


def cache_shuffle_repeat(ds, cache, training, shuffle_buffer, seed, repeat):
    """The per-example stage every pipeline shares: cache, seeded reshuffling, repeat."""
    if cache:
        ds = ds.cache()
    if training:
        ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    return ds


def encode_dates(dataset, max_input_length=dates.MAX_INPUT_LENGTH):
    """`{"text", "iso"}` examples -> `({"encoder_inputs", "decoder_inputs"}, targets)`.

    Inputs are truncated to `max_input_length` characters; `decoder_inputs` is
    `[START]` followed by the target shifted right (teacher forcing).
    """
    source, target = dates_tokenizers()
    start_id = target.token_to_id[START_TOKEN]

    def encode(example):
        enc = source(example["text"])[:max_input_length]
        tgt = target(example["iso"])
        dec = tf.concat([[start_id], tgt[:-1]], axis=0)
        return {"encoder_inputs": enc, "decoder_inputs": dec}, tgt

    return dataset.map(encode, num_parallel_calls=AUTOTUNE, deterministic=True)


def batch_and_pad(
    dataset,
    batch_size,
    padding="fixed",
    lengths=None,
    bucket_boundaries=(16, 24, 32),
    drop_remainder=False,
    length_fn=None,
    pad_to_bucket_boundary=False,
):
    """Pads variable-length features into batches.

    Args:
        padding: `"fixed"` pads every feature to `lengths` (one shape: best for
            XLA and export); `"batch"` pads to the longest in the batch;
            `"buckets"` groups examples of similar length
            (`tf.data.Dataset.bucket_by_sequence_length`) to waste less padding.
        lengths: for `"fixed"`, the padded shapes, a structure matching the
            dataset elements (e.g. `({"encoder_inputs": [40], ...}, [10])`).
        length_fn: for `"buckets"`, element -> length to bucket on.
        pad_to_bucket_boundary: for `"buckets"`: False pads each batch to
            its longest element; True pads it to its bucket's boundary, so
            examples of length <= `bucket_boundaries[i]` (and longer than the
            boundary before) are padded to exactly `bucket_boundaries[i]`, and
            the batches take at most `len(bucket_boundaries)` sequence lengths
            (plus smaller last batches unless `drop_remainder`): few shapes to
            trace, and few XLA compilations under `jit_compile=True`
            (`benchmarks/README.md`). Every feature of unknown length is
            padded to the boundary, and an example longer than the last
            boundary raises `InvalidArgumentError` when it is read.
    """
    _check_padding(padding)
    checks.check_batch_size(batch_size)
    if padding == "fixed":
        if lengths is None:
            raise ValueError("`padding='fixed'` needs `lengths` (the padded shapes).")
        return dataset.padded_batch(batch_size, padded_shapes=lengths,
                                    drop_remainder=drop_remainder)
    if padding == "batch":
        return dataset.padded_batch(batch_size, drop_remainder=drop_remainder)
    if length_fn is None:
        raise ValueError("`padding='buckets'` needs `length_fn` (element -> length).")
    boundaries = _check_boundaries(bucket_boundaries)
    if pad_to_bucket_boundary:
        longest = boundaries[-1]

        def check_length(*element):
            tf.debugging.assert_less_equal(
                tf.cast(length_fn(*element), tf.int64),
                tf.constant(longest, tf.int64),
                message=f"an example is longer than the last bucket boundary ({longest}) "
                "and pad_to_bucket_boundary=True cannot pad it",
            )
            return element[0] if len(element) == 1 else element

        dataset = dataset.map(check_length)
        # TensorFlow's buckets are [b_(i-1), b_i) padded to b_i - 1.
        boundaries = [b + 1 for b in boundaries]
    return dataset.bucket_by_sequence_length(
        element_length_func=length_fn,
        bucket_boundaries=boundaries,
        bucket_batch_sizes=[batch_size] * (len(boundaries) + 1),
        pad_to_bucket_boundary=pad_to_bucket_boundary,
        drop_remainder=drop_remainder,
    )


def _check_boundaries(bucket_boundaries):
    boundaries = list(bucket_boundaries)
    if not boundaries or any(
        not isinstance(b, (int, np.integer)) or b < 1 for b in boundaries
    ) or boundaries != sorted(set(boundaries)):
        raise ValueError(
            "Received an invalid value for argument `bucket_boundaries`, expected "
            "strictly increasing positive integers. "
            f"Received: bucket_boundaries={bucket_boundaries!r}"
        )
    return [int(b) for b in boundaries]


def dates_pipeline(
    dataset,
    batch_size,
    training=False,
    padding="fixed",
    max_input_length=dates.MAX_INPUT_LENGTH,
    shuffle_buffer=10_000,
    seed=0,
    cache=True,
    repeat=False,
    drop_remainder=False,
):
    """Tokenise, cache, shuffle (training), pad/batch and prefetch the dates task.

    Output elements: `({"encoder_inputs": (B, T_in), "decoder_inputs": (B, 10)},
    targets (B, 10))`, int32, padding id 0. Shuffling is seeded and
    reshuffles each epoch, so the order is reproducible.
    """
    ds = cache_shuffle_repeat(
        encode_dates(dataset, max_input_length), cache, training, shuffle_buffer, seed, repeat
    )
    lengths = ({"encoder_inputs": [max_input_length],
                "decoder_inputs": [dates.TARGET_LENGTH]}, [dates.TARGET_LENGTH])
    ds = batch_and_pad(
        ds, batch_size, padding=padding, lengths=lengths, drop_remainder=drop_remainder,
        length_fn=lambda x, y: tf.shape(x["encoder_inputs"])[0],
        bucket_boundaries=(12, 20, 28),
    )
    return ds.prefetch(AUTOTUNE)


def dates_arrays(pairs, max_input_length=dates.MAX_INPUT_LENGTH):
    """Python (text, iso) pairs -> NumPy (encoder_inputs, decoder_inputs, targets)."""
    source, target = dates_tokenizers()
    start_id = target.token_to_id[START_TOKEN]
    enc = np.zeros((len(pairs), max_input_length), np.int32)
    dec = np.zeros((len(pairs), dates.TARGET_LENGTH), np.int32)
    tgt = np.zeros((len(pairs), dates.TARGET_LENGTH), np.int32)
    for i, (text, iso) in enumerate(pairs):
        ids = source.encode(text)[:max_input_length]
        enc[i, : len(ids)] = ids
        t = target.encode(iso)
        tgt[i] = t
        dec[i] = [start_id] + t[:-1]
    return enc, dec, tgt


def distributed_input_fn(make_dataset, global_batch_size, shard=True):
    """An `input_fn(input_context)` for `strategy.distribute_datasets_from_function`.

    `make_dataset(batch_size, input_context)` returns the whole stream in
    batches of the per-replica size; with `shard=True` input pipeline `i` of
    `n` keeps batches `i, i+n, i+2n, ...`. The replicas of one step then see,
    together, exactly the examples one replica would see in one batch of
    `global_batch_size` (batches are taken in order), which is what makes
    1-replica and N-replica training comparable. Repeat the stream before
    batching and use `drop_remainder=True` so that every shard is full.

    Args:
        make_dataset: `(batch_size, input_context) -> tf.data.Dataset`.
        global_batch_size: the batch summed over all replicas.
        shard: shard batches by input pipeline (set False when
            `make_dataset` shards its own source, e.g. by file).
    """
    checks.check_batch_size(global_batch_size)

    def input_fn(input_context):
        per_replica = input_context.get_per_replica_batch_size(global_batch_size)
        ds = make_dataset(per_replica, input_context)
        if shard and input_context.num_input_pipelines > 1:
            ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds

    return input_fn
