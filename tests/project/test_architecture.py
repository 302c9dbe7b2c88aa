"""The layering of docs/architecture.md holds in the code."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "keras_attn"
HIGHER = (
    "keras_attn.data",
    "keras_attn.training",
    "keras_attn.export",
    "keras_attn.generation",
    "keras_attn.convert",
    "keras_attn.runtimes",
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
# TensorFlow-only packages (the runtime writers among them), and in
# `generation` the searches.
TENSORFLOW_MODULES = ("data", "training", "export", "runtimes", "generation/search.py")


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


def _package_imports(path):
    """keras_attn modules (and the root scripts) that `path` imports anywhere."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles_between_modules_and_the_package_never_imports_root_scripts():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = _package_imports(path)
        # `python -m keras_attn.cli` is a shim that runs the script.
        assert name == "keras_attn.cli" or not any(
            i.split(".")[0] == "keras_attn_cli" for i in imported
        ), f"{name} imports the root script keras_attn_cli"
        graph[name] = {i for i in imported if i in modules and i != name
                       and not name.startswith(i + ".") and not i.endswith("__init__")}
    cycles = []
    for start in graph:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(trail + [start])
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
    # A package's __init__ importing its submodules (and them importing a
    # sibling through the package) is not a cycle of modules.
    cycles = [c for c in cycles if not any(modules[m].name == "__init__.py" for m in c)]
    assert not cycles, cycles[:5]


def test_layers_and_generation_use_no_private_module_of_another_package():
    offenders = []
    for sub in ("generation", "export", "training", "convert", "data", "runtimes"):
        for path in (PACKAGE / sub).glob("*.py"):
            for name in _package_imports(path):
                parts = name.split(".")
                if parts[0] == "keras_attn" and len(parts) > 2 and parts[1] != sub and any(
                    p.startswith("_") and not p.startswith("__") for p in parts[2:3]
                ):
                    offenders.append(f"{sub}/{path.name}: {name}")
    assert not offenders, offenders


def test_kernel_choice_is_asked_of_dispatch_only():
    """Nothing outside `ops/dispatch.py` decides by backend or device for a kernel."""
    for path in list((PACKAGE / "ops").glob("*.py")) + list((PACKAGE / "layers").glob("*.py")):
        text = path.read_text()
        assert "cpu_kernels_enabled" not in text, path.name
        if path.name not in ("dispatch.py", "tf_kernels.py"):
            assert "get_device_type" not in text, path.name


def test_export_steps_are_written_once():
    """docs/architecture.md: every format's `ExportReport` is built by
    `export/report.make_report`, and the modules of the exporters' shared steps
    import no format module (a format calls them, never the other way)."""
    export = PACKAGE / "export"
    builders = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                if "ExportReport(" in p.read_text() and p != export / "report.py"]
    assert not builders, builders
    formats = {f"keras_attn.export.{m}" for m in
               ("saved_model", "tflite", "onnx", "onnx_fused", "all_formats", "check", "cli")}
    for step in ("arguments", "quality", "report", "samples", "staging", "verify"):
        imported = _package_imports(export / f"{step}.py") & formats
        assert not imported, (step, imported)

def _private(name):
    return name.startswith("_") and not name.startswith("__")


def test_no_module_uses_another_modules_private_names():
    """`from keras_attn.x import _name` and `x._name` (`x` a keras_attn module,
    `_name` not a module) only within the module that defines `_name`: a helper
    other modules need is public, and documented, where it lives."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    offenders = []
    for name, path in sorted(modules.items()):
        tree = ast.parse(path.read_text())
        bound = {}  # local name -> the keras_attn module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in modules:
                        bound[alias.asname or alias.name] = full
                    elif _private(alias.name) and node.module != name:
                        offenders.append(f"{name}: from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        bound[alias.asname or alias.name.split(".")[0]] = (
                            alias.name if alias.asname else alias.name.split(".")[0]
                        )
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            # The dotted chain left of the attribute, e.g. `keras_attn.ops.masking`.
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if not isinstance(value, ast.Name) or value.id not in bound:
                continue
            target = ".".join([bound[value.id]] + chain)
            if target in modules and target != name and f"{target}.{node.attr}" not in modules:
                offenders.append(f"{name}: {target}.{node.attr}")
    assert not offenders, offenders


def test_argument_checks_are_written_once_at_the_bottom():
    """`keras_attn.checks` imports no keras_attn module (ops, layers, export,
    generation and convert all import it), and no other module defines a
    function of the same name."""
    path = PACKAGE / "checks.py"
    assert not [n for n in _all_imports(path) if n.split(".")[0] == "keras_attn"]
    tree = ast.parse(path.read_text())
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not _private(n.name)}
    copies = []
    for other in PACKAGE.rglob("*.py"):
        if other == path:
            continue
        for node in ast.walk(ast.parse(other.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in names:
                copies.append(f"{other.relative_to(PACKAGE)}: {node.name}")
    assert not copies, copies


# 0.2.0's path of the signatures, a deprecated alias for one release
# (tests/runtimes/test_runtimes_shims.py); nothing else below `runtimes` imports it.
DEPRECATED_ALIAS = "generation/export.py"


def test_runtimes_sit_above_generation_and_export():
    """`keras_attn.runtimes` writes what `generation`'s models trace; the models,
    the searches and the model exports never import it."""
    offenders = []
    for sub in ("generation", "export", "training", "convert", "data", "ops", "layers"):
        for path in (PACKAGE / sub).glob("*.py"):
            if f"{sub}/{path.name}" == DEPRECATED_ALIAS:
                continue
            offenders += [f"{sub}/{path.name}: {name}" for name in _package_imports(path)
                          if name.startswith("keras_attn.runtimes")]
    assert not offenders, offenders
    assert len((PACKAGE / DEPRECATED_ALIAS).read_text().splitlines()) < 20  # it only forwards


def test_export_never_imports_generation():
    """The graph writers (runtimes' too) live in `export/` and read a model by
    its attributes; importing `generation`, even inside a function, would
    turn the layering upside down (docs/architecture.md)."""
    offenders = [f"{path.relative_to(PACKAGE)}: {name}"
                 for path in (PACKAGE / "export").rglob("*.py") for name in _package_imports(path)
                 if name == "keras_attn.generation" or name.startswith("keras_attn.generation.")]
    assert not offenders, offenders
