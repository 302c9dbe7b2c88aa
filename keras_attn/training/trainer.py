"""A strategy-aware custom training loop for Keras models.

Keras 3's `model.fit` works under `tf.distribute.MirroredStrategy` but not
under `MultiWorkerMirroredStrategy` (keras-team/keras#20585: it fails
converting a `PerReplica` value). `Trainer` is the loop that works under
both (and with no strategy at all): a `strategy.run` step inside a
`tf.function`, the loss averaged over the *global* batch, gradients
all-reduced by the Keras optimizer, dynamic loss scaling under mixed
precision, Keras metrics, a log line every `log_every` steps, TensorBoard
scalars, and `tf.train.CheckpointManager` checkpoints with resume.

Multi-worker use: set `TF_CONFIG` on each worker, create
`tf.distribute.MultiWorkerMirroredStrategy()` first thing, then build the
model and optimizer inside `strategy.scope()` and call `Trainer.fit` on every
worker. The chief writes checkpoints and summaries to the given
directories; other workers write theirs to a scratch directory (every worker
must take part in saving, because saving a distributed variable is a
collective operation) and delete them.
"""

import os
import shutil
import sys
import time
import warnings

import keras
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from keras_attn.structure import Structure

# `tf.summary.scalar` lives in the `tensorboard` package, which
# tensorflow-cpu does not install; the core `tf.summary.write` with the
# scalars plugin's metadata writes the same event that TensorBoard reads.
_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
)


def _random_state_variables(model):
    """The model's variables that are not weights: its layers' SeedGenerator states.

    `keras.Layer.variables` is "all layer state, including random seeds";
    `keras.Layer.weights` leaves the seeds out. Listed in `model.variables`
    order, which is the same for every build of the same architecture.
    """
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def _root_children(checkpoint_path):
    """Names of the checkpoint's root object's children (`model`, `weights`, ...)."""
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    reader = tf.train.load_checkpoint(checkpoint_path)
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    return {child.local_name for child in graph.nodes[0].children}


def _is_chief(strategy):
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    return task_type == "chief" or (
        task_type == "worker"
        and task_id == 0
        and "chief" not in resolver.cluster_spec().as_dict()
    )


