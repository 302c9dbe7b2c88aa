"""The image examples: digits data split, both scripts end to end, exports.

Each example runs once in-process (module-scoped fixtures) and the tests
inspect what it returned and wrote. Numbers are checked against NumPy written
here and against the exported artifacts run by their own runtimes.
"""

import importlib.util
import os

import numpy as np
import pytest

from keras_attn.data import digits as digits_data
from tests import tolerance

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


def _load_example(name):
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", os.path.join(EXAMPLES, f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def classifier_example():
    return _load_example("image_self_attention")


@pytest.fixture(scope="module")
def caption_example():
    return _load_example("attend_and_caption")


@pytest.fixture(scope="module")
def classifier_run(classifier_example, tmp_path_factory):
    out = tmp_path_factory.mktemp("image_self_attention")
    summary = classifier_example.main(
        # 8 epochs: the smallest run measured to learn with the attention block
        # (test accuracy 0.59 with attention, 0.35 without, 0.96 flatten-head CNN;
        # 10 classes). At 2 epochs the attention model was still at chance (0.10).
        ["--epochs", "8", "--seeds", "1", "--width", "16", "--output-dir", str(out)]
    )
    return summary, out


# The smallest caption run measured to learn: reading the strips starts
# abruptly after ~550 steps at the default learning rate (loss 1.55 -> 0.5);
# 2000 x 6 and 4000 x 8 stayed at chance (digit accuracy 0.10-0.12, best
# constant answer 0.12-0.16). 6000 x 10 (50 s of training on 2 cores):
# exact match 0.86, digit accuracy 0.96 (best constant 0.16), gaze 1-2 px from
# the digit being written.
CAPTION_LEARN = ["--train-strips", "6000", "--epochs", "10", "--test-strips", "200"]


@pytest.fixture(scope="module")
def caption_run(caption_example, tmp_path_factory):
    out = tmp_path_factory.mktemp("attend_and_caption")
    summary = caption_example.main([*CAPTION_LEARN, "--output-dir", str(out)])
    return summary, out


# --------------------------------------------------------------------------
# Data


def test_digits_split_is_disjoint_and_complete():
    from sklearn.datasets import load_digits

    split = digits_data.load_digits_split(0.25, seed=0)
    assert not set(split.train_index) & set(split.test_index)
    assert len(split.train_index) + len(split.test_index) == 1797
    raw = load_digits()
    np.testing.assert_allclose(split.x_test, raw.images[split.test_index] / 16.0)
    np.testing.assert_array_equal(split.y_train, raw.target[split.train_index])
    # no test image equals any train image, pixel for pixel
    train_rows = {img.tobytes() for img in split.x_train}
    assert not any(img.tobytes() in train_rows for img in split.x_test)


def test_strips_contain_only_the_digits_they_were_built_from():
    split = digits_data.load_digits_split(0.25, seed=0)
    strips = digits_data.make_strips(split.x_test, split.y_test, 50, seed=3)
    assert strips.images.shape == (50, 10, digits_data.strip_width())
    assert set(strips.lengths) <= {3, 4, 5}
    train_rows = {img.tobytes() for img in split.x_train}
    for i, n in enumerate(strips.lengths):
        assert np.all(strips.sources[i, n:] == -1)
        src = strips.sources[i, :n]
        np.testing.assert_array_equal(strips.labels[i, :n], split.y_test[src])
        centers = strips.centers_x[i, :n]
        assert np.all(np.diff(centers) >= 8)  # side by side, left to right
        for j, k in enumerate(src):
            assert split.x_test[k].tobytes() not in train_rows
            x0 = int(round(centers[j] - 3.5))
            windows = [strips.images[i, y : y + 8, x0 : x0 + 8] for y in range(3)]
            # the canvas is a max of the placed digits: one jitter fits it
            assert any(np.all(w >= split.x_test[k]) for w in windows)
        # every ink pixel of the canvas lies inside some placed digit's columns
        ink_cols = np.nonzero(strips.images[i].max(axis=0))[0]
        inside = np.zeros(strips.images.shape[2], bool)
        for c in centers:
            inside[int(round(c - 3.5)) : int(round(c - 3.5)) + 8] = True
        assert inside[ink_cols].all()


def test_encode_captions_round_trip():
    split = digits_data.load_digits_split(0.25, seed=0)
    strips = digits_data.make_strips(split.x_train, split.y_train, 20, seed=4)
    inputs, targets, weights = digits_data.encode_captions(strips)
    for i, seq in enumerate(strips.sequences()):
        n = len(seq)
        assert inputs[i, 0] == digits_data.START
        assert digits_data.decode_tokens(targets[i]) == [int(d) for d in seq]
        assert targets[i, n] == digits_data.END
        np.testing.assert_array_equal(inputs[i, 1 : n + 1], targets[i, :n])
        assert weights[i].sum() == n + 1


