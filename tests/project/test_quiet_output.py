"""What a user's terminal or log file shows: no library log lines unless asked
for, and Keras progress bars only on a terminal.

The demo's own run with its output in a pipe (no carriage returns or ANSI
codes, one line per epoch) is checked in tests/project/test_examples.py.
"""

import io
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from keras_attn.training.quickstart import fit_verbosity
from tests.environments import child_env

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_fit_verbosity_is_a_bar_on_a_terminal_only(tmp_path):
    main, secondary = os.openpty()  # a real terminal device
    try:
        with os.fdopen(secondary, "w", closefd=False) as terminal:
            assert terminal.isatty() and fit_verbosity(None, terminal) == 1
    finally:
        os.close(main)
        os.close(secondary)
    with open(tmp_path / "log.txt", "w") as log:
        assert fit_verbosity(None, log) == 2
    assert fit_verbosity(None, io.StringIO()) == 2
    assert fit_verbosity(0, io.StringIO()) == 0 and fit_verbosity(1, io.StringIO()) == 1


GENERATE = """
import sys
from keras_attn.runtimes import litertlm
for verbose in (None, True):
    print("MARK", file=sys.stderr, flush=True)
    print(repr(litertlm.generate(sys.argv[1], "the cat", max_new_tokens=3, verbose=verbose)))
    sys.stdout.flush()
"""


def test_litertlm_generate_hides_litert_log_lines_unless_verbose(tmp_path):
    pytest.importorskip("litert_lm")
    pytest.importorskip("litert_lm_builder")
    from keras_attn.generation import DecoderOnlyLM
    from keras_attn.runtimes import export_litertlm, word_tokenizer

    vocabulary = ["", "[UNK]", "the", "cat", "sat", "on", "a", "mat"]
    lm = DecoderOnlyLM(len(vocabulary), 16, 16, num_layers=1, num_heads=2, intermediate_dim=32)
    lm(np.array([[2, 3]], np.int32))
    bundle = tmp_path / "lm.litertlm"
    export_litertlm(lm, bundle, tokenizer=word_tokenizer(vocabulary), max_length=12,
                    prefill_lengths=(4,))
    env = child_env(KERAS_ATTN_VERBOSE="0")
    done = subprocess.run([sys.executable, "-c", GENERATE, str(bundle)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    _, quiet, verbose = done.stderr.split("MARK\n")
    assert quiet == "", quiet  # the default: not one line from LiteRT-LM
    # On request, LiteRT-LM's own lines (accelerators, sections) are all there.
    assert len(verbose.splitlines()) >= 10 and "accelerator" in verbose, verbose
    texts = done.stdout.splitlines()
    assert len(texts) == 2 and texts[0] == texts[1]  # the same greedy text either way


@pytest.mark.parametrize("verbose", ["", "1"])
def test_tensorflow_start_up_lines_only_on_request(verbose):
    """`import keras_attn` (before TensorFlow) hides TensorFlow's C++ info and
    warning lines unless KERAS_ATTN_VERBOSE is set."""
    env = child_env(drop=("TF_CPP_MIN_LOG_LEVEL",), KERAS_ATTN_VERBOSE=verbose,
                    KERAS_BACKEND="tensorflow", TF_ENABLE_ONEDNN_OPTS="1")
    run = subprocess.run([sys.executable, "-c", "import keras_attn, tensorflow as tf; tf.constant(1) + 1"],
                         env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    info_lines = [line for line in run.stderr.splitlines() if line.startswith(("I0000", "W0000"))]
    if verbose:
        assert info_lines, run.stderr  # the oneDNN note at least
    else:
        assert not info_lines, info_lines
