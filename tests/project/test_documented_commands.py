"""Every shell command the docs show runs against what the repo produces.

The ```bash blocks of README.md, docs/**/*.md and export/README.md are read and
each command (lines joined at `\\`, split at `&&`) is handled by its first word:

- `keras-attn demo ...` runs once, at smoke scale (size flags appended), in a
  scratch folder: it writes `outputs/demo/` as for a user;
- `keras-attn ...` and `saved_model_cli ...` then run word for word there;
- `docker run ... tensorflow/serving`: every mounted host path exists and the
  model folder holds a numbered SavedModel version (no Docker in CI);
- `curl ... -d @FILE` (or an inline JSON body): valid JSON whose input names are
  the SavedModel's when the model is the demo's;
- `python -m module ...`: the module exists;
- `python examples/X.py --flag ...`: the script exists and defines each flag;
- set-up lines (venv, pip, activate, export, TF_CONFIG=..., mkdocs, pytest) are left to
  `.ci/run`, which runs the README's test command itself.
"""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from tests.environments import child_env

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "README.md", ROOT / "export" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DEMO_SMOKE = ["--num-train", "256", "--num-test", "32", "--epochs", "1", "--batch-size", "32",
              "--embedding-dim", "16", "--intermediate-dim", "32", "--num-heads", "2",
              "--num-layers", "1"]
SKIPPED = ("python3 -m venv", ". .venv/bin/activate", "source ", "pip ", "export ", "TF_CONFIG=",
           "mkdocs ", "cd ", "bash ", "python -m pytest")


def documented_commands():
    commands = []
    for source in SOURCES:
        for block in re.findall(r"```bash\n(.*?)```", source.read_text(), flags=re.S):
            text = re.sub(r"\\\n\s*", " ", block)
            for line in text.splitlines():
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                for part in line.split("&&"):
                    part = part.strip().rstrip("&").strip()
                    if part and not part.startswith(SKIPPED):
                        commands.append((source.relative_to(ROOT).as_posix(), part))
    return commands


def _console_scripts(folder):
    """`keras-attn` as pip generates it from pyproject.toml's entry point.

    The environment's own script may come from an older install of the package;
    this one runs the entry point declared now (the wheel's script is tested in
    tests/project/test_packaging.py).
    """
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as handle:
        scripts = tomllib.load(handle)["project"]["scripts"]
    folder.mkdir(exist_ok=True)
    for name, target in scripts.items():
        module, function = target.split(":")
        path = folder / name
        path.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {function}\n"
                        f"sys.exit({function}())\n")
        path.chmod(0o755)
    return folder


def _env(scripts=None):
    # As in a user's shell: no logging settings inherited from the test process.
    env = child_env(drop=("TF_CPP_MIN_LOG_LEVEL", "KERAS_ATTN_VERBOSE"))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    if scripts is not None:
        env["PATH"] = str(scripts) + os.pathsep + env["PATH"]
    return env


def _run(command, cwd, timeout=900):
    env = _env(_console_scripts(pathlib.Path(cwd) / ".bin"))
    done = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, executable="/bin/bash")
    assert done.returncode == 0, f"{command}\nfailed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A user's folder after `keras-attn demo` (smoke scale)."""
    cwd = tmp_path_factory.mktemp("user")
    demo = [c for _, c in documented_commands() if c.startswith("keras-attn demo")]
    assert demo, "no documented `keras-attn demo` command"
    command = demo[0] + " " + " ".join(DEMO_SMOKE + ["--data-dir", str(cwd / "tfds")])
    out = _run(command, cwd)
    return cwd, out


def test_documented_commands_are_found():
    firsts = {c.split()[0] for _, c in documented_commands()}
    assert {"keras-attn", "saved_model_cli", "docker", "curl", "python"} <= firsts, firsts


def test_demo_output_fits_on_one_screen(workdir):
    """Our lines, Keras's bars and real warnings: no TensorFlow/absl/tfds log lines."""
    _, out = workdir
    lines = [l for l in out.replace("\r", "\n").splitlines() if l.strip()]
    bars = [l for l in lines if "step" in l and ("━" in l or "/step" in l)]
    ours = [l for l in lines if l not in bars]
    noise = [l for l in ours if re.match(r"^(?:[IWE]\d{4} |WARNING:absl|WARNING: All log|"
                                         r"Downloading and preparing|Generating |Shuffling )", l)]
    assert not noise, noise
    assert len(ours) <= 40, "\n".join(ours)
    assert any("the first step compiles" in l for l in ours)


def test_demo_saves_its_model_and_prints_the_documented_commands(workdir):
    cwd, out = workdir
    assert (cwd / "outputs" / "demo" / "dates.keras").is_file()
    printed = {line.strip() for line in out.splitlines()}
    documented = {c for _, c in documented_commands()}
    for command in ("docker run", "curl", "saved_model_cli run"):
        line = next((l for l in printed if l.startswith(command)), None)
        assert line is not None, f"the demo did not print a `{command}` line:\n{out[-2000:]}"
        assert line in documented, f"the demo prints a command the docs do not show: {line}"


def _signature_inputs(cwd, saved_model):
    import tensorflow as tf

    loaded = tf.saved_model.load(str(pathlib.Path(cwd) / saved_model))
    return set(loaded.signatures["serving_default"].structured_input_signature[1])


def test_every_documented_command_runs(workdir):
    cwd, _ = workdir
    seen = set()
    for source, command in documented_commands():
        if command in seen or command.startswith("keras-attn demo"):
            continue
        seen.add(command)
        words = shlex.split(command, comments=True)
        if words[0] in ("keras-attn", "saved_model_cli"):
            _run(command, cwd)
        elif words[0] == "docker":
            assert "tensorflow/serving" in words, (source, command)
            mounts = [words[i + 1] for i, w in enumerate(words) if w == "-v"]
            assert mounts, (source, command)
            for mount in mounts:
                host, container = mount.split(":")[:2]
                host = pathlib.Path(host.replace("$PWD", str(cwd)).replace(str(cwd) + "/export",
                                                                         str(ROOT / "export")))
                assert host.exists(), (source, command, host)
            name = next((w.split("=", 1)[1] for w in words if w.startswith("MODEL_NAME=")), None)
            if name is not None:
                model_dir = pathlib.Path(mounts[0].split(":")[0].replace("$PWD", str(cwd)))
                assert model_dir.name == name and (model_dir / "1" / "saved_model.pb").is_file()
        elif words[0] == "curl":
            data = words[words.index("-d") + 1] if "-d" in words else None
            if data is None:  # a GET: model status or metadata
                assert re.search(r"localhost:850[01]/v1/models/", command), (source, command)
                continue
            if data.startswith("@"):
                request = json.loads((cwd / data[1:]).read_text())
            else:
                request = json.loads(data)
            model = re.search(r"/v1/models/([^/:]+)", command).group(1)
            saved_model = cwd / f"outputs/demo/saved_model/{model}/1"
            if "inputs" in request and saved_model.is_dir():
                assert set(request["inputs"]) == _signature_inputs(cwd, saved_model), command
        elif words[0] == "python" and words[1] == "-m":
            import importlib.util

            assert importlib.util.find_spec(words[2]) is not None, (source, command)
        elif words[0] == "python":
            script = ROOT / words[1]
            assert script.is_file(), (source, command)
            sources = script.read_text() + (ROOT / "keras_attn/training/quickstart.py").read_text()
            for flag in (w for w in words[2:] if w.startswith("--")):
                assert f'"{flag}"' in sources, (source, command, flag)
        else:
            pytest.fail(f"{source}: no rule for the documented command {command!r}")
