"""Short version of benchmarks/bench_serving.py: concurrent calls give the
sequential results bitwise, and a soak leaves RSS flat."""

import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest
from tests import tolerance

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "benchmarks" / "bench_serving.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model, paths = bench.build_models(str(tmp_path_factory.mktemp("serving")))
    return model, paths, bench.requests(64)


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["saved_model", "onnx"])
def test_eight_threads_give_sequential_results(served, runtime):
    model, paths, reqs = served
    run = (bench.saved_model_runner if runtime == "saved_model" else bench.onnx_runner)(paths[runtime])
    identical, diff, _ = bench.concurrency(run, reqs, threads=8, calls=4)
    assert identical, diff
    # And the shared results are the model's (not, say, all one cached answer).
    tolerance.assert_close(run(reqs[5]), np.asarray(model(reqs[5])), terms=tolerance.LAYER_TERMS)


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["tflite", "onnx"])
def test_soak_keeps_rss_flat(served, runtime):
    _, paths, reqs = served
    run = (bench.tflite_runner if runtime == "tflite" else bench.onnx_runner)(paths[runtime])
    before, after, growth, _ = bench.soak(run, reqs, total=1000, warmup=100)
    print(f"{runtime}: RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB ({growth:+.2f}%)")
    assert growth < 5.0


def test_concurrency_detects_a_thread_unsafe_runner():
    """The comparison can fail: a runner sharing one output buffer across
    threads returns other threads' answers."""
    reqs = bench.requests(32)
    shared = np.zeros((4, 2), "int32")

    def unsafe(ids):
        shared[:] = ids[:, :2]
        time.sleep(0.002)  # let other threads overwrite the buffer
        return shared.copy()

    identical, _, _ = bench.concurrency(unsafe, reqs, threads=8, calls=4)
    assert not identical