def test_help_and_flags(classifier_example, caption_example, capsys):
    for module in (classifier_example, caption_example):
        with pytest.raises(SystemExit) as info:
            module.parse_args(["--help"])
        assert info.value.code == 0
    text = capsys.readouterr().out
    flags = ("--epochs", "--seeds", "--width", "--train-strips", "--test-strips", "--no-export")
    for flag in flags:
        assert flag in text


# --------------------------------------------------------------------------
# CNN + self-attention classifier


def _onnx_outputs(path, feeds):
    import onnxruntime as ort

    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def _tflite_outputs(path, feeds):
    from ai_edge_litert import interpreter as litert

    runner = litert.Interpreter(model_path=path).get_signature_runner("serving_default")
    return runner(**feeds)


def _saved_model_outputs(path, feeds):
    import tensorflow as tf

    signature = tf.saved_model.load(path).signatures["serving_default"]
    outputs = signature(**{k: tf.constant(v) for k, v in feeds.items()})
    return {k: v.numpy() for k, v in outputs.items()}


def _check_artifacts(model, feeds, paths):
    args = [feeds[t.name] for t in model.inputs]
    want = [np.asarray(y) for y in model(args if len(args) > 1 else args[0], training=False)]
    names = list(model.output_names)
    for fmt, run in (
        ("onnx", _onnx_outputs),
        ("tflite", _tflite_outputs),
        ("saved_model", _saved_model_outputs),
    ):
        got = run(paths[fmt], feeds)
        for name, ref in zip(names, want):
            tolerance.assert_close(got[name], ref, terms=tolerance.LAYER_TERMS, err_msg=f"{fmt} {name}")


def test_classifier_reports_both_accuracies(classifier_run):
    summary, out = classifier_run
    # 10 balanced-ish classes: chance ~0.1.
    assert summary["accuracy_with_attention"] >= 0.3, summary
    assert summary["accuracy_without_attention"] >= 0.2, summary
    assert summary["accuracy_flatten_head_cnn"] >= 0.6, summary
    assert summary["runs"]["with_attention"] and summary["runs"]["without_attention"]
    assert not set(summary["train_index"]) & set(summary["test_index"])
    assert (out / "results.json").exists()


def test_classifier_png_and_attention_rows(classifier_run):
    summary, out = classifier_run
    png = out / "attention.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = summary["model"]
    split = digits_data.load_digits_split(0.25, seed=0)
    _, scores = model(split.x_test[:3, ..., None], training=False)
    scores = np.asarray(scores)
    assert scores.shape == (3, 4, 64, 64)
    tolerance.assert_close(scores.sum(-1), 1.0, terms=tolerance.LAYER_TERMS)


def test_classifier_export_parity(classifier_run):
    summary, out = classifier_run
    errors = summary["export_max_abs_error"]
    assert set(errors) == {"saved_model", "tflite", "onnx"}
    split = digits_data.load_digits_split(0.25, seed=0)
    feeds = {"image": split.x_test[10:16, ..., None]}  # not among the exporter's samples
    paths = {
        "onnx": str(out / "cnn_self_attention.onnx"),
        "tflite": str(out / "cnn_self_attention.tflite"),
        "saved_model": str(out / "saved_model" / "cnn_self_attention" / "1"),
    }
    _check_artifacts(summary["model"], feeds, paths)


# --------------------------------------------------------------------------
# Attend and caption


def test_caption_strips_use_only_their_split(caption_run):
    summary, _ = caption_run
    split, train, test = summary["split"], summary["train"], summary["test"]
    for strips, images, labels in ((train, split.x_train, split.y_train),
                                   (test, split.x_test, split.y_test)):
        for i, n in enumerate(strips.lengths):
            src = strips.sources[i, :n]
            assert np.all((src >= 0) & (src < len(images)))
            np.testing.assert_array_equal(strips.labels[i, :n], labels[src])
    train_rows = {img.tobytes() for img in split.x_train}
    used = np.unique(test.sources[test.sources >= 0])
    assert not any(split.x_test[k].tobytes() in train_rows for k in used)


