"""On JAX and torch, building, converting and fine-tuning a model does not load
TensorFlow: its libraries cost about 0.45 GB of resident memory (measured by
benchmarks/bench_finetune.py's `loaded` column), which a fine-tune at real size
pays beside the model's weights. The TensorFlow-only parts (searches, Trainer,
exports) load it when first used."""

import subprocess
import sys

import pytest

from tests.environments import child_env

TRAINING_PATH = """
import sys
import keras_attn
from keras_attn.convert import from_huggingface, save_peft_adapter
from keras_attn.generation import CausalLMLoss, DecoderOnlyLM
from keras_attn.training import FitCheckpoint
print(sorted(m for m in ("tensorflow", "tf_keras") if m in sys.modules))
from keras_attn.generation import greedy_search
from keras_attn.training import Trainer
print("tensorflow" in sys.modules, greedy_search.__name__, Trainer.__name__)
"""


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_training_path_leaves_tensorflow_unloaded(backend):
    done = subprocess.run([sys.executable, "-c", TRAINING_PATH], capture_output=True, text=True, check=False,
                          timeout=300, env=child_env(KERAS_BACKEND=backend))
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = done.stdout.strip().splitlines()[-2:]
    assert before == "[]"
    # The lazy names still resolve (and then load TensorFlow).
    assert after == "True greedy_search Trainer"
