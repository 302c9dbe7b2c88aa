"""The layering of docs/architecture.md holds in the code."""

import ast
import pathlib

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


def test_tensorflow_in_ops_only_behind_the_backend_check():
    text = (PACKAGE / "ops" / "chunked.py").read_text()
    lines = text.splitlines()
    for number, line in enumerate(lines):
        if "import tensorflow" in line:
            guard = "\n".join(lines[max(0, number - 3) : number])
            assert 'backend() != "tensorflow"' in guard, (number, guard)
    for path in (PACKAGE / "ops").glob("*.py"):
        if path.name != "chunked.py":
            assert "tensorflow" not in set(n.split(".")[0] for n in _all_imports(path)), path
