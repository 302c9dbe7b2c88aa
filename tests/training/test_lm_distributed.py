"""A causal-LM LoRA fine-tune (`causal_lm_dataset` + `model.fit`) trains the
same across two devices as on one: TensorFlow's `MirroredStrategy` on two
logical CPU devices and JAX's `DataParallel` on two XLA host devices.

Each run is `tests/training/lm_fit_child.py` in a fresh interpreter (device
splits must precede the backend's initialisation). The one-device run of the
same backend is the reference: the same global batches, gradients summed in
another order, so SGD weights agree within a few float32 ulps per step.
"""

import subprocess
import sys

import numpy as np
import pytest

from tests import tolerance
from tests.environments import ROOT, child_env
from tests.training.lm_fit_child import STEPS

pytestmark = pytest.mark.slow


def fit(backend, devices, out):
    env = child_env(KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
                    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                    CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-m", "tests.training.lm_fit_child", str(out), "--devices", str(devices)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    with np.load(out) as f:
        names = list(f["names"])
        return dict(zip(names, (f[f"w{i}"] for i in range(len(names))))), f["losses"]


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_two_devices_train_as_one(backend, tmp_path):
    one_weights, one_losses = fit(backend, 1, tmp_path / "one.npz")
    two_weights, two_losses = fit(backend, 2, tmp_path / "two.npz")
    assert len(one_losses) == STEPS
    assert sorted(two_weights) == sorted(one_weights)
    # B starts at zero: every adapter moved, so the runs compared are not
    # both still at their initialisation.
    moved = {name: float(np.abs(w).max()) for name, w in one_weights.items() if "lora_kernel_b" in name}
    assert moved and min(moved.values()) > 0, moved
    names = sorted(one_weights)
    tolerance.assert_all_close([two_weights[n] for n in names], [one_weights[n] for n in names],
                               ulps=4 * STEPS, err_msg="weights")
    tolerance.assert_close(two_losses, one_losses, terms=STEPS, err_msg="losses")
