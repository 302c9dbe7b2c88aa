"""0.2.0's `keras_attn.generation.export` still works for one release: importing
it warns (DeprecationWarning naming `keras_attn.runtimes.signatures`, at the
importing line) and every name it had is the new module's object. The other old
paths were never released and are gone."""

import importlib
import sys
import warnings

import pytest

pytest.importorskip("tensorflow")

OLD = "keras_attn.generation.export"
# The names 0.2.0's module had.
NAMES = ("SERVING_SAVE_OPTIONS", "cache_lib", "search", "signature_functions", "export_saved_model",
         "tflite_bytes", "export_tflite", "onnx_models", "export_onnx", "greedy_loop")


def _fresh_import(name):
    """Imports `name` anew (the warning is raised once per import) and returns it
    with the warnings it raised."""
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    if hasattr(sys.modules.get(parent), child):
        delattr(sys.modules[parent], child)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        __import__(name)  # the importing line the warning names
    return sys.modules[name], caught


def test_old_path_warns_and_names_the_new_one():
    _, caught = _fresh_import(OLD)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)
                    and OLD in str(w.message)]
    assert len(deprecations) == 1, [str(w.message) for w in caught]
    assert "`keras_attn.runtimes.signatures`" in str(deprecations[0].message)
    assert "next release" in str(deprecations[0].message)
    # Attributed to the line that imports the old path, not to the alias module.
    assert deprecations[0].filename == __file__


def test_old_path_gives_the_new_objects():
    module, _ = _fresh_import(OLD)
    signatures = importlib.import_module("keras_attn.runtimes.signatures")
    for name in NAMES:
        assert getattr(module, name) is getattr(signatures, name), name
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name
    namespace = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec(f"from {OLD} import *", namespace)  # noqa: S102
    assert namespace["tflite_bytes"] is signatures.tflite_bytes


@pytest.mark.parametrize("gone", ["litertlm", "onnx_genai", "tflite_convert", "runtime_loop",
                                  "request_checks", "tokenizers"])
def test_unreleased_old_paths_are_gone(gone):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"keras_attn.generation.{gone}")
