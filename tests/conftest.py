"""Shared test set-up: the Keras backend, quiet logs, seeds, fixtures.

The backend is `KERAS_BACKEND` (TensorFlow when unset). `.ci/run` runs the
whole suite on TensorFlow, then the backend-agnostic files below on JAX and
torch. On a backend other than TensorFlow the other files are not collected
(the run's summary lists them) and tests marked `tensorflow_only` (they use
`tf.function`, `tf.GradientTape`, SavedModel... on purpose) are skipped.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Layers, blocks and ops: keras.ops only, so they must pass on every backend.
# Training, export, generation and data are TensorFlow by design
# (docs/architecture.md).
BACKEND_AGNOSTIC_FILES = {
    "test_attention_layers.py",
    "test_blocks.py",
    "test_cache_masks.py",
    "test_convert_streaming.py",
    "test_errors.py",
    "test_family_options.py",
    "test_gemma4_options.py",
    "test_mha_keras_compat.py",
    "test_onnx_decoder.py",
    "test_onnx_signatures.py",
    "test_ops.py",
    "test_peers.py",
    "test_position_layers.py",
    "test_serialization.py",
    "test_upstream_suites.py",
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "tensorflow_only: uses TensorFlow APIs directly; runs on the TensorFlow backend only"
    )


_NOT_COLLECTED = []


def pytest_ignore_collect(collection_path, config):
    # Other backends: TensorFlow-only files are not even imported (they
    # import TensorFlow, datasets, exporters); the summary lists them.
    if keras.backend.backend() == "tensorflow" or collection_path.is_dir():
        return None
    name = collection_path.name
    if name.startswith("test_") and name.endswith(".py") and name not in BACKEND_AGNOSTIC_FILES:
        _NOT_COLLECTED.append(name)
        return True
    return None


def pytest_report_header(config):
    return f"keras backend: {keras.backend.backend()}, KERAS_ATTN_TEST_SEED={SEED}"


def pytest_terminal_summary(terminalreporter):
    if _NOT_COLLECTED:
        terminalreporter.write_line(
            f"TensorFlow-only test files not run on backend {keras.backend.backend()} "
            f"(run them with KERAS_BACKEND=tensorflow): {', '.join(sorted(_NOT_COLLECTED))}"
        )


def pytest_collection_modifyitems(config, items):
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return
    marked = pytest.mark.skip(reason=f"tensorflow_only test; backend is {backend}")
    for item in items:
        if item.get_closest_marker("tensorflow_only"):
            item.add_marker(marked)


# KERAS_ATTN_TEST_SEED shifts every random fixture (`rng`, Keras's seed), so
# that tolerances are checked on other draws than the usual ones (`.ci/run`
# runs the numeric files once with another seed).
SEED = int(os.environ.get("KERAS_ATTN_TEST_SEED", "0"))


@pytest.fixture(autouse=True)
def _seed_and_policy():
    keras.utils.set_random_seed(1234 + SEED)
    if keras.backend.backend() == "torch":
        # Tests read outputs with `np.asarray`, which torch refuses for
        # tensors that track gradients. No agnostic test differentiates.
        import torch

        with torch.no_grad():
            yield
    else:
        yield
    keras.mixed_precision.set_global_policy("float32")
    # Kernel settings made by a test end with it; the suite as a whole runs
    # with KERAS_ATTN_ATTENTION_IMPLEMENTATION (e.g. =reference) if set.
    import keras_attn.config

    keras_attn.config.set_attention_implementation(None)
    keras_attn.config.set_device_type(None)


@pytest.fixture
def rng():
    return np.random.default_rng(SEED)
