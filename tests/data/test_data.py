"""keras_attn.data: the human_dates builder and the tf.data pipelines.

Expected values come from Python's `datetime` and NumPy written here, never
from the code under test.
"""

import datetime
import re

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import keras_attn.data as data
from keras_attn.data import dates

MONTH_NUMBER = {}
for _lang, _names in dates.MONTHS.items():
    for _i, _name in enumerate(_names):
        MONTH_NUMBER[_name.lower()] = _i + 1
for _lang, _names in dates.MONTHS_SHORT.items():
    for _i, _name in enumerate(_names):
        MONTH_NUMBER.setdefault(_name.lower(), _i + 1)
        assert MONTH_NUMBER[_name.lower()] == _i + 1, f"ambiguous abbreviation {_name}"


def parse_human_date(text):
    """An independent parser for the documented conventions."""
    t = text.lower()
    words = re.findall(r"[^\W\d_]+", t)
    numbers = [int(n) for n in re.findall(r"\d+", t)]
    month = next((MONTH_NUMBER[w] for w in words if w in MONTH_NUMBER), None)

    def year(y):
        return y if y >= 100 else (1900 + y if y >= 50 else 2000 + y)

    if month is not None:
        day, y = (numbers[0], numbers[1])
        return datetime.date(year(y), month, day)
    if len(numbers) == 1:  # 19990303
        n = str(numbers[0])
        return datetime.date(int(n[:4]), int(n[4:6]), int(n[6:]))
    a, b, c = numbers
    if a > 999:  # year first
        return datetime.date(a, b, c)
    if "/" in t:  # month/day/year
        return datetime.date(year(c), a, b)
    return datetime.date(year(c), b, a)  # day.month.year or day-month-year


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def test_generated_pairs_are_correct_and_cover_formats():
    pairs = dates.generate_examples(3000, seed=5)
    for text, iso in pairs:
        assert parse_human_date(text).isoformat() == iso, text
        assert len(text) <= dates.MAX_INPUT_LENGTH
        assert dates.FIRST_DATE.isoformat() <= iso <= dates.LAST_DATE.isoformat()
    # weekday names are the true weekday
    weekday_names = {w.lower(): i for ws in dates.WEEKDAYS.values() for i, w in enumerate(ws)}
    checked = 0
    for text, iso in pairs:
        first = re.split(r"[ ,]", text)[0].lower()
        if first in weekday_names:
            assert datetime.date.fromisoformat(iso).weekday() == weekday_names[first], text
            checked += 1
    assert checked > 100
    # many formats and all four languages appear
    assert len({re.sub(r"\d", "9", t) for t, _ in pairs}) > 50
    joined = " ".join(t for t, _ in pairs).lower()
    assert all(any(m.lower() in joined for m in dates.MONTHS[lang]) for lang in dates.MONTHS)


def test_generation_is_deterministic_and_seeded():
    assert dates.generate_examples(200, 1) == dates.generate_examples(200, 1)
    assert dates.generate_examples(200, 1) != dates.generate_examples(200, 2)
    splits = dates.generate_splits(500, 100, 100, seed=0)
    held_out = {t for t, _ in splits["test"]} | {t for t, _ in splits["validation"]}
    assert not held_out & {t for t, _ in splits["train"]}


@pytest.mark.parametrize("bad", [-1, 2.5, "10"])
def test_generate_examples_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="num_examples"):
        dates.generate_examples(bad, 0)


def test_tfds_load_after_import_offline(tfds_dir):
    assert "human_dates" in tfds.list_builders()
    ds = tfds.load("human_dates/tiny", data_dir=tfds_dir, split="test")
    got = sorted((x["text"].numpy().decode(), x["iso"].numpy().decode()) for x in ds)
    expected = sorted(dates.generate_splits(1000, 200, 200, seed=0)["test"])
    assert got == expected
    info = tfds.builder("human_dates/tiny", data_dir=tfds_dir).info
    assert {k: v.num_examples for k, v in info.splits.items()} == {
        "train": 1000, "validation": 200, "test": 200}


def test_load_dates_size_knob_and_seed(tfds_dir):
    train, val, test = data.load_dates(num_train=64, num_validation=8, num_test=16, seed=4,
                                       data_dir=tfds_dir)
    assert [len(list(d)) for d in (train, val, test)] == [64, 8, 16]
    expected = dates.generate_splits(64, 8, 16, seed=4)
    got = sorted((x["text"].numpy().decode(), x["iso"].numpy().decode()) for x in train)
    assert got == sorted(expected["train"])
    with pytest.raises(ValueError, match="num_train"):
        data.load_dates(num_train=0, data_dir=tfds_dir)


