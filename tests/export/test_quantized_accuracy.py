"""Quantised TFLite models of a trained classifier keep its accuracy within a few points."""

import numpy as np
import pytest

from keras_attn.export import export_tflite
from tests import model_zoo
from tests.training.test_training_core import _majority_dataset

LENGTH = 28


def _padded(ds):
    xs, ys = [], []
    for x, y in ds.as_numpy_iterator():
        xs.append(np.pad(x, (0, LENGTH - len(x))))
        ys.append(y)
    return np.stack(xs).astype("int32"), np.array(ys)


@pytest.fixture(scope="module")
def trained():
    import keras

    keras.utils.set_random_seed(0)
    train, _ = _majority_dataset(2000, 0)
    test, _ = _majority_dataset(300, 1)
    # Big enough that every weight matrix is quantised (LiteRT skips tensors < 1024 elements).
    model = model_zoo.encoder_classifier(num_classes=3, dim=64, intermediate_dim=128)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="sparse_categorical_crossentropy")
    model.fit(train.shuffle(2000, seed=0).padded_batch(32), epochs=6, verbose=0)
    x_test, y_test = _padded(test)
    x_train, _ = _padded(train.take(64))
    return model, x_test, y_test, x_train


def _tflite_accuracy(path, x, y):
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path))
    detail = interpreter.get_input_details()[0]
    interpreter.resize_tensor_input(detail["index"], list(x.shape))
    interpreter.allocate_tensors()
    interpreter.set_tensor(detail["index"], x)
    interpreter.invoke()
    probs = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])
    return float((probs.argmax(-1) == y).mean())


@pytest.mark.slow
def test_quantised_accuracy_within_a_few_points(trained, tmp_path):
    model, x_test, y_test, x_train = trained
    keras_accuracy = float((np.asarray(model(x_test)).argmax(-1) == y_test).mean())
    assert keras_accuracy > 0.8
    representative = [x_train[i : i + 1] for i in range(len(x_train))]
    sizes, accuracies = {}, {}
    for quantization in (None, "float16", "dynamic", "int8"):
        path = tmp_path / f"{quantization}.tflite"
        report = export_tflite(
            model,
            path,
            quantization=quantization,
            representative_dataset=representative if quantization == "int8" else None,
            sample_inputs=x_test[:8],
        )
        sizes[quantization] = report.size_bytes
        accuracies[quantization] = _tflite_accuracy(path, x_test, y_test)
    print("keras accuracy", keras_accuracy, "tflite", accuracies, "sizes", sizes)
    assert accuracies[None] == pytest.approx(keras_accuracy, abs=1e-9)
    for quantization in ("float16", "dynamic", "int8"):
        assert accuracies[quantization] >= keras_accuracy - 0.05, (quantization, accuracies)
    for quantization in ("float16", "dynamic", "int8"):
        assert sizes[quantization] < 0.75 * sizes[None], sizes
