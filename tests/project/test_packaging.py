"""The built wheel and sdist are complete, and the wheel works when installed.

An editable install hides missing package files, so this builds the wheel and the
sdist (`python -m build`, no network: `--no-isolation`), checks their metadata and
file lists, installs the wheel (not editable) into a fresh virtual environment and
runs a smoke test there: import, build a model, export it, the console script.
To stay fast and offline, the fresh environment reaches the test environment's
installed dependencies through a `.pth` file and the wheel is installed with
`--no-deps`; keras_attn itself must come from the wheel (checked).
"""

import email.parser
import os
import pathlib
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _version():
    import re

    text = (ROOT / "keras_attn" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel", "--no-isolation",
                           "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=600, cwd=out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wheel, = out.glob("*.whl")
    sdist, = out.glob("*.tar.gz")
    return wheel, sdist


def _sources():
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "keras_attn").rglob("*.py")
             if "__pycache__" not in p.parts}
    return files | {"keras_attn_cli.py"}


def test_wheel_metadata_and_files(dist):
    wheel, _ = dist
    assert wheel.name.startswith(f"keras_attn-{_version()}-py3-none-any")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(info).decode())
        entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert not _sources() - names, f"missing from the wheel: {sorted(_sources() - names)}"
    assert metadata["Name"] == "keras-attn" and metadata["Version"] == _version()
    requires = metadata.get_all("Requires-Dist")
    core = [r for r in requires if "extra ==" not in r]
    assert any(r.replace(" ", "").startswith("tensorflow<2.22,>=2.21") or
               r.replace(" ", "").startswith("tensorflow>=2.21,<2.22") for r in core), core
    assert not any(r.startswith(("tensorflow-cpu", "tensorflow_cpu")) for r in requires)
    assert any(r.startswith("importlib_resources") or r.startswith("importlib-resources")
               for r in core), core
    assert {"gpu", "test", "docs", "peers", "examples"} <= set(metadata.get_all("Provides-Extra"))
    gpu = [r for r in requires if 'extra == "gpu"' in r]
    assert gpu and all("tensorflow[and-cuda]" in r.replace(" ", "") for r in gpu), gpu
    assert metadata.get_payload().startswith("# keras_attn"), "README is not the long description"
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert "keras-attn = keras_attn_cli:main" in entry_points


def test_sdist_has_the_sources(dist):
    _, sdist = dist
    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    for needed in ("pyproject.toml", "README.md", *_sources()):
        assert needed in names, f"{needed} missing from the sdist"


def test_installed_wheel_builds_and_exports_a_model(dist, tmp_path):
    wheel, _ = dist
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    fresh_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip()
    # The test environment's dependencies, after the fresh site-packages.
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    pathlib.Path(fresh_site, "_test_env_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    done = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index",
                           str(wheel)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    smoke = (
        "import os, sys, numpy as np, keras, keras_attn as ka\n"
        "from keras_attn import export\n"
        f"assert ka.__file__.startswith({fresh_site!r}), ka.__file__\n"
        "ids = keras.Input((None,), dtype='int32', name='tokens')\n"
        "h = ka.TokenAndPositionEmbedding(50, 16, 16, mask_zero=True)(ids)\n"
        "h = ka.TransformerEncoderBlock(num_heads=2, intermediate_dim=32)(h)\n"
        "h = keras.layers.GlobalAveragePooling1D()(h)\n"
        "model = keras.Model(ids, keras.layers.Dense(2, name='logits')(h))\n"
        "model.save('m.keras')\n"
        "reports = export.export_all(model, 'out', name='m', verbose=False)\n"
        "assert sorted(reports) == ['onnx', 'saved_model', 'tflite'], reports\n"
        "print('SMOKE OK', ka.__version__)\n"
    )
    done = subprocess.run([str(python), "-c", smoke], capture_output=True, text=True,
                          timeout=900, cwd=tmp_path, env={**env, "KERAS_BACKEND": "tensorflow"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"SMOKE OK {_version()}" in done.stdout
    script = venv / "bin" / "keras-attn"
    done = subprocess.run([str(script), "version"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 0 and done.stdout.strip() == _version(), done.stderr
    done = subprocess.run([str(script), "export", "m.keras", "--format", "saved_model",
                           "--out", "cli_out"], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (tmp_path / "cli_out" / "saved_model" / "m" / "1" / "saved_model.pb").is_file()