def _pairs_ds(pairs):
    return tf.data.Dataset.from_tensor_slices(
        {"text": [t for t, _ in pairs], "iso": [i for _, i in pairs]}
    )


def test_dates_pipeline_tokens_match_python_reference():
    pairs = dates.generate_examples(50, 7)
    source, target = data.dates_tokenizers()
    ds = data.dates_pipeline(_pairs_ds(pairs), batch_size=16)
    x, y = next(iter(ds))
    assert x["encoder_inputs"].shape == (16, dates.MAX_INPUT_LENGTH)
    assert x["decoder_inputs"].shape == (16, dates.TARGET_LENGTH)
    # Independent reference: id = 2 + index in the alphabet (0 pad, 1 OOV).
    for row, (text, iso) in zip(x["encoder_inputs"].numpy(), pairs[:16]):
        expected = [2 + dates.INPUT_ALPHABET.index(c) for c in text]
        np.testing.assert_array_equal(row[: len(text)], expected)
        assert not row[len(text):].any()
    for row_in, row_out, (_, iso) in zip(x["decoder_inputs"].numpy(), y.numpy(), pairs[:16]):
        expected = [2 + dates.TARGET_ALPHABET.index(c) for c in iso]  # 0 pad, 1 [START]
        np.testing.assert_array_equal(row_out, expected)
        np.testing.assert_array_equal(row_in, [1] + expected[:-1])
        assert target.decode(row_out) == iso
    enc, dec, tgt = data.dates_arrays(pairs[:16])
    np.testing.assert_array_equal(enc, x["encoder_inputs"].numpy())
    np.testing.assert_array_equal(tgt, y.numpy())
    # unknown characters map to the OOV id 1
    one, space = (2 + dates.INPUT_ALPHABET.index(c) for c in "1 ")
    assert source.encode("1 ♥") == [one, space, 1]
    ids = source(tf.constant("1 ♥")).numpy().tolist()
    assert ids == [one, space, 1]


def test_padding_modes_and_shuffle_reproducible():
    pairs = dates.generate_examples(200, 8)
    per_batch = data.dates_pipeline(_pairs_ds(pairs), batch_size=32, padding="batch")
    for x, _ in per_batch:
        lengths = (x["encoder_inputs"].numpy() != 0).sum(axis=1)
        assert x["encoder_inputs"].shape[1] == lengths.max()
    buckets = data.dates_pipeline(_pairs_ds(pairs), batch_size=16, padding="buckets")
    seen = 0
    for x, _ in buckets:
        width = x["encoder_inputs"].shape[1]
        lengths = (x["encoder_inputs"].numpy() != 0).sum(axis=1)
        # bucket_by_sequence_length groups by boundaries (12, 20, 28).
        bucket = np.searchsorted([12, 20, 28], lengths, side="right")
        assert len(set(bucket)) == 1 and width == lengths.max()
        seen += len(lengths)
    assert seen == 200
    one = [x["encoder_inputs"].numpy() for x, _ in
           data.dates_pipeline(_pairs_ds(pairs), 32, training=True, seed=3)]
    two = [x["encoder_inputs"].numpy() for x, _ in
           data.dates_pipeline(_pairs_ds(pairs), 32, training=True, seed=3)]
    np.testing.assert_array_equal(np.concatenate(one), np.concatenate(two))
    unshuffled = np.concatenate([x["encoder_inputs"].numpy() for x, _ in
                                 data.dates_pipeline(_pairs_ds(pairs), 32)])
    assert not np.array_equal(np.concatenate(one), unshuffled)
    assert sorted(map(tuple, np.concatenate(one))) == sorted(map(tuple, unshuffled))
    with pytest.raises(ValueError, match="padding"):
        data.dates_pipeline(_pairs_ds(pairs), 32, padding="ragged")
    with pytest.raises(ValueError, match="batch_size"):
        data.dates_pipeline(_pairs_ds(pairs), 0)


