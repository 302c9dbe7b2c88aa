"""N-D attention (attention over the (H, W) of an image map) exports like the rest.

The TFLite (builtin ops only) and ONNX artifacts are run here with their own
runtimes and compared with keras.layers.MultiHeadAttention holding the same
weights. TensorFlow only (the exporters are).
"""

import keras
import numpy as np
import pytest

from keras_attn import export as kx
from keras_attn import layers as kal
from tests import tolerance


@pytest.fixture(scope="module")
def nd_model_and_peer():
    keras.utils.set_random_seed(3)
    x = keras.Input((4, 5, 8), name="image")
    layer = kal.MultiHeadAttention(num_heads=2, key_dim=4, attention_axes=(1, 2), use_gate=True)
    model = keras.Model(x, layer(x, x))
    peer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, attention_axes=(1, 2), use_gate=True)
    peer.build((None, 4, 5, 8), (None, 4, 5, 8))
    peer.set_weights(layer.get_weights())
    return model, peer


def test_nd_attention_exports_to_tflite_builtins_and_onnx(nd_model_and_peer, tmp_path):
    from ai_edge_litert.interpreter import Interpreter
    import onnxruntime

    model, peer = nd_model_and_peer
    tflite = kx.export_tflite(model, tmp_path / "nd.tflite")
    assert not [op for op in tflite.ops if "FLEX" in op.upper() or op == "CUSTOM"]
    onnx = kx.export_onnx(model, tmp_path / "nd.onnx", opset=17)
    for batch in (1, 3):
        image = np.random.default_rng(batch).standard_normal((batch, 4, 5, 8)).astype("float32")
        want = np.asarray(peer(image, image))

        interpreter = Interpreter(model_path=str(tflite.path))
        detail = interpreter.get_input_details()[0]
        interpreter.resize_tensor_input(detail["index"], image.shape)
        interpreter.allocate_tensors()
        interpreter.set_tensor(detail["index"], image)
        interpreter.invoke()
        got = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])
        tolerance.assert_close(got, want, terms=tolerance.LAYER_TERMS)

        session = onnxruntime.InferenceSession(str(onnx.path), providers=["CPUExecutionProvider"])
        got = session.run(None, {session.get_inputs()[0].name: image})[0]
        tolerance.assert_close(got, want, terms=tolerance.LAYER_TERMS)
