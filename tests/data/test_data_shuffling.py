"""The facts in docs/guides/data_shuffling.md, measured in a fresh process
with two logical CPU devices (MirroredStrategy with 2 replicas)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.environments import child_env

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json
import tensorflow as tf
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
from keras_attn.data.pipelines import distributed_input_fn

def stream(batch, seed=0):
    return tf.data.Dataset.range(32).shuffle(32, seed=seed).repeat().batch(batch, drop_remainder=True)

out = {}
out["plain"] = [b.numpy().tolist() for b in stream(8).take(4)]
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
it = iter(strategy.experimental_distribute_dataset(stream(8)))
out["fit_style"] = [[v.numpy().tolist() for v in strategy.experimental_local_results(next(it))]
                    for _ in range(4)]
fn = distributed_input_fn(lambda b, ctx: stream(b), 8)
it = iter(strategy.distribute_datasets_from_function(fn))
out["from_function"] = [[v.numpy().tolist() for v in strategy.experimental_local_results(next(it))]
                        for _ in range(4)]
tf.random.set_seed(0)
out["no_op_seed"] = next(iter(tf.data.Dataset.range(32).shuffle(32).batch(8))).numpy().tolist()
tf.random.set_seed(0)
tf.random.uniform(())
out["no_op_seed_after_op"] = next(iter(tf.data.Dataset.range(32).shuffle(32).batch(8))).numpy().tolist()
tf.random.set_seed(0)
out["op_seed"] = next(iter(tf.data.Dataset.range(32).shuffle(32, seed=0).batch(8))).numpy().tolist()
tf.random.set_seed(0)
tf.random.uniform(())
out["op_seed_after_op"] = next(iter(tf.data.Dataset.range(32).shuffle(32, seed=0).batch(8))).numpy().tolist()
ds = tf.data.Dataset.range(32).shuffle(32, seed=0, reshuffle_each_iteration=True).batch(32)
out["epochs"] = [next(iter(ds)).numpy().tolist() for _ in range(2)]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def measured():
    env = child_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(line[7:])


def test_fit_style_distribution_splits_each_global_batch(measured):
    # model.fit under MirroredStrategy: the batch of the dataset is the global
    # batch, cut in half for the two replicas; same examples per step.
    for plain, (r0, r1) in zip(measured["plain"], measured["fit_style"]):
        assert r0 + r1 == plain


def test_from_function_replica_batches_make_the_global_batches(measured):
    # distribute_datasets_from_function: one pipeline of per-replica batches
    # (4), consecutive batches go to the replicas; the pairs make the global
    # batches in order, but each replica's batch is half a global batch.
    per_replica = [sum(step, []) for step in measured["from_function"]]
    assert per_replica == measured["plain"]


def test_seeds(measured):
    assert measured["op_seed"] == measured["op_seed_after_op"]
    # Without an op seed the order depends on the random ops created before.
    assert measured["no_op_seed"] != measured["no_op_seed_after_op"]
    first, second = measured["epochs"]
    assert first != second and sorted(first) == sorted(second) == list(range(32))
