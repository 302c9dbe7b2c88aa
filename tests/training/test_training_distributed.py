"""Training across devices and machines, each run in its own process.

Every run is `examples/distributed_training.py` (a tiny Transformer text
classifier) in a subprocess: logical-device splits and TF_CONFIG must be set
before TensorFlow initialises, and a subprocess keeps that away from the
other tests' TensorFlow runtime. Runs that several tests compare are made
once per module. Every subprocess has a hard timeout.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests import tolerance
from tests.environments import child_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "distributed_training.py"
TIMEOUT = 150  # seconds, per run

# Small and fast; dropout 0 so that a run is a pure function of the seed.
# Plain SGD: runs that sum gradients in another order (replicas, workers)
# then differ by rounding that grows about one float32 ulp of the weights per
# step (`_assert_sgd_close`). Adam would divide each update by the root of
# its second moment, turning the rounding noise of a gradient that is ~0 by
# cancellation into a full learning-rate step: no float32 bound would hold.
STEPS = 100
TINY = [
    "--steps", str(STEPS), "--optimizer", "sgd", "--learning-rate", "0.1", "--global-batch-size", "32", "--num-train", "2000", "--num-test", "200",
    "--embedding-dim", "16", "--intermediate-dim", "32", "--dropout", "0",
    "--log-every", "20", "--checkpoint-every", "20", "--seed", "3", "--deterministic",
    "--no-export",  # export is covered by tests/export/test_export_examples.py
]

pytestmark = pytest.mark.slow


def _env(tf_config=None):
    return child_env(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2",
                     TF_CONFIG=None if tf_config is None else json.dumps(tf_config))


def _start(args, log_path, tf_config=None):
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args], stdout=log, stderr=subprocess.STDOUT,
        env=_env(tf_config), cwd=str(ROOT), start_new_session=True,
    )
    proc._log = log
    return proc


def _wait(proc, timeout=TIMEOUT):
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc._log.close()
    return proc.returncode


def _run_all(specs):
    """Starts every `(args, log_path, tf_config)` at once; waits; asserts success."""
    procs = [_start(*spec) for spec in specs]
    codes = [_wait(p) for p in procs]
    for (args, log, _), code in zip(specs, codes):
        assert code == 0, f"run failed ({code}): {args}\n{Path(log).read_text()[-3000:]}"


def _weights(path):
    with np.load(path) as f:
        n = len([k for k in f.files if re.fullmatch(r"w\d+", k)])
        return [f[f"w{i}"] for i in range(n)], f["losses"]


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _cluster(n=2):
    return {"worker": [f"127.0.0.1:{p}" for p in _free_ports(n)]}


def _workers(cluster, args, tmp, tag):
    return [
        (args + ["--save-weights", str(tmp / f"{tag}_w{i}.npz")], tmp / f"{tag}_{i}.log",
         {"cluster": cluster, "task": {"type": "worker", "index": i}})
        for i in range(len(cluster["worker"]))
    ]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def _assert_sgd_close(run_a, run_b):
    """Two SGD runs of the same global batches whose gradients were summed in
    another order: weights within a few float32 ulps of the weights per step,
    and the logged losses within the rounding of those steps."""
    (wa, la), (wb, lb) = run_a, run_b
    assert len(wa) == len(wb)
    tolerance.assert_all_close(wa, wb, ulps=4 * STEPS, err_msg="weights")
    tolerance.assert_close(la, lb, terms=STEPS, err_msg="losses")


# --- model.fit under MirroredStrategy (2 logical CPU devices) ---------------------------


@pytest.fixture(scope="module")
def fit_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fit")
    specs = {
        "one": TINY + ["--use-fit", "--strategy", "mirrored", "--num-cpu-devices", "1"],
        "two": TINY + ["--use-fit", "--strategy", "mirrored", "--num-cpu-devices", "2"],
        "two_mixed": TINY + ["--use-fit", "--strategy", "mirrored", "--num-cpu-devices", "2",
                             "--mixed-precision"],
        # Keras turns XLA off when op determinism is on, so no --deterministic here.
        "one_jit_mixed": [a for a in TINY if a != "--deterministic"] + [
            "--use-fit", "--strategy", "mirrored", "--num-cpu-devices", "1", "--jit-compile",
            "--mixed-precision"],
        # The Trainer under MirroredStrategy on the same two logical devices.
        "trainer_two": TINY + ["--strategy", "mirrored", "--num-cpu-devices", "2"],
        "trainer_two_jit_mixed": TINY + ["--strategy", "mirrored", "--num-cpu-devices", "2",
                                         "--jit-compile", "--mixed-precision"],
    }
    _run_all([(a + ["--save-weights", str(tmp / f"{k}.npz")], tmp / f"{k}.log", None)
              for k, a in specs.items()])
    return {k: _weights(tmp / f"{k}.npz") for k in specs} | {
        k + "_log": (tmp / f"{k}.log").read_text() for k in specs}


def test_fit_two_replicas_matches_one_replica(fit_runs):
    assert "replicas in sync: 2" in fit_runs["two_log"]
    assert "replicas in sync: 1" in fit_runs["one_log"]
    losses2 = fit_runs["two"][1]
    assert losses2[-1] < losses2[0]
    # Same global batches, gradients summed in a different order.
    _assert_sgd_close(fit_runs["one"], fit_runs["two"])


def test_fit_mixed_precision_two_replicas(fit_runs):
    weights, losses = fit_runs["two_mixed"]
    assert "replicas in sync: 2" in fit_runs["two_mixed_log"]
    assert all(np.all(np.isfinite(w)) for w in weights)
    assert losses[-1] < losses[0] - 0.05, losses
    # Variables stay float32 under mixed_float16.
    assert all(w.dtype == np.float32 for w in weights if w.dtype.kind == "f")


def test_fit_jit_compile_mixed_precision(fit_runs):
    # model.fit cannot XLA-compile with two replicas (keras-team/keras#19005:
    # "Trying to access resource .../replica_1 located in device CPU:1 from
    # CPU:0"); with one replica under MirroredStrategy it can. Two replicas
    # with XLA are covered by the Trainer below.
    weights, losses = fit_runs["one_jit_mixed"]
    assert all(np.all(np.isfinite(w)) for w in weights)
    assert losses[-1] < losses[0] - 0.05, losses


def test_trainer_two_replicas_matches_one_replica(fit_runs, single_runs):
    assert "replicas in sync: 2" in fit_runs["trainer_two_log"]
    losses2 = fit_runs["trainer_two"][1]
    assert losses2[-1] < losses2[0] - 0.05, losses2
    _assert_sgd_close(_weights(single_runs / "a.npz"), fit_runs["trainer_two"])


def test_trainer_jit_compile_mixed_precision_two_replicas(fit_runs):
    weights, losses = fit_runs["trainer_two_jit_mixed"]
    log = fit_runs["trainer_two_jit_mixed_log"]
    assert "replicas in sync: 2" in log
    assert re.search(r"loss_scale: [\d.]+", log)  # dynamic loss scaling is on
    assert all(np.all(np.isfinite(w)) for w in weights)
    assert losses[-1] < losses[0] - 0.05, losses


# --- the Trainer: single worker, determinism, single-process resume -------------------


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    base = TINY + ["--strategy", "mirrored", "--log-dir", str(tmp / "tb")]
    _run_all([
        (base + ["--save-weights", str(tmp / "a.npz"), "--checkpoint-dir", str(tmp / "ca")],
         tmp / "a.log", None),
        (base + ["--save-weights", str(tmp / "b.npz")], tmp / "b.log", None),
    ])
    return tmp


def test_trainer_single_worker_learns_logs_and_checkpoints(single_runs):
    weights, losses = _weights(single_runs / "a.npz")
    assert losses[-1] < losses[0] - 0.05, losses
    log = (single_runs / "a.log").read_text()
    assert re.search(r"step 20/100 - loss: [\d.]+ - accuracy: [\d.]+", log)
    assert sorted(p.name for p in (single_runs / "ca").glob("ckpt-*.index")) == [
        "ckpt-100.index", "ckpt-60.index", "ckpt-80.index"]
    events = list((single_runs / "tb").glob("events.out.tfevents.*"))
    assert events
    import tensorflow as tf

    tags = set()
    for event in events:
        for record in tf.compat.v1.train.summary_iterator(str(event)):
            for value in record.summary.value:
                tags.add(value.tag)
    assert {"loss", "accuracy"} <= tags


def test_trainer_deterministic_with_op_determinism(single_runs):
    # Two processes, same seed, enable_op_determinism: bit-identical weights.
    a, _ = _weights(single_runs / "a.npz")
    b, _ = _weights(single_runs / "b.npz")
    _assert_same(a, b)


def _kill_when_checkpoint(procs, ckpt_dir, at_least, deadline):
    """SIGKILLs `procs[0]` once a checkpoint >= `at_least` exists; then the rest."""
    while time.monotonic() < deadline:
        steps = [int(p.name[5:-6]) for p in Path(ckpt_dir).glob("ckpt-*.index")]
        if steps and max(steps) >= at_least:
            break
        assert all(p.poll() is None for p in procs), "a run ended before it was killed"
        time.sleep(0.1)
    else:
        pytest.fail("no checkpoint appeared in time")
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        p._log.close()
    import tensorflow as tf

    latest = tf.train.latest_checkpoint(str(ckpt_dir))
    return int(latest.rsplit("-", 1)[1])


def test_single_process_sigkill_resume_equals_uninterrupted(single_runs, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = TINY + ["--strategy", "mirrored", "--checkpoint-dir", str(ckpt)]
    proc = _start(args + ["--step-delay", "0.15"], tmp_path / "killed.log")
    resumed_at = _kill_when_checkpoint([proc], ckpt, 40, time.monotonic() + TIMEOUT)
    assert 40 <= resumed_at < 100
    _run_all([(args + ["--save-weights", str(tmp_path / "r.npz")], tmp_path / "r.log", None)])
    log = (tmp_path / "r.log").read_text()
    assert f"resumed from checkpoint at step {resumed_at}" in log
    # The step counter continues: no log line for steps already done.
    logged = [int(s) for s in re.findall(r"^step (\d+)/100", log, re.M)]
    assert logged and min(logged) > resumed_at and logged[-1] == 100
    resumed, _ = _weights(tmp_path / "r.npz")
    uninterrupted, _ = _weights(single_runs / "a.npz")
    _assert_same(resumed, uninterrupted)  # bit-identical


# --- MultiWorkerMirroredStrategy: two worker processes on 127.0.0.1 ------------------


@pytest.fixture(scope="module")
def multi_worker_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mw")
    args = TINY + ["--strategy", "multi-worker", "--checkpoint-dir", str(tmp / "ckpt")]
    _run_all(_workers(_cluster(), args, tmp, "run"))
    return tmp


def test_multi_worker_trains_identically_on_both_workers(multi_worker_run, single_runs):
    w0, losses0 = _weights(multi_worker_run / "run_w0.npz")
    w1, _ = _weights(multi_worker_run / "run_w1.npz")
    assert "replicas in sync: 2" in (multi_worker_run / "run_0.log").read_text()
    assert losses0[-1] < losses0[0] - 0.05, losses0
    _assert_same(w0, w1)  # synchronous all-reduce: the same numbers on both workers
    # Same global batches as one worker; sums in another order: float tolerance.
    _assert_sgd_close((w0, losses0), _weights(single_runs / "a.npz"))
    # Only the chief's checkpoints remain; worker 1's scratch copies are deleted.
    names = sorted(p.name for p in (multi_worker_run / "ckpt").iterdir())
    assert "ckpt-100.index" in names and not [n for n in names if n.startswith(".scratch")]


def test_multi_worker_sigkill_one_worker_then_resume(multi_worker_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = TINY + ["--strategy", "multi-worker", "--checkpoint-dir", str(ckpt)]
    specs = _workers(_cluster(), args + ["--step-delay", "0.15"], tmp_path, "killed")
    procs = [_start(*spec) for spec in specs]
    # Worker 1 is SIGKILLed mid-run; worker 0 then blocks in its next
    # all-reduce and is killed too ("restart both").
    resumed_at = _kill_when_checkpoint(procs[::-1], ckpt, 40, time.monotonic() + TIMEOUT)
    assert 40 <= resumed_at < 100
    _run_all(_workers(_cluster(), args, tmp_path, "resumed"))
    for i in range(2):
        log = (tmp_path / f"resumed_{i}.log").read_text()
        assert f"resumed from checkpoint at step {resumed_at}" in log
    logged = [int(s) for s in re.findall(r"^step (\d+)/100", (tmp_path / "resumed_0.log").read_text(), re.M)]
    assert logged and min(logged) > resumed_at and logged[-1] == 100
    r0, _ = _weights(tmp_path / "resumed_w0.npz")
    r1, _ = _weights(tmp_path / "resumed_w1.npz")
    _assert_same(r0, r1)
    uninterrupted, _ = _weights(multi_worker_run / "run_w0.npz")
    _assert_same(r0, uninterrupted)  # bit-identical to the run that was never killed
