"""The runtime writers' old paths under `keras_attn.generation` still work for one
release: importing one warns (DeprecationWarning naming the new module, at the
importing line) and every name the old module had is the new module's object."""

import importlib
import sys
import warnings

import pytest

pytest.importorskip("tensorflow")

# Old module -> (the module the warning names, the names the old module had).
MOVED = {
    "keras_attn.generation.export": ("keras_attn.runtimes.signatures", (
        "SERVING_SAVE_OPTIONS", "rename_value", "cache_lib", "request_checks", "search",
        "export_onnx_genai", "export_litertlm", "greedy_loop", "cache_storage_dtype",
        "signatures_to_tflite", "signature_functions", "export_saved_model", "tflite_bytes",
        "export_tflite", "onnx_models", "export_onnx")),
    "keras_attn.generation.litertlm": ("keras_attn.runtimes.litertlm", (
        "check_runtime_decoder", "write_tokenizer", "GENERATION_QUANTIZATIONS",
        "cache_storage_dtype", "signatures_to_tflite", "RUNTIME", "SEQUENCE_AXIS",
        "DEFAULT_PREFILL_LENGTHS", "FLOAT32_RTOL", "DEFAULT_MIN_AGREEMENT",
        "litertlm_functions", "litertlm_tflite", "executor_metadata", "llm_metadata",
        "LitertLmReport", "runtime_logits", "export_litertlm", "generate")),
    "keras_attn.generation.onnx_genai": ("keras_attn.runtimes.onnx_genai", (
        "rename_value", "check_runtime_decoder", "genai_function", "onnx_genai_model",
        "genai_config", "write_tokenizer", "export_onnx_genai")),
    "keras_attn.generation.tflite_convert": ("keras_attn.runtimes.tflite_convert", (
        "SERVING_SAVE_OPTIONS", "GENERATION_QUANTIZATIONS", "CACHE_DTYPES",
        "cache_storage_dtype", "signatures_to_tflite")),
    "keras_attn.generation.runtime_loop": ("keras_attn.runtimes.loop", ("search", "greedy_loop")),
    "keras_attn.generation.request_checks": ("keras_attn.runtimes.request_checks",
                                             ("CHECKS", "Checks")),
    "keras_attn.generation.tokenizers": ("keras_attn.runtimes.tokenizers",
                                         ("character_tokenizer", "word_tokenizer")),
}
RUNTIMES = ("signatures", "litertlm", "onnx_genai", "tflite_convert", "trace", "loop",
            "request_checks", "tokenizers")


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


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_warns_and_names_the_new_one(old):
    new, _ = MOVED[old]
    _, caught = _fresh_import(old)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)
                    and old in str(w.message)]
    assert len(deprecations) == 1, [str(w.message) for w in caught]
    assert f"`{new}`" in str(deprecations[0].message)
    assert "next release" in str(deprecations[0].message)
    # Attributed to the line that imports the old path, not to the alias module.
    assert deprecations[0].filename == __file__


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_gives_the_new_objects(old):
    module, _ = _fresh_import(old)
    homes = [importlib.import_module(f"keras_attn.runtimes.{name}") for name in RUNTIMES]
    for name in MOVED[old][1]:
        value = getattr(module, name)
        assert any(getattr(home, name, None) is value for home in homes), (old, name)
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name


def test_from_imports_of_the_old_paths_still_work():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from keras_attn.generation.export import export_litertlm, tflite_bytes
        from keras_attn.generation.tokenizers import character_tokenizer

    import keras_attn.runtimes as runtimes

    assert export_litertlm is runtimes.export_litertlm
    assert tflite_bytes is runtimes.tflite_bytes
    assert character_tokenizer is runtimes.character_tokenizer
    namespace = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec("from keras_attn.generation.litertlm import *", namespace)  # noqa: S102
    assert namespace["export_litertlm"] is runtimes.export_litertlm
