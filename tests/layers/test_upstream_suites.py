"""Peers' own test files pass with only the class swapped for ours.

"Drop-in" is checked by the peers' tests, not by ours: Keras's
`multi_head_attention_test.py` (read from the installed wheel) and KerasHub's
`TransformerDecoder` / `TransformerEncoder` tests (copied into
tests/layers/upstream/, see its README). Each file is copied with one import (or
class reference) rewritten, and run by pytest in a subprocess on the current
Keras backend. Only the tests listed in PRIVATE_ATTRIBUTE_TESTS are
deselected: they read KerasHub's private sublayer names.
"""

import pathlib
import re
import subprocess
import sys

import keras
import pytest
from tests.environments import child_env

UPSTREAM = pathlib.Path(__file__).parent / "upstream"

# KerasHub tests that call private attributes (`decoder._self_attention_layer_norm`);
# ours are public (`self_attention_layer_norm`).
PRIVATE_ATTRIBUTE_TESTS = {
    "keras_hub_transformer_decoder_test.py": ["TransformerDecoderTest::test_training_propagation"],
    "keras_hub_transformer_encoder_test.py": ["TransformerEncoderTest::test_training_propagation"],
}


def _keras_mha_source():
    from keras.src.layers.attention import multi_head_attention

    path = pathlib.Path(multi_head_attention.__file__).with_name("multi_head_attention_test.py")
    if not path.exists():
        pytest.fail(f"Keras's MultiHeadAttention test file is missing from the wheel: {path}")
    return path.read_text()


SUITES = {
    # name: (source, [(pattern, replacement)], header inserted before the first class)
    "keras_mha_test.py": (
        _keras_mha_source,
        [(r"\blayers\.MultiHeadAttention\b", "_SwappedClass")],
        "from keras_attn import MultiHeadAttention as _SwappedClass\n",
    ),
    "keras_hub_transformer_decoder_test.py": (
        lambda: (UPSTREAM / "keras_hub" / "transformer_decoder_test.py").read_text(),
        [(
            r"from keras_hub\.src\.layers\.modeling\.transformer_decoder import TransformerDecoder\n",
            "from keras_attn import TransformerDecoderBlock as TransformerDecoder\n",
        )],
        "",
    ),
    "keras_hub_transformer_encoder_test.py": (
        lambda: (UPSTREAM / "keras_hub" / "transformer_encoder_test.py").read_text(),
        [(
            r"from keras_hub\.src\.layers\.modeling\.transformer_encoder import TransformerEncoder\n",
            "from keras_attn import TransformerEncoderBlock as TransformerEncoder\n",
        )],
        "",
    ),
}


def swapped_source(source, replacements, header):
    """`source` with each pattern replaced (each must match) and `header`
    inserted before its first top-level class."""
    for pattern, replacement in replacements:
        source, count = re.subn(pattern, replacement, source)
        assert count, f"the upstream file no longer contains {pattern!r}: update the swap"
    if header:
        source = re.sub(r"^class ", header + "\n\nclass ", source, count=1, flags=re.M)
    return source


def test_swap_rewrites_every_reference():
    source = "from keras.src import layers\nclass T:\n    x = layers.MultiHeadAttention(1, 2)\n"
    out = swapped_source(source, *SUITES["keras_mha_test.py"][1:])
    assert "layers.MultiHeadAttention" not in out
    assert out.index("import MultiHeadAttention as _SwappedClass") < out.index("class T")
    with pytest.raises(AssertionError, match="no longer contains"):
        swapped_source("class T: pass\n", *SUITES["keras_mha_test.py"][1:])


@pytest.mark.slow
def test_peer_test_files_pass_with_our_classes(tmp_path):
    files = []
    for name, (source, replacements, header) in SUITES.items():
        path = tmp_path / name
        path.write_text(swapped_source(source(), replacements, header))
        files.append(path)
    deselect = [
        arg
        for name, tests in PRIVATE_ATTRIBUTE_TESTS.items()
        for test in tests
        for arg in ("--deselect", f"{name}::{test}")
    ]
    # The package under test, wherever this checkout is (the copies live in tmp_path).
    env = child_env(KERAS_BACKEND=keras.backend.backend())
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--disable-warnings",
         "--rootdir", str(tmp_path), *(f.name for f in files), *deselect],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    tail = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0, tail
    summary = result.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    deselected = int(re.search(r"(\d+) deselected", summary).group(1))
    assert deselected == sum(map(len, PRIVATE_ATTRIBUTE_TESTS.values())), summary
    # Keras's file alone has more than 40 tests; KerasHub's two about 20.
    assert passed >= 60, summary
