"""The layering of docs/architecture.md holds in the code."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "keras_attn"
HIGHER = (
    "keras_attn.data",
    "keras_attn.training",
    "keras_attn.export",
    "keras_attn.generation",
    "keras_attn.convert",
)


def _module_level_imports(path):
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def _all_imports(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_core_is_keras_ops_only_and_imports_nothing_above_it():
    offenders = []
    for sub in ("ops", "layers"):
        for path in (PACKAGE / sub).glob("*.py"):
            for name in _module_level_imports(path):
                if name.split(".")[0] == "tensorflow":
                    offenders.append(f"{path.name}: module-level import {name}")
            for name in _all_imports(path):
                if name.startswith(HIGHER) or (sub == "ops" and name.startswith("keras_attn.layers")):
                    offenders.append(f"{path.name}: imports {name}")
    assert not offenders, offenders


# Where TensorFlow is imported at module level (docs/architecture.md): the
# TensorFlow-only packages, and in `generation` the searches, their export and
# the exported signatures' request checks.
TENSORFLOW_MODULES = ("data", "training", "export", "generation/search.py", "generation/export.py",
                      "generation/request_checks.py")


def test_tensorflow_in_ops_only_behind_the_backend_check():
    """In the core, TensorFlow is imported only inside functions of
    `ops/tf_kernels.py` and `config.py`, after a backend check."""
    allowed = {PACKAGE / "ops" / "tf_kernels.py", PACKAGE / "config.py"}
    for path in allowed:
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if "import tensorflow" in line:
                guard = "\n".join(lines[max(0, number - 8) : number])
                assert 'backend() != "tensorflow"' in guard or 'backend == "tensorflow"' in guard, (
                    path.name, number, guard)
    for sub in ("ops", "layers"):
        for path in (PACKAGE / sub).glob("*.py"):
            if path not in allowed:
                imported = set(n.split(".")[0] for n in _all_imports(path))
                assert "tensorflow" not in imported, path


def test_module_level_tensorflow_imports_are_where_the_docs_say():
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if any(n.split(".")[0] == "tensorflow" for n in _module_level_imports(path)):
            found.add(path.relative_to(PACKAGE).as_posix())
    outside = sorted(p for p in found if not p.startswith(TENSORFLOW_MODULES))
    assert not outside, outside
    assert "generation/search.py" in found  # stated in docs/architecture.md
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for name in TENSORFLOW_MODULES:
        assert name in doc, name


def test_searches_say_they_need_the_tensorflow_backend(monkeypatch):
    import keras

    from keras_attn.generation import search

    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(RuntimeError, match="TensorFlow Keras backend.*'jax'"):
        search.greedy_search(None, [[1, 2]], 4)


def test_the_dispatch_function_is_named_in_the_architecture_note():
    from keras_attn.ops import dispatch

    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    assert "keras_attn.ops.dispatch.select_kernel" in doc
    assert callable(dispatch.select_kernel)


def test_no_file_in_ops_is_over_400_lines():
    long = {p.name: n for p in (PACKAGE / "ops").glob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
