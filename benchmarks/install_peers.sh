#!/usr/bin/env bash
# Installs the peers the benchmarks compare against, into the current Python
# environment (default: /work/venv/bin/python; override with PYTHON=...).
#
# keras-hub installs normally: its dependency tensorflow-text resolves to the
# same `tensorflow` distribution keras_attn depends on (one TensorFlow; see
# tests/project/test_install.py). The same peers are the `peers` extra of pyproject.toml.
#
# torch==2.13.0 (CPU) is optional: a second peer for bench_attention.py.
set -euo pipefail
PYTHON="${PYTHON:-/work/venv/bin/python}"
PIP=("$PYTHON" -m pip install --quiet --disable-pip-version-check)

"${PIP[@]}" "keras-hub>=0.21"

if [[ "${WITH_TORCH:-1}" == "1" ]]; then
    "${PIP[@]}" "torch==2.13.0" || echo "torch==2.13.0 not available: the PyTorch peer is skipped"
fi

# Optimum (bench_onnx_fused.py) pins its own transformers: it gets its own venv,
# called by the benchmark through `--optimum-python` (default /work/venv-optimum).
if [[ "${WITH_OPTIMUM:-1}" == "1" ]]; then
    OPTIMUM_VENV="${OPTIMUM_VENV:-/work/venv-optimum}"
    python3 -m venv "$OPTIMUM_VENV"
    "$OPTIMUM_VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        "torch==2.13.0" "optimum-onnx[onnxruntime]" \
        || echo "optimum-onnx not available: the Optimum rows of bench_onnx_fused.py are skipped"
fi

"$PYTHON" - <<'PY'
import os
from importlib import metadata

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras_hub  # noqa: F401

print("keras_hub", keras_hub.__version__, "imports")
tensorflows = sorted(
    d.metadata["Name"] for d in metadata.distributions()
    if d.metadata["Name"].lower().replace("_", "-") in {
        "tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel",
        "tensorflow-macos", "tf-nightly", "tf-nightly-cpu", "intel-tensorflow"}
)
if len(tensorflows) != 1:
    raise SystemExit(f"ERROR: expected one TensorFlow distribution, found {tensorflows}")
print("ok: one TensorFlow distribution:", tensorflows[0])
PY

# litert-torch (bench_litertlm.py's peer) pins its own torch and imports TensorFlow
# without declaring it, so it gets its own venv (one TensorFlow there too); the
# benchmark calls it as PEER_PYTHON. Opt in with WITH_LITERT_TORCH=1.
if [[ "${WITH_LITERT_TORCH:-0}" == "1" ]]; then
    VENV="${LITERT_TORCH_VENV:-/work/venv-litert-torch}"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        "litert-torch>=0.10" "torch==2.13.0" "tensorflow>=2.21,<2.22"
    echo "litert-torch peer: PEER_PYTHON=$VENV/bin/python"
fi

# The ONNX Runtime GenAI model builder (bench_genai.py's peer) needs onnx-ir.
if [[ "${WITH_GENAI_BUILDER:-0}" == "1" ]]; then
    "${PIP[@]}" "onnx-ir>=1.0"
fi
