"""A causal-LM LoRA fine-tune (`causal_lm_dataset` + `model.fit`) trains the
same across two devices as on one: TensorFlow's `MirroredStrategy` on two
logical CPU devices, JAX's `DataParallel` on two XLA host devices, and JAX's
`ModelParallel` with `DecoderOnlyLM.get_layout_map` (heads, feed-forward
features and vocabulary split over two devices; the LoRA factors, which the
layout map does not name, replicated).

Each run is `tests/training/lm_fit_child.py` in a fresh interpreter (device
splits must precede the backend's initialisation). The one-device run of the
same backend is the reference: the same global batches, gradients summed in
another order, so SGD weights agree within a few float32 ulps per step.
"""

import numpy as np
import pytest

from tests import tolerance
from tests.training import lm_fit_child
from tests.training.lm_fit_child import STEPS

pytestmark = pytest.mark.slow


def fit(backend, out, *args, devices=1):
    result = lm_fit_child.run(out, backend, *args, devices=devices)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return lm_fit_child.load(out)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The one-device run of each backend, shared by the tests that compare with it."""
    runs = {}

    def get(backend):
        if backend not in runs:
            runs[backend] = fit(backend, tmp_path_factory.mktemp("one") / f"{backend}.npz")
        return runs[backend]

    return get


def assert_trains_as_one(one, two):
    (one_weights, one_losses), (two_weights, two_losses) = one, two
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


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_two_devices_train_as_one(backend, one_device, tmp_path):
    assert_trains_as_one(one_device(backend), fit(backend, tmp_path / "two.npz", devices=2))


def test_jax_model_parallel_trains_as_one(one_device, tmp_path):
    assert_trains_as_one(one_device("jax"),
                         fit("jax", tmp_path / "mp.npz", "--model-parallel", devices=2))
