#!/usr/bin/env bash
# Installs the peers the benchmarks compare against, into the current Python
# environment (default: /work/venv/bin/python; override with PYTHON=...).
#
# keras-hub is installed with --no-deps: its dependency tensorflow-text would
# pull in the `tensorflow` distribution next to tensorflow-cpu (two copies of
# TensorFlow in one environment). Its other dependencies are installed
# explicitly; keras_hub's TransformerEncoder/Decoder do not need
# tensorflow-text.
#
# torch==2.13.0 (CPU) is optional: a second peer for bench_attention.py.
set -euo pipefail
PYTHON="${PYTHON:-/work/venv/bin/python}"
PIP=("$PYTHON" -m pip install --quiet --disable-pip-version-check)

"${PIP[@]}" --no-deps "keras-hub==0.32.0"
"${PIP[@]}" absl-py numpy packaging regex rich "kagglehub!=1.0.1" "kagglesdk==0.1.28" \
    sentencepiece tokenizers

if [[ "${WITH_TORCH:-1}" == "1" ]]; then
    "${PIP[@]}" "torch==2.13.0" || echo "torch==2.13.0 not available: the PyTorch peer is skipped"
fi

"$PYTHON" - <<'PY'
import os
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras_hub  # noqa: F401
print("keras_hub", keras_hub.__version__, "imports")
PY
if "$PYTHON" -m pip list 2>/dev/null | grep -E '^tensorflow[[:space:]]'; then
    echo "ERROR: a 'tensorflow' distribution is installed next to tensorflow-cpu" >&2
    exit 1
fi
echo "ok: no 'tensorflow' distribution next to tensorflow-cpu"