class Trainer:
    """Trains a Keras model with a `strategy.run` loop; checkpoints and resumes.

    Create the model and the optimizer inside `strategy.scope()` before
    building the `Trainer` (the trainer builds the optimizer's slots there).

    Args:
        model: a Keras model; called as `model(x, training=True)`.
        optimizer: a Keras optimizer. With a `mixed_float16` global policy it
            is wrapped in `keras.optimizers.LossScaleOptimizer` unless it
            already is one.
        loss: a Keras loss (its reduction is replaced by per-example
            losses averaged over the global batch).
        global_batch_size: examples per step summed over all replicas.
        strategy: a `tf.distribute.Strategy`; the default (no-op) strategy
            when None.
        metrics: Keras metrics updated with `(y, logits)` (and the batch's
            sample weights when it has them) each step.
        checkpoint_dir: where `tf.train.CheckpointManager` keeps
            checkpoints; training resumes from the latest one. A checkpoint
            holds the model's variables (including the layers'
            `keras.random.SeedGenerator` states, so dropout continues with the
            masks an uninterrupted run would draw), the optimizer and the step.
        checkpoint_every: steps between checkpoints (and one at the end).
        max_to_keep: checkpoints kept.
        log_dir: TensorBoard directory for `loss`, metrics and `loss_scale`.
        log_every: steps between log lines and summaries.
        jit_compile: XLA-compile the forward and backward pass of each
            replica (the optimizer update runs outside XLA; see
            `_make_jit_gradient_fn` for why).
    """

    def __init__(
        self,
        model,
        optimizer,
        loss,
        global_batch_size,
        strategy=None,
        metrics=(),
        checkpoint_dir=None,
        checkpoint_every=100,
        max_to_keep=3,
        log_dir=None,
        log_every=10,
        jit_compile=False,
    ):
        if not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ValueError(
                "Received an invalid value for argument `global_batch_size`, expected "
                f"a positive integer. Received: global_batch_size={global_batch_size!r}"
            )
        for name, value in (("checkpoint_every", checkpoint_every), ("log_every", log_every)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"Received an invalid value for argument `{name}`, expected a "
                    f"positive integer. Received: {name}={value!r}"
                )
        self.strategy = strategy or tf.distribute.get_strategy()
        if global_batch_size % self.strategy.num_replicas_in_sync:
            raise ValueError(
                f"`global_batch_size` ({global_batch_size}) must be divisible by the "
                f"number of replicas ({self.strategy.num_replicas_in_sync})."
            )
        self.model = model
        loss = keras.losses.get(loss)
        if isinstance(loss, keras.losses.Loss):
            # Per-example values: the trainer averages over the global batch.
            config = loss.get_config()
            config["reduction"] = None
            loss = loss.__class__.from_config(config)
        self.loss = loss
        self.global_batch_size = global_batch_size
        self.metrics = list(metrics)
        self.checkpoint_every = checkpoint_every
        self.log_every = log_every
        self.jit_compile = jit_compile
        self.is_chief = _is_chief(self.strategy)
        with self.strategy.scope():
            if keras.mixed_precision.global_policy().name == "mixed_float16" and not isinstance(
                optimizer, keras.optimizers.LossScaleOptimizer
            ):
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
            self.optimizer = optimizer
            self.optimizer.build(model.trainable_variables)
            self.step = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="step",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
            self.loss_sum = keras.metrics.Mean(name="loss")
        # The model's state that is not a weight: the `keras.random.SeedGenerator`
        # states of its layers (dropout masks; `layer.variables` includes them,
        # `layer.weights` does not). They live in plain Python objects that
        # `tf.train.Checkpoint` does not traverse, so without this list a resumed
        # run would restart every dropout RNG from its seed and replay the masks
        # of the first steps.
        self._random_state = _random_state_variables(model)
        # `model.weights` as a list of its own: `tf.train.Checkpoint` finds a
        # model's variables through the attributes it tracks, and a Keras
        # layer kept in a Python list (`DecoderOnlyLM.blocks`, so every
        # decoder block) is not one of them: through `model` alone a
        # checkpoint of a `DecoderOnlyLM` holds its embeddings, final norm
        # and head, and nothing of its blocks.
        self._weights = list(model.weights)
        self._checkpoint_objects = dict(model=model, optimizer=self.optimizer, step=self.step,
                                        weights=self._weights)
        if self._random_state:
            self._checkpoint_objects["random_state"] = self._random_state
        self.checkpoint = tf.train.Checkpoint(**self._checkpoint_objects)
        self.checkpoint_dir = checkpoint_dir
        self._scratch_dir = None
        self.manager = None
        if checkpoint_dir is not None:
            directory = checkpoint_dir
            if not self.is_chief:
                resolver = self.strategy.cluster_resolver
                directory = os.path.join(
                    checkpoint_dir, f".scratch_{resolver.task_type}_{resolver.task_id}"
                )
                self._scratch_dir = directory
            self.manager = tf.train.CheckpointManager(
                self.checkpoint, directory, max_to_keep=max_to_keep
            )
        self.writer = None
        if log_dir is not None:
            if self.is_chief:
                self.writer = tf.summary.create_file_writer(log_dir)
            else:
                self.writer = tf.summary.create_noop_writer()
        self._train_step = None
        self._jit_gradients = None
        # The optimizer's slots, the checkpoint and the traced step are made
        # for the model as it is now.
        self._structure = Structure(model)
        self.history = []

    # -- checkpoints -------------------------------------------------------
    def restore(self):
        """Restores the latest checkpoint of `checkpoint_dir`; returns the step (0 if none).

        Every worker reads the chief's checkpoint, so all start equal.
        """
        if self.checkpoint_dir is None:
            return int(self.step.numpy())
        latest = tf.train.latest_checkpoint(self.checkpoint_dir)
        if not latest:
            return int(self.step.numpy())
        saved = _root_children(latest)
        missing = sorted(set(self._checkpoint_objects) - saved)
        if missing:
            # Written by an earlier version of this trainer: restore what it has.
            objects = {k: v for k, v in self._checkpoint_objects.items() if k in saved}
            tf.train.Checkpoint(**objects).restore(latest).assert_existing_objects_matched()
            consequences = {
                "weights": "the weights of layers the model keeps in lists (a DecoderOnlyLM's "
                           "blocks) were not saved and keep their current values",
                "random_state": "the layers' dropout RNGs restart from their seeds",
            }
            warnings.warn(
                f"The checkpoint {latest} has no {' and no '.join(missing)} (it predates "
                "their checkpointing): what it has is restored, but "
                + "; ".join(consequences[name] for name in missing)
                + ", so the resumed run differs from an uninterrupted one.",
                stacklevel=2,
            )
        else:
            self.checkpoint.restore(latest).assert_existing_objects_matched()
        return int(self.step.numpy())

    def save(self):
        if self.manager is None:
            return None
        path = self.manager.save(checkpoint_number=self.step)
        if self._scratch_dir is not None:
            shutil.rmtree(self._scratch_dir, ignore_errors=True)
        return path

    # -- the step ----------------------------------------------------------
    def _average_loss(self, y, logits, sample_weight=None):
        # Weighted per-position losses (a causal LM's prompt and padding at
        # weight 0), averaged as `model.fit`'s default "sum_over_batch_size"
        # does: over every position, so the two loops report the same loss.
        per_example = self.loss(y, logits)
        if sample_weight is not None:
            per_example = per_example * tf.cast(sample_weight, per_example.dtype)
        # The mean over every axis but the batch, per example:
        per_example = tf.reshape(tf.cast(per_example, tf.float32), [tf.shape(y)[0], -1])
        per_example = tf.reduce_mean(per_example, axis=1)
        # Divided by the *global* batch: the optimizer sums over replicas.
        return tf.nn.compute_average_loss(per_example, global_batch_size=self.global_batch_size)

    def _make_jit_gradient_fn(self):
        """Forward and backward pass as one XLA function of tensors only.

        XLA cannot compile a function that reads variables living on
        another replica's device (keras-team/keras#19005), which is what
        `tf.function(jit_compile=True)` around `strategy.run` or around a
        replica step that captures the model's variables does under
        `MirroredStrategy` with >1 replica. Here the variable values come in
        as arguments (`model.stateless_call`), so each replica runs the
        compiled function on its own device; the optimizer update and any
        non-trainable state are applied outside XLA.
        """
        model = self.model

        def gradients(trainable, non_trainable, x, y, sample_weight, loss_scale):
            with tf.GradientTape() as tape:
                tape.watch(trainable)
                logits, non_trainable, losses = model.stateless_call(
                    trainable, non_trainable, x, training=True, return_losses=True
                )
                loss = self._average_loss(y, logits, sample_weight)
                if losses:
                    loss += tf.nn.scale_regularization_loss(
                        tf.add_n([tf.cast(v, tf.float32) for v in losses])
                    )
                scaled = loss * loss_scale
            grads = tape.gradient(scaled, trainable)
            return loss, grads, non_trainable, logits

        return tf.function(gradients, jit_compile=True)

    def _replica_step(self, x, y, sample_weight=None):
        variables = self.model.trainable_variables
        scaling = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        if self.jit_compile:
            if self._jit_gradients is None:
                self._jit_gradients = self._make_jit_gradient_fn()
            scale = (
                tf.cast(tf.convert_to_tensor(self.optimizer.dynamic_scale), tf.float32)
                if scaling
                else tf.constant(1.0)
            )
            loss, grads, non_trainable, logits = self._jit_gradients(
                [tf.convert_to_tensor(v.value) for v in variables],
                [tf.convert_to_tensor(v.value) for v in self.model.non_trainable_variables],
                x, y, sample_weight, scale,
            )
            for variable, value in zip(self.model.non_trainable_variables, non_trainable):
                variable.assign(value)
        else:
            with tf.GradientTape() as tape:
                logits = self.model(x, training=True)
                loss = self._average_loss(y, logits, sample_weight)
                if self.model.losses:
                    loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
                scaled = self.optimizer.scale_loss(loss) if scaling else loss
            grads = tape.gradient(scaled, variables)
        replicas = self.strategy.num_replicas_in_sync
        if scaling and replicas > 1:
            # keras.optimizers.LossScaleOptimizer checks each replica's *own*
            # gradients for inf/NaN and assumes they agree; when only one
            # replica overflows, the others apply the all-reduced (non-finite)
            # update and every weight becomes NaN. All-reducing first makes
            # the check see the same gradients everywhere; dividing by the
            # replica count undoes the optimizer's own all-reduce (exact for
            # power-of-two replica counts).
            grads = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, [tf.convert_to_tensor(g) for g in grads]
            )
            grads = [g / replicas for g in grads]
        self.optimizer.apply_gradients(zip(grads, variables))
        for metric in self.metrics:
            metric.update_state(y, logits, sample_weight=sample_weight)
        return loss

    def _make_train_step(self):
        @tf.function
        def train_step(iterator):
            # `(x, y)` or `(x, y, sample_weight)`, as `model.fit` takes them.
            batch = tuple(next(iterator))
            per_replica_loss = self.strategy.run(self._replica_step, args=batch)
            loss = self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_loss, axis=None)
            self.loss_sum.update_state(loss)
            self.step.assign_add(1)
            return loss

        return train_step

    # -- the loop ----------------------------------------------------------
    def fit(self, input_fn, steps, on_step_end=None, verbose=True):
        """Trains until the step counter reaches `steps` (resuming if a checkpoint exists).

        Args:
            input_fn: `input_context -> tf.data.Dataset` of per-replica
                batches `(x, y)` or `(x, y, sample_weight)` (as `fit` takes
                them; `keras_attn.data.causal_lm_dataset` gives the latter),
                infinite (e.g. from `keras_attn.data.distributed_input_fn`,
                or `repeat=True`). On resume from step
                `k`, the first `k` batches of each input pipeline are
                skipped, so a resumed run sees the same data as an
                uninterrupted one.
            steps: the final value of the step counter.
            on_step_end: optional `callable(step, loss)` called after each step.
            verbose: print a log line every `log_every` steps.

        Returns:
            A list of `(step, loss)` pairs, one per log line.
        """
        if Structure(self.model) != self._structure:
            raise ValueError(
                "The model's structure changed after this Trainer was made (LoRA enabled, "
                "quantized, `trainable` flipped or a layer replaced): its optimizer, "
                "checkpoint and traced step are for the model as it was. Make a new "
                "Trainer (and optimizer) for the changed model."
            )
        start = self.restore()
        replicas_per_pipeline = None

        def skipped_input_fn(input_context):
            nonlocal replicas_per_pipeline
            replicas_per_pipeline = (
                input_context.num_replicas_in_sync // input_context.num_input_pipelines
            )
            ds = input_fn(input_context)
            return ds.skip(start * replicas_per_pipeline)

        dataset = self.strategy.distribute_datasets_from_function(skipped_input_fn)
        iterator = iter(dataset)
        if self._train_step is None:
            self._train_step = self._make_train_step()
        begin = time.perf_counter()
        step = start
        while step < steps:
            loss = self._train_step(iterator)
            step = int(self.step.numpy())
            loss_value = float(loss.numpy())
            if on_step_end is not None:
                on_step_end(step, loss_value)
            if step % self.log_every == 0 or step == steps:
                self._log(step, steps, begin, start)
            if self.manager is not None and (step % self.checkpoint_every == 0 or step == steps):
                self.save()
        if self.writer is not None:
            self.writer.flush()
        return self.history

    def _log(self, step, steps, begin, start):
        values = {"loss": float(self.loss_sum.result().numpy())}
        for metric in self.metrics:
            values[metric.name] = float(metric.result().numpy())
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            values["loss_scale"] = float(self.optimizer.dynamic_scale.numpy())
        self.history.append((step, values["loss"]))
        if self.writer is not None:
            with self.writer.as_default(step=step):
                for name, value in values.items():
                    tf.summary.write(
                        name, tf.constant(value, tf.float32), metadata=_SCALAR_METADATA
                    )
        if self.is_chief:
            elapsed = time.perf_counter() - begin
            rate = (step - start) / elapsed if elapsed > 0 else 0.0
            text = " - ".join(f"{k}: {v:.4f}" for k, v in values.items())
            print(f"step {step}/{steps} - {text} - {rate:.1f} steps/s", file=sys.stdout, flush=True)
        self.loss_sum.reset_state()
        for metric in self.metrics:
            metric.reset_state()