def test_distributed_input_fn_shards_and_per_replica_batches():
    stream = tf.data.Dataset.range(64)

    def make(batch_size, ctx):
        return stream.batch(batch_size, drop_remainder=True)

    fn = data.distributed_input_fn(make, global_batch_size=8)
    shards = []
    for pipeline in range(2):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=pipeline,
                                         num_replicas_in_sync=2)
        shards.append([b.numpy().tolist() for b in fn(ctx)])
    # per-replica batch 4; pipeline i keeps batches i, i+2, ...; a step's two
    # batches together are exactly one global batch of 8 consecutive examples.
    assert all(len(b) == 4 for s in shards for b in s)
    for step, (a, b) in enumerate(zip(*shards)):
        assert a + b == list(range(8 * step, 8 * step + 8))
    # Under a real strategy with the default context (one pipeline).
    strategy = tf.distribute.get_strategy()
    dist = strategy.distribute_datasets_from_function(fn)
    first = next(iter(dist))
    assert first.numpy().tolist() == list(range(8))


def test_text_classification_generated_labels_and_pipeline():
    pairs = data.generate_reviews(400, seed=2)
    assert data.generate_reviews(400, seed=2) == pairs
    pos = {w for w in data.text.POSITIVE}
    neg = {w for w in data.text.NEGATIVE}

    def reference_label(text):  # the clause after "but" decides; "not" flips
        clause = text.split(", but ")[-1].rstrip(".").split()
        word = clause[-1]
        positive = word in pos
        assert positive or word in neg
        return int(positive != ("not" in clause))

    for text, label in pairs:
        assert label == reference_label(text), text
    assert 0.35 < np.mean([y for _, y in pairs]) < 0.65
    train, test, source = data.load_text_classification(None, num_train=100, num_test=20)
    assert source == "generated" and len(list(train)) == 100 and len(list(test)) == 20
    vec = data.make_vectorizer([t for t, _ in pairs], max_tokens=200, sequence_length=16)
    vocab = vec.get_vocabulary()
    assert vocab[:2] == ["", "[UNK]"] and "but" in vocab
    ds = data.text_classification_pipeline(train, vec, batch_size=32)
    x, y = next(iter(ds))
    assert x.shape == (32, 16) and x.dtype == tf.int64 and y.shape == (32,)
    text0 = next(iter(train))[0].numpy().decode()
    words = re.sub(r"[^\w\s]", " ", text0.lower()).split()
    np.testing.assert_array_equal(x[0].numpy()[: len(words)], [vocab.index(w) for w in words])


def test_text_classification_falls_back_with_message(capsys):
    train, _, source = data.load_text_classification(
        "no_such_dataset_for_keras_attn", num_train=10, num_test=5
    )
    assert source == "generated" and len(list(train)) == 10
    assert "falling back to the offline generated reviews" in capsys.readouterr().out


def _ragged_ids(lengths):
    rows = [np.arange(1, n + 1, dtype=np.int32) for n in lengths]
    labels = np.arange(len(lengths), dtype=np.int32)
    ds = tf.data.Dataset.from_generator(
        lambda: zip(rows, labels),
        output_signature=(tf.TensorSpec((None,), tf.int32), tf.TensorSpec((), tf.int32)),
    )
    return ds


def test_buckets_padded_to_their_boundary():
    """pad_to_bucket_boundary: every batch is exactly one boundary wide, rows kept whole."""
    lengths = np.random.default_rng(0).integers(1, 41, size=150)
    boundaries = (8, 16, 40)
    ds = data.batch_and_pad(
        _ragged_ids(lengths), 16, padding="buckets", bucket_boundaries=boundaries,
        length_fn=lambda x, y: tf.shape(x)[0], pad_to_bucket_boundary=True,
    )
    seen = {}
    for x, y in ds:
        x, y = x.numpy(), y.numpy()
        width = x.shape[1]
        assert width in boundaries
        lower = ([0] + list(boundaries))[boundaries.index(width)]
        for row, label in zip(x, y):
            n = lengths[label]
            assert lower < n <= width
            np.testing.assert_array_equal(row, np.r_[np.arange(1, n + 1), np.zeros(width - n)])
            seen[int(label)] = True
    assert len(seen) == len(lengths)


def test_buckets_longer_than_last_boundary_fail_loudly():
    ds = data.batch_and_pad(
        _ragged_ids([3, 30]), 4, padding="buckets", bucket_boundaries=(8, 16),
        length_fn=lambda x, y: tf.shape(x)[0], pad_to_bucket_boundary=True,
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match="last bucket boundary"):
        list(ds)


@pytest.mark.parametrize("boundaries", [(), (16, 8), (8, 8), (0, 4), (4.5,)])
def test_bucket_boundaries_validated(boundaries):
    with pytest.raises(ValueError, match="bucket_boundaries"):
        data.batch_and_pad(
            _ragged_ids([3]), 4, padding="buckets", bucket_boundaries=boundaries,
            length_fn=lambda x, y: tf.shape(x)[0],
        )