def test_caption_learned_to_read_left_to_right(caption_run):
    """Digits read right well above the best constant answer, and each step's
    gaze sits on the digit it writes (an untrained model looks at the middle:
    ~10 px away)."""
    summary, _ = caption_run
    test, tokens = summary["test"], summary["tokens"]
    rows, cols = summary["grid"]
    truth = [[int(d) for d in seq] for seq in test.sequences()]
    predicted = [digits_data.decode_tokens(t) for t in tokens]
    right = sum(p[i] == d for p, t in zip(predicted, truth) for i, d in enumerate(t) if i < len(p))
    total = sum(len(t) for t in truth)
    constant = sum(
        np.bincount([t[i] for t in truth if len(t) > i], minlength=10).max() for i in range(5)
    )
    assert summary["digit_accuracy"] == pytest.approx(right / total)
    assert summary["digit_accuracy_best_constant"] == pytest.approx(constant / total)
    assert right / total >= constant / total + 0.4, (right / total, constant / total)
    exact = np.mean([p == t for p, t in zip(predicted, truth)])
    assert summary["exact_match"] == pytest.approx(exact) and exact >= 0.3
    cx = _numpy_centroids(summary["attention_maps"], rows, cols)
    distances = [np.abs(cx[i, :k] - test.centers_x[i, :k]).mean()
                 for i, k in enumerate(min(len(p), len(t)) for p, t in zip(predicted, truth))
                 if k >= 2]
    assert len(distances) >= 100 and np.mean(distances) <= 4.0, np.mean(distances)


def test_caption_reports_and_png(caption_run):
    summary, out = caption_run
    png = out / "caption_attention.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "results.json").exists()


def _numpy_centroids(attention, rows, cols):
    """Feature-map cells are flattened column by column; column c covers
    pixels [4c, 4c + 4) of the strip."""
    per_col = attention.reshape(attention.shape[:-1] + (cols, rows)).sum(axis=-1)
    return (per_col * (np.arange(cols) * 4 + 1.5)).sum(-1) / per_col.sum(-1)


def test_caption_attention_maps_and_centroids(caption_run, caption_example):
    summary, _ = caption_run
    model, test = summary["step_model"], summary["test"]
    rows, cols = summary["grid"]
    assert (rows, cols) == (5, 14)
    inputs, _, _ = digits_data.encode_captions(test)
    _, attention = model([test.images[:8, ..., None], inputs[:8]], training=False)
    attention = np.asarray(attention)
    assert attention.shape == (8, 6, rows * cols)
    tolerance.assert_close(attention.sum(-1), 1.0, terms=tolerance.LAYER_TERMS)
    np.testing.assert_allclose(
        caption_example.centroids_x(attention, (rows, cols)),
        _numpy_centroids(attention, rows, cols),
        rtol=1e-5,
    )
    # all weight on feature-map cell (row 2, column 9): x = 4 * 9 + 1.5
    one_hot = np.zeros(rows * cols, "float32")
    one_hot[9 * rows + 2] = 1.0
    assert caption_example.centroids_x(one_hot[None], (rows, cols))[0] == pytest.approx(37.5)
    # the report's per-step centroids are those of the greedy attention maps
    report = summary["attention"]
    cx = _numpy_centroids(summary["attention_maps"], rows, cols)
    for t, value in enumerate(report["mean_centroid_x_per_step"]):
        rows_used = [
            i for i, n in enumerate(test.lengths)
            if min(n, len(digits_data.decode_tokens(summary["tokens"][i]))) >= max(2, t + 1)
        ]
        if value is None:
            assert not rows_used
        else:
            assert value == pytest.approx(np.mean(cx[rows_used, t]), rel=1e-5)


def test_caption_greedy_decoding_in_onnxruntime(caption_run):
    """The whole greedy loop run on the exported ONNX step model emits the
    same tokens as the example's Keras loop."""
    import onnxruntime as ort

    summary, _ = caption_run
    test = summary["test"]
    session = ort.InferenceSession(
        summary["export_paths"]["onnx"], providers=["CPUExecutionProvider"]
    )
    images = test.images[:10, ..., None]
    prefix = np.full((len(images), 1), digits_data.START, "int32")
    for _ in range(6):
        logits, = session.run(["logits"], {"image": images, "tokens": prefix})
        prefix = np.concatenate([prefix, logits[:, -1].argmax(-1)[:, None].astype("int32")], 1)
    np.testing.assert_array_equal(prefix[:, 1:], summary["tokens"][:10])


def test_caption_export_parity(caption_run):
    summary, _ = caption_run
    errors = summary["export_max_abs_error"]
    assert set(errors) == {"saved_model", "tflite", "onnx"}
    test = summary["test"]
    inputs, _, _ = digits_data.encode_captions(test)
    feeds = {"image": test.images[20:24, ..., None], "tokens": inputs[20:24, :3]}
    _check_artifacts(summary["step_model"], feeds, summary["export_paths"])
