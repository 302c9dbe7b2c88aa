"""Environments for the processes the tests start.

A child inherits the test process's environment, and with it settings the
host made for itself or the test run made for the parent. Two kinds matter:

- Variables that pin a library to a CPU model or an instruction set. A host
  may set them for its own CPU (some set `OPENBLAS_CORETYPE` because older
  OpenBLAS builds misdetect theirs), so a native child keeps them; a child
  on an emulated CPU must not have them, or OpenBLAS runs AVX2 kernels on an
  emulated SSE4-only CPU and dies of an illegal instruction.
- A cluster description (`TF_CONFIG`): a child that builds a distribution
  strategy would become a worker of that cluster. Tests that want one set it.
"""

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Each forces a CPU model or instruction set on a library (or tunes it for
# one): OpenBLAS, oneDNN (TensorFlow's and onnxruntime's), MKL, PyTorch's
# ATen dispatch, NumPy's SIMD dispatch.
CPU_PINNING = (
    "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
    "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_CPU_ISA_HINTS", "DNNL_CPU_ISA_HINTS",
    "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE", "MKL_CBWR",
    "ATEN_CPU_CAPABILITY",
    "NPY_DISABLE_CPU_FEATURES", "NPY_ENABLE_CPU_FEATURES",
)


def child_env(*, cpu=None, drop=(), **overrides):
    """The environment of a fresh interpreter started by a test.

    The test process's environment, with this checkout first on PYTHONPATH,
    no `TF_CONFIG` and no variable in `drop`; then `overrides` (a value of
    None removes the variable). `cpu` names an emulated CPU (qemu's `-cpu`):
    the host's CPU pinning (`CPU_PINNING`) is removed, so each library picks
    the kernels of the CPU it is really running on.
    """
    env = dict(os.environ)
    for name in ("TF_CONFIG", *drop, *(CPU_PINNING if cpu else ())):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env
