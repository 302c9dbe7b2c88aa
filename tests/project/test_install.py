"""The install resolves to exactly one TensorFlow distribution.

Every distribution below writes the same `tensorflow/` package; two of them in
one environment overwrite each other's files. Each case asks pip to resolve
(`pip install --dry-run --report -`: nothing is downloaded beyond metadata and
nothing is installed) keras-attn with all its extras, from scratch (a fresh
machine, CPU or GPU: the extras include `gpu`, so the core `tensorflow` and the
`gpu` extra's `tensorflow[and-cuda]` are resolved together) and in the test
environment itself next to the TensorFlow already installed there; and each
extra that docs/install.md documents, on its own, added to this environment (a
user adding an extra to an install). (A from-scratch resolution takes ~45 s of
CPU; one per extra would take a quarter of CI's budget.)

keras-attn's own metadata is prepared with this environment's setuptools
(`--no-build-isolation`, the `test` extra installs it): with build isolation
every resolution would first resolve and install setuptools into a throwaway
environment, which resolves nothing about keras-attn's dependencies.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

TENSORFLOW_DISTRIBUTIONS = {
    "tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel",
    "tensorflow-macos", "tensorflow-aarch64", "tensorflow-cpu-aws", "tensorflow-rocm",
    "intel-tensorflow", "tf-nightly", "tf-nightly-cpu", "tf-nightly-gpu",
    "tf-nightly-intel", "tf-nightly-macos",
}


def _extras():
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as handle:
        return sorted(tomllib.load(handle)["project"]["optional-dependencies"])


def _documented_extras():
    """The extras docs/install.md tells users to install (`keras-attn[a,b]`)."""
    text = (ROOT / "docs" / "install.md").read_text()
    found = set()
    for group in re.findall(r"keras-attn\[([a-z0-9,-]+)\]", text):
        found.update(group.split(","))
    return sorted(found)


DOCUMENTED_EXTRAS = _documented_extras()


def _normalize(name):
    return name.lower().replace("_", "-").replace(".", "-")


def _start(*requirements, ignore_installed):
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
               "--no-build-isolation", "--report", "-", *requirements]
    if ignore_installed:
        command.insert(4, "--ignore-installed")
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return requirements, subprocess.Popen(command, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def _finish(started):
    requirements, process = started
    stdout, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, f"pip could not resolve {requirements}:\n{stderr[-3000:]}"
    report = json.loads(stdout)
    return {_normalize(item["metadata"]["name"]): item["metadata"]["version"]
            for item in report["install"]}


# The machines a from-scratch install is for. Both are one resolution: the
# requirement set of `.[every extra]` holds the core `tensorflow` (a machine with
# nothing, or a TensorFlow image's `tensorflow`) and the `gpu` extra's
# `tensorflow[and-cuda]` alike (pinning either next to it, as this file did
# before, changes nothing pip resolves), so it is resolved once.
CASES = ("cpu", "gpu")


@pytest.fixture(scope="module")
def resolutions():
    """The resolutions: the two that are slow (pip mostly waits on the
    network) side by side, then the quick ones."""
    ours = f".[{','.join(_extras())}]"
    assert "gpu" in _extras(), "the from-scratch resolution no longer covers a GPU machine"
    started = {"from scratch": _start(ours, ignore_installed=True),
               "environment": _start(ours, ignore_installed=False)}
    results = {name: _finish(s) for name, s in started.items()}
    for case in CASES:
        results[case] = results["from scratch"]
    # Next to this environment pip mostly finds what is installed: quick, one at a time.
    for extra in DOCUMENTED_EXTRAS:
        results[f"extra {extra}"] = _finish(_start(f".[{extra}]", ignore_installed=False))
    return results


def _tensorflows(names):
    return sorted(n for n in names if n in TENSORFLOW_DISTRIBUTIONS)


def test_tensorflow_distribution_list_is_normalized():
    assert all(_normalize(n) == n for n in TENSORFLOW_DISTRIBUTIONS)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_fresh_install_has_one_tensorflow(resolutions, case):
    installed = resolutions[case]
    assert "keras-attn" in installed
    assert "keras-hub" in installed and "tensorflow-text" in installed  # peers resolve normally
    assert _tensorflows(installed) == ["tensorflow"], installed
    if case == "gpu":
        assert any(n.startswith("nvidia-") for n in installed), "and-cuda pulled no CUDA wheels"


@pytest.mark.slow
def test_install_next_to_this_environments_tensorflow(resolutions):
    from importlib import metadata

    present = {_normalize(d.metadata["Name"]) for d in metadata.distributions()}
    assert len(_tensorflows(present)) == 1, _tensorflows(present)
    added = resolutions["environment"]
    assert _tensorflows(added) == [], f"would add {_tensorflows(added)} next to {_tensorflows(present)}"


def test_every_extra_is_documented():
    assert DOCUMENTED_EXTRAS == _extras(), (
        f"docs/install.md documents {DOCUMENTED_EXTRAS}, pyproject.toml defines {_extras()}")


@pytest.mark.slow
@pytest.mark.parametrize("extra", DOCUMENTED_EXTRAS)
def test_each_documented_extra_adds_no_second_tensorflow(resolutions, extra):
    added = resolutions[f"extra {extra}"]
    assert "keras-attn" in added
    assert _tensorflows(added) == [], f"[{extra}] would add {_tensorflows(added)}"


@pytest.mark.slow
def test_conversion_extra_brings_cpu_torch_with_one_tensorflow(resolutions):
    """What `from_huggingface` imports, in the from-scratch resolution of every
    extra (the `huggingface` one among them): torch at the pinned CPU version."""
    installed = resolutions["cpu"]
    assert {"transformers", "safetensors", "torch"} <= set(installed), installed
    assert installed["torch"].split("+")[0] == "2.13.0", installed["torch"]
