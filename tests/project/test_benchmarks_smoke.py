"""The benchmark scripts run (tiny sizes, no peers needed), so they cannot rot.

They measure nothing here: speed is compared only by the scripts themselves,
side by side in one run (see benchmarks/README.md), never by a timed test.
"""

import pathlib
import subprocess
import sys

import pytest
from tests.environments import child_env

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"

CASES = {
    "attention": ["bench_attention.py", "--lengths", "16", "--repeats", "1", "--no-torch"],
    "head_groups": ["bench_head_groups.py", "--lengths", "16", "--repeats", "1"],
    "long": ["bench_long.py", "--lengths", "256", "--repeats", "1", "--no-check"],
    "decode": ["bench_decode.py", "--lengths", "8", "--repeats", "2", "--skip-keras-hub",
               "--layers", "1", "--hidden", "32", "--vocab", "50"],
    "sliding_window": ["bench_sliding_window.py", "--lengths", "256", "--window", "32",
                       "--repeats", "1", "--no-full"],
    "gpu_check": ["gpu_check.py", "--allow-cpu", "--repeats", "1"],
    "int8_schemes": ["bench_int8_schemes.py", "--quick"],
    "real_size": ["bench_real_size.py", "--quick"],
    "finetune": ["bench_finetune.py", "--quick"],
    "training_kernels": ["bench_training_kernels.py", "--length", "32", "--repeats", "1"],
    "input": ["bench_input.py", "--examples", "48", "--batch-size", "8", "--rounds", "1",
              "--modes", "graph"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_script_runs(name, tmp_path):
    args = CASES[name]
    env = child_env(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, *args], cwd=BENCH, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "|" in result.stdout  # printed its table
