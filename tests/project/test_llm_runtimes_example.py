"""examples/llm_runtimes.py end to end: a converted Llama from text to tokens
in ONNX Runtime GenAI and LiteRT-LM, equal to Keras's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.environments import child_env

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai")
pytest.importorskip("litert_lm")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "llm_runtimes.py"

pytestmark = pytest.mark.slow


def test_runtimes_generate_the_keras_tokens(tmp_path):
    env = child_env(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, str(SCRIPT), "--output-dir", str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["keras"]) >= 10  # a generation long enough to compare
    genai = summary["runtimes"]["onnxruntime_genai"]
    assert genai["equal"] and genai["tokens"] == summary["keras"]
    assert (tmp_path / "onnx_genai" / "genai_config.json").exists()
    litert = summary["runtimes"]["litert_lm"]
    assert litert["equal"] and len(litert["text"]) > 0
    assert (tmp_path / "model.litertlm").exists()
