"""examples/translate_dates_mobile.py end to end, at a scale where it learns.

Checked: the model learned (character accuracy of Keras cached greedy well
above the best constant answer), and the TFLite model decoded by the NumPy +
ai_edge_litert loop (and the ONNX models by NumPy + onnxruntime) give Keras
cached greedy's tokens, token for token, with the TFLite loop running in a
process that never imports TensorFlow, Keras or keras_attn.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.environments import child_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "translate_dates_mobile.py"
# The smallest scale measured to learn (see test_examples.DATES_LEARN): the
# script's own model sizes, GQA on, fewer pairs and epochs than its defaults.
LEARN = ["--num-train", "6000", "--num-test", "62", "--epochs", "3",
         "--num-key-value-heads", "2", "--verbose", "0",
         # 62 test rows in static batches of 4: the last chunk is padded.
         "--tflite-batch-size", "4"]

pytestmark = pytest.mark.slow


def _env():
    return child_env(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")


def _run(args, cwd, timeout=600):
    result = subprocess.run(args, cwd=str(cwd), env=_env(), capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def mobile_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mobile")
    stdout = _run([sys.executable, str(SCRIPT), *LEARN, "--output-dir", str(out / "outputs"),
                   "--data-dir", str(out / "tfds")], out)
    return out / "outputs", stdout


def test_help():
    stdout = _run([sys.executable, str(SCRIPT), "--help"], ROOT, timeout=60)
    assert "--tflite-batch-size" in stdout and "--no-onnx" in stdout


def test_tflite_and_onnx_tokens_equal_keras_greedy(mobile_run):
    out, stdout = mobile_run
    tokens = np.load(out / "mobile_tokens.npz")
    keras_tokens = tokens["keras"]
    assert keras_tokens.shape == (62, 11)
    assert (keras_tokens[:, 0] == 1).all()  # [START]
    np.testing.assert_array_equal(tokens["tflite"], keras_tokens)
    np.testing.assert_array_equal(tokens["onnx"], keras_tokens)
    summary = json.loads((out / "mobile_summary.json").read_text())
    assert summary["tflite_sequence_agreement"] == 1.0
    assert summary["onnx_sequence_agreement"] == 1.0
    assert "TFLite alone vs Keras greedy: 1.0000 of sequences" in stdout
    assert os.path.getsize(out / "dates_prefill_decode.tflite") > 0


def test_keras_greedy_learned_well_above_chance(mobile_run):
    out, stdout = mobile_run
    tokens = np.load(out / "mobile_tokens.npz")
    predicted, targets = tokens["keras"][:, 1:], tokens["targets"]
    assert predicted.shape == targets.shape == (62, 10)
    char_accuracy = float(np.mean(predicted == targets))
    # Always answering each position's most frequent character.
    baseline = float(np.mean([np.mean(targets[:, i] == np.bincount(targets[:, i]).argmax())
                              for i in range(targets.shape[1])]))
    assert char_accuracy >= baseline + 0.1 and char_accuracy >= 0.55, (char_accuracy, baseline)
    exact = float(np.mean(np.all(predicted == targets, axis=1)))
    assert f"test exact match {exact:.4f}" in stdout


def test_tflite_loop_needs_no_tensorflow_keras_or_keras_attn(mobile_run, tmp_path):
    out, _ = mobile_run
    code = f"""
import sys
import numpy as np
sys.path.insert(0, {str(SCRIPT.parent)!r})
from translate_dates_mobile import tflite_greedy
data = np.load({str(out / "mobile_tokens.npz")!r})
tokens = tflite_greedy({str(out / "dates_prefill_decode.tflite")!r}, data["encoder_ids"], 1, 11)
np.save({str(tmp_path / "tokens.npy")!r}, tokens)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras", "keras_attn"))
assert not heavy, heavy
"""
    _run([sys.executable, "-c", code], tmp_path, timeout=60)
    keras_tokens = np.load(out / "mobile_tokens.npz")["keras"]
    np.testing.assert_array_equal(np.load(tmp_path / "tokens.npy"), keras_tokens)
