"""The console script: instant help (no TensorFlow import), version, flags."""

import argparse
import inspect
import pathlib
import subprocess
import sys

import keras_attn_cli

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_help_and_version_do_not_import_tensorflow():
    done = _run(
        "import sys, keras_attn_cli\n"
        "for argv in (['--help'], ['export', '--help'], ['version']):\n"
        "    try:\n"
        "        keras_attn_cli.main(argv)\n"
        "    except SystemExit as stop:\n"
        "        assert stop.code == 0, stop.code\n"
        "heavy = sorted(m for m in ('tensorflow', 'keras', 'keras_attn', 'jax', 'torch') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "usage: keras-attn" in done.stdout and "{version,export,attention,demo}" in done.stdout
    assert "HEAVY []" in done.stdout, done.stdout
    assert done.stderr == "", done.stderr  # nothing but our own lines


def test_version_is_the_package_version():
    done = _run("import keras_attn_cli; keras_attn_cli.main(['version'])")
    text = (ROOT / "keras_attn" / "__init__.py").read_text()
    assert f'__version__ = "{done.stdout.strip()}"' in text


def test_export_flags_match_the_export_command():
    """Every flag `keras_attn.export.cli.run` reads is defined by the launcher's
    parser (the one definition), with the formats `run` knows as choices."""
    import re

    from keras_attn.export import cli as export_cli

    parser = argparse.ArgumentParser()
    keras_attn_cli._add_export_arguments(parser)
    defined = {a.dest: a for a in parser._actions}
    read = set(re.findall(r"args\.(\w+)", inspect.getsource(export_cli.run)))
    assert read and read <= set(defined), read - set(defined)
    assert set(defined["format"].choices) == set(export_cli.FORMATS) | {"all"}

def test_demo_flags_go_to_the_demo(monkeypatch):
    seen = {}
    from keras_attn.training import quickstart

    monkeypatch.setattr(quickstart, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    keras_attn_cli.main(["demo", "--epochs", "1", "--no-export"])
    assert seen["argv"] == ["--epochs", "1", "--no-export"]


def test_quiet_and_verbose_switch_tensorflow_logging():
    code = (
        "import os, keras_attn_cli\n"
        "os.environ.pop('TF_CPP_MIN_LOG_LEVEL', None); os.environ.pop('KERAS_ATTN_VERBOSE', None)\n"
        "print(keras_attn_cli.quiet(verbose=FLAG, import_tensorflow=False),"
        " os.environ.get('TF_CPP_MIN_LOG_LEVEL'), os.environ.get('KERAS_ATTN_VERBOSE'))\n"
    )
    assert _run(code.replace("FLAG", "False")).stdout.split() == ["False", "3", "None"]
    assert _run(code.replace("FLAG", "True")).stdout.split() == ["True", "None", "1"]
