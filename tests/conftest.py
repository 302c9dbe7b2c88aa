"""Shared test set-up: TensorFlow backend, quiet logs, seeds, fixtures."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_and_policy():
    keras.utils.set_random_seed(1234)
    yield
    keras.mixed_precision.set_global_policy("float32")
    # Kernel settings made by a test end with it; the suite as a whole runs
    # with KERAS_ATTN_ATTENTION_IMPLEMENTATION (e.g. =reference) if set.
    import keras_attn.config

    keras_attn.config.set_attention_implementation(None)
    keras_attn.config.set_device_type(None)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
