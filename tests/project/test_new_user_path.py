"""The path a new user takes first, in a fresh interpreter (tests/project/new_user_path.py).

keras_attn is imported before torch and transformers, the order that aborted
in `triton/knobs.py` with torch's CUDA build (see keras_attn/native_libraries.py);
with the torch installed here, whichever it is, the script converts a Llama
saved with `save_pretrained`, generates the greedy tokens of `transformers`,
exports the TFLite generation signatures and generates with them, exports a
Sequential classifier to every format and writes the attention explorer.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
from tests.environments import child_env

pytest.importorskip("transformers")
pytest.importorskip("torch")

from keras_attn import native_libraries  # noqa: E402

SCRIPT = pathlib.Path(__file__).with_name("new_user_path.py")


def test_new_user_path(tmp_path):
    env = child_env(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    line = next(x for x in done.stdout.splitlines() if x.startswith("NEW_USER_PATH "))
    summary = json.loads(line.split(" ", 1)[1])
    assert summary["greedy_equals_transformers"], summary
    assert summary["distinct_generated"] > 3, "degenerate generation tests nothing"
    assert summary["tflite_equals_keras"], summary
    assert list(summary["exports"]) == ["saved_model", "tflite", "onnx"]
    assert [e["check_ids"] for e in summary["exports"].values()] == ["assert", "clamp", "clamp"]
    assert all(e["max_abs_error"] <= 1e-4 for e in summary["exports"].values())
    assert summary["attention_maps"] == 2  # one per decoder layer
    html = (tmp_path / "attention.html").read_text()
    assert "<html" in html.lower() and "t17" in html
    # Triton, when torch brings it, was loaded after TensorFlow through the hook.
    assert summary["triton_loaded"] == (importlib.util.find_spec("triton") is not None)


def test_triton_hook_applies_only_after_tensorflow(monkeypatch):
    finder = native_libraries.install()
    assert native_libraries.install() is finder  # once
    assert sys.meta_path.count(finder) == 1
    assert finder.find_spec("json", None) is None  # other modules: the usual finders
    import tensorflow  # noqa: F401

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert native_libraries.needed() == hasattr(os, "RTLD_DEEPBIND")
    monkeypatch.setenv("LD_PRELOAD", "libtcmalloc.so")  # a preloaded allocator: leave it alone
    assert not native_libraries.needed()
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.delitem(sys.modules, "tensorflow")
    assert not native_libraries.needed()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="torch without triton here")
def test_triton_extension_gets_the_deepbind_loader(monkeypatch):
    import tensorflow  # noqa: F401

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    location = importlib.util.find_spec("triton").submodule_search_locations[0]
    spec = native_libraries.install().find_spec(native_libraries.MODULE,
                                                [os.path.join(location, "_C")])
    assert type(spec.loader).__name__ == "_DeepBindLoader"
