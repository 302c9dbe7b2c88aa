"""Checkpoints for `model.fit` that a killed run resumes from exactly, LoRA adapters included.

Keras's `BackupAndRestore` saves `model.save_weights`, and a LoRA layer's
`.weights.h5` entry is its merged kernel (so that a model without adapters
loads it): a run resumed from it starts with `W + (alpha / r) * A @ B` as
the frozen kernel, A re-initialised and B at zero, and the optimizer's
moments for A and B then act on other values. `FitCheckpoint` saves the
variables as they are instead (a LoRA layer's unmerged kernel, A and B,
the layers' dropout RNG states, the optimizer's variables and its step
counter), writes each checkpoint atomically, and on the next `fit` with the
same directory restores them and starts at the epoch after the checkpoint.
"""

import os

import keras
import numpy as np

_STATE = "state.npz"


def _signature(group, variables):
    """What a checkpoint's variables must match: shape and dtype, and the
    model's variables' names (`kernel`, `lora_kernel_a`, ...). Not paths:
    they hold the layers' auto-numbered names (the optimizer's names too),
    which differ between two builds of one architecture in one process."""
    return [f"{v.name if group == 'model' else ''}{tuple(v.shape)}:{v.dtype}" for v in variables]


class FitCheckpoint(keras.callbacks.Callback):
    """Saves the whole training state at the end of every epoch; a new `fit`
    with the same directory resumes from it.

    Pass it to `fit` with the same model architecture (LoRA enabled the same
    way), optimizer and `fit` arguments as the run it resumes. The
    checkpoint is taken at epoch ends, so to checkpoint every `n` steps
    train on a repeated stream with `steps_per_epoch=n` (an epoch is then a
    unit of `n` steps, not a pass over the data). `fit` cannot start inside
    an epoch: a run killed mid-epoch redoes that epoch from the checkpoint
    before it. `fit` also does not know where the input stream was: build
    it skipping the `step` batches already trained on
    (`dataset.skip(checkpoint.step)`), so a resumed run sees the batches an
    uninterrupted one would.

    Args:
        directory: where the checkpoint is kept (one, overwritten at each
            epoch end).
        delete_at_end: remove the checkpoint when `fit` completes (as
            `BackupAndRestore` does), so a later `fit` starts afresh.

    Attributes:
        step: the optimizer steps the checkpoint in `directory` was taken
            after (0 without one); read when the callback is made.
        epoch: the epochs it was taken after.

    Example:

    ```python
    checkpoint = keras_attn.training.FitCheckpoint("ckpt")
    data = causal_lm_dataset(pairs, tok, 16, 8, shuffle=True, seed=0, repeat=True)
    lm.fit(data.skip(checkpoint.step), epochs=20, steps_per_epoch=50,
           callbacks=[checkpoint])
    ```
    """

    def __init__(self, directory, delete_at_end=True):
        super().__init__()
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise ValueError("Received an invalid value for argument `directory`, expected a "
                             f"path. Received: directory={directory!r}")
        self.directory = str(directory)
        self.delete_at_end = bool(delete_at_end)
        metadata = self._read_metadata()
        self.step = metadata["step"] if metadata else 0
        self.epoch = metadata["epoch"] if metadata else 0

    def _path(self, name):
        return os.path.join(self.directory, name)

    def _read_metadata(self):
        if not os.path.exists(self._path(_STATE)):
            return None
        with np.load(self._path(_STATE)) as state:
            return {"step": int(state["step"]), "epoch": int(state["epoch"])}

    def _variables(self):
        # `model.variables` holds every weight (a LoRA layer's unmerged
        # kernel and its A and B) and the layers' SeedGenerator states, in an
        # order fixed by the architecture.
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        return {"model": list(self.model.variables),
                "optimizer": list(optimizer.variables) if optimizer is not None else []}

    def on_train_begin(self, logs=None):
        metadata = self._read_metadata()
        if metadata is None:
            return
        if not self.model.built:
            raise ValueError("Build the model (call it on a batch) before `fit` with a "
                             "`FitCheckpoint` that has a checkpoint to restore.")
        groups = self._variables()
        with np.load(self._path(_STATE)) as state:
            for group, variables in groups.items():
                saved = [str(p) for p in state[f"{group}_signature"]]
                here = _signature(group, variables)
                if saved != here:
                    raise ValueError(
                        f"The checkpoint in {self.directory} is of another {group}: it has "
                        f"{len(saved)} variables, this one {len(here)}"
                        + ("" if len(saved) != len(here) else
                           f"; first difference {next(p for p in zip(saved, here) if p[0] != p[1])}")
                        + ". Resume with the architecture, LoRA targets and optimizer it was saved from.")
                for i, variable in enumerate(variables):
                    variable.assign(state[f"{group}_{i}"])
        self.step, self.epoch = metadata["step"], metadata["epoch"]
        # How `BackupAndRestore` tells `fit` where to start.
        self.model._initial_epoch = self.epoch

    def on_epoch_end(self, epoch, logs=None):
        os.makedirs(self.directory, exist_ok=True)
        arrays = {}
        for group, variables in self._variables().items():
            arrays[f"{group}_signature"] = np.asarray(_signature(group, variables))
            for i, variable in enumerate(variables):
                arrays[f"{group}_{i}"] = keras.ops.convert_to_numpy(variable.value)
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        # Written whole, then renamed: a run killed while saving leaves the
        # previous checkpoint intact.
        tmp = self._path("state.tmp.npz")
        np.savez(tmp, step=step, epoch=epoch + 1, **arrays)
        os.replace(tmp, self._path(_STATE))
        self.step, self.epoch = step, epoch + 1

    def on_train_end(self, logs=None):
        if self.delete_at_end and os.path.exists(self._path(_STATE)):
            os.remove(self._path(_STATE))
