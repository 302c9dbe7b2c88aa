"""A LoRA fine-tune with `model.fit` and `keras_attn.training.FitCheckpoint`,
SIGKILLed mid-epoch and restarted, ends where an uninterrupted run ends.

Each run is `tests/training/lm_fit_child.py` in a fresh interpreter: Adam
(whose moments must come back with the weights), LoRA dropout (whose RNG
states must too), a checkpoint every epoch of 3 steps, and a process that
kills itself with SIGKILL after step 8, two steps into its third epoch. The
restart redoes that epoch from the checkpoint of step 6 on the batches an
uninterrupted run trains on there (`data.skip(checkpoint.step)`).
"""

import signal

import keras
import numpy as np
import pytest

from keras_attn.generation import DecoderOnlyLM
from keras_attn.training import FitCheckpoint
from tests import tolerance
from tests.training import lm_fit_child
from tests.training.lm_fit_child import STEPS

STEPS_PER_EPOCH = 3
KILL_AT = 8
ARGS = ("--optimizer", "adam", "--lora-dropout", "0.1", "--steps-per-epoch", STEPS_PER_EPOCH)


def read_log(path):
    """`{epoch: loss}` of the epochs a run finished."""
    losses = {}
    for line in path.read_text().splitlines():
        epoch, loss = line.split()
        assert int(epoch) not in losses, f"epoch {epoch} finished twice"
        losses[int(epoch)] = float(loss)
    return losses


def child(backend, out, *args, returncode=0):
    result = lm_fit_child.run(out, backend, *ARGS, *args)
    assert result.returncode == returncode, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_killed_fit_resumes_as_uninterrupted(backend, tmp_path):
    child(backend, tmp_path / "full.npz", "--log", tmp_path / "full.log")
    want_weights, want_losses = lm_fit_child.load(tmp_path / "full.npz")

    ckpt, log = tmp_path / "ckpt", tmp_path / "killed.log"
    child(backend, tmp_path / "killed.npz", "--checkpoint-dir", ckpt, "--log", log,
          "--kill-at-step", KILL_AT, returncode=-signal.SIGKILL)
    # Killed mid-epoch: the epochs before the kill finished and were checkpointed.
    done = KILL_AT // STEPS_PER_EPOCH
    assert sorted(read_log(log)) == list(range(done))
    assert FitCheckpoint(ckpt).step == done * STEPS_PER_EPOCH

    child(backend, tmp_path / "resumed.npz", "--checkpoint-dir", ckpt, "--log", log)
    got_weights, got_losses = lm_fit_child.load(tmp_path / "resumed.npz")
    # The resumed fit ran the epochs from the checkpoint on.
    assert len(got_losses) == STEPS // STEPS_PER_EPOCH - done

    losses = read_log(log)
    epochs = STEPS // STEPS_PER_EPOCH
    assert sorted(losses) == list(range(epochs))
    tolerance.assert_close([losses[e] for e in range(epochs)], want_losses, terms=STEPS,
                           err_msg="epoch losses")
    assert sorted(got_weights) == sorted(want_weights)
    moved = [float(np.abs(w).max()) for n, w in want_weights.items() if "lora_kernel_b" in n]
    assert moved and min(moved) > 0, moved
    names = sorted(want_weights)
    # Frozen kernels included: a resume that merged the adapters into them
    # (what `.weights.h5` holds) would move them by the adapters' update.
    tolerance.assert_all_close([got_weights[n] for n in names], [want_weights[n] for n in names],
                               ulps=4 * STEPS, err_msg="weights")


def tiny_lm(targets):
    lm = DecoderOnlyLM(6, 4, 8, num_layers=1, num_heads=2, intermediate_dim=8)
    lm(np.zeros((1, 4), "int32"))
    lm.enable_lora(2, target_names=targets)
    lm.compile(keras.optimizers.Adam(1e-2),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return lm


def test_fit_checkpoint_restores_exact_adapters_and_rejects_another_model(tmp_path):
    x = np.random.default_rng(0).integers(0, 6, (4, 4))
    lm = tiny_lm(("q_proj", "v_proj"))
    checkpoint = FitCheckpoint(tmp_path, delete_at_end=False)
    lm.fit(x, x, epochs=2, batch_size=2, verbose=0, callbacks=[checkpoint])
    assert (checkpoint.step, checkpoint.epoch) == (4, 2)
    saved = [np.array(v) for v in lm.weights]

    # Restored into a fresh model of the same build: A, B and the unmerged
    # kernels as they were (a `.weights.h5` round trip re-initialises A,
    # zeroes B and merges the update into the kernel).
    fresh = tiny_lm(("q_proj", "v_proj"))
    history = fresh.fit(x, x, epochs=2, batch_size=2, verbose=0,
                        callbacks=[FitCheckpoint(tmp_path, delete_at_end=False)])
    assert history.history == {}  # every epoch was done already
    assert any(np.abs(w).max() > 0 for v, w in zip(lm.weights, saved) if "lora_kernel_b" in v.path)
    for v, want in zip(fresh.weights, saved, strict=True):
        np.testing.assert_array_equal(np.array(v), want, err_msg=v.path)
    assert int(fresh.optimizer.iterations) == 4

    other = tiny_lm(("q_proj",))
    with pytest.raises(ValueError, match="another model"):
        other.fit(x, x, epochs=3, batch_size=2, verbose=0, callbacks=[FitCheckpoint(tmp_path)])


def test_fit_checkpoint_rejects_a_non_path():
    with pytest.raises(ValueError, match="directory=None"):
        FitCheckpoint(None)
