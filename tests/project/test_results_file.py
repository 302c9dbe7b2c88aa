"""benchmarks/results_file.py: one section of RESULTS.md replaced, every other byte kept."""

import importlib
import importlib.util
import json
import pathlib
import subprocess
import sys
import types

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
results_file = importlib.import_module("results_file")

TEXT = """# Results

Intro, not in any section.

## A: `python benchmarks/a.py --write-results`

<!-- results:a -->
old a
| T | x |
|---|---|
| 1 | 1.00x |
<!-- /results:a -->

## B: `python benchmarks/run_all.py --only b`

<!-- results:b -->
old b
<!-- /results:b -->

Trailing text.
"""


def test_replacing_one_section_changes_only_that_section():
    new = results_file.replace_section(TEXT, "a", "\nnew a\n| T | x |\n|---|---|\n| 1 | 2.00x |\n")
    before, after = TEXT.split("<!-- results:a -->"), new.split("<!-- results:a -->")
    assert before[0] == after[0]  # everything up to the section, byte for byte
    assert new.split("<!-- /results:a -->")[1] == TEXT.split("<!-- /results:a -->")[1]
    assert results_file.get_section(new, "a") == "\nnew a\n| T | x |\n|---|---|\n| 1 | 2.00x |\n"
    assert results_file.get_section(new, "b") == results_file.get_section(TEXT, "b")
    # Writing the old body back gives the original file.
    assert results_file.replace_section(new, "a", results_file.get_section(TEXT, "a")) == TEXT


def test_unknown_section_is_a_value_error_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"no section 'c'.*sections: a, b"):
        results_file.replace_section(TEXT, "c", "x")


@pytest.mark.parametrize("broken", [
    TEXT.replace("<!-- /results:a -->\n", ""),                      # end marker missing
    TEXT.replace("<!-- /results:b -->", "<!-- /results:b -->\n<!-- /results:b -->"),  # twice
    TEXT.replace("<!-- results:a -->", "<!-- results:a --> <!-- results:a -->"),
])
def test_missing_or_repeated_markers_are_a_value_error(broken):
    name = "b" if broken.count("<!-- /results:b -->") == 2 else "a"
    with pytest.raises(ValueError, match=f"section '{name}' needs exactly one"):
        results_file.replace_section(broken, name, "x")


def test_end_marker_before_start_is_a_value_error():
    swapped = TEXT.replace("<!-- results:b -->", "@@").replace(
        "<!-- /results:b -->", "<!-- results:b -->").replace("@@", "<!-- /results:b -->")
    with pytest.raises(ValueError, match="comes before"):
        results_file.replace_section(swapped, "b", "x")


def test_a_body_holding_markers_is_refused():
    with pytest.raises(ValueError, match="marker of section 'b'"):
        results_file.replace_section(TEXT, "a", "x\n<!-- /results:b -->\n")


def test_bad_section_names_are_refused():
    for name in ("", "A", "a b", "a-->"):
        with pytest.raises(ValueError, match="section name"):
            results_file.replace_section(TEXT, name, "x")


def test_write_section_rewrites_the_file_in_place(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text(TEXT)
    results_file.write_section("b", "new b", path)
    assert path.read_text() == TEXT.replace("old b", "new b")
    with pytest.raises(ValueError):
        results_file.write_section("zzz", "x", path)
    assert path.read_text() == TEXT.replace("old b", "new b")  # untouched by the failed write


def test_provenance_names_date_cpu_cores_load_and_versions():
    line = results_file.provenance("python benchmarks/x.py")
    for part in ("Measured 20", " UTC by `python benchmarks/x.py` on ", " cores, load average ",
                 "TensorFlow ", "Keras ", "onnxruntime "):
        assert part in line, (part, line)


def test_recording_writes_what_was_printed_into_the_section(tmp_path, capsys):
    path = tmp_path / "RESULTS.md"
    path.write_text(TEXT)
    args = types.SimpleNamespace(write_results="a", results_file=str(path))
    with results_file.recording(args):
        print("| T | x |\n|---|---|\n| 1 | 3.00x |")
    body = results_file.get_section(path.read_text(), "a")
    assert body.startswith("\nMeasured ") and body.endswith("| 1 | 3.00x |\n")
    assert results_file.get_section(path.read_text(), "b") == "\nold b\n"
    assert "| 1 | 3.00x |" in capsys.readouterr().out  # still printed


def test_recording_checks_the_section_before_the_run(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text(TEXT)
    ran = []
    with pytest.raises(ValueError, match="no section 'nope'"):
        with results_file.recording(types.SimpleNamespace(write_results="nope", results_file=str(path))):
            ran.append(True)
    assert not ran and path.read_text() == TEXT


def test_the_repository_results_file_has_each_run_all_section_once():
    run_all = importlib.import_module("run_all")
    text = (BENCH / "RESULTS.md").read_text()
    names = results_file.section_names(text)
    assert len(names) == len(set(names))
    for name in run_all.FULL:
        results_file.get_section(text, name)  # raises if missing or broken
        assert f"## {run_all.TITLES[name]}: `python benchmarks/run_all.py --only {name}`" in text
    for name in names:
        assert results_file.get_section(text, name).lstrip().startswith("Measured "), name


def test_run_all_only_rewrites_its_own_section(tmp_path, monkeypatch):
    run_all = importlib.import_module("run_all")
    out = tmp_path / "RESULTS.md"
    out.write_text((BENCH / "RESULTS.md").read_text())
    original = out.read_text()

    def fake_run(cmd, **kwargs):  # writes what bench_export.py would, without measuring
        md, js = cmd[cmd.index("--markdown") + 1], cmd[cmd.index("--json") + 1]
        pathlib.Path(md).write_text("| format | ours ms |\n|---|---|\n| tflite | 9.999 |\n")
        pathlib.Path(js).write_text(json.dumps({"rows": [
            {"format": "tflite", "ours_ms": 9.999, "hub_ms": 1.0}]}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(run_all.subprocess, "run", fake_run)
    assert run_all.main(["--only", "export", "--output", str(out)]) == 0
    text = out.read_text()
    body = results_file.get_section(text, "export")
    assert "| tflite | 9.999 |" in body and "9.999 ms vs 1.000 ms -> MISSED" in body
    assert "`python benchmarks/run_all.py --only export`" in body.splitlines()[1]
    assert results_file.replace_section(text, "export", results_file.get_section(original, "export")) == original


def test_the_results_figures_are_drawn_from_the_file(tmp_path):
    make_figures = _load_make_figures()
    make_figures.draw_results_attention(tmp_path / "a.png")
    make_figures.draw_results_runtimes(tmp_path / "r.png")
    assert (tmp_path / "a.png").stat().st_size > 10_000 and (tmp_path / "r.png").stat().st_size > 10_000
    header, rows = make_figures.section_tables("attention")[0]
    assert "Keras / ours" in header and len(rows) == 16
    stripped = tmp_path / "RESULTS.md"
    text = (BENCH / "RESULTS.md").read_text()
    stripped.write_text(text.replace("<!-- results:litertlm_speed -->", ""))
    with pytest.raises(ValueError, match="litertlm_speed"):
        make_figures.draw_results_runtimes(tmp_path / "x.png", results_md=stripped)


def _load_make_figures():
    spec = importlib.util.spec_from_file_location(
        "make_figures", BENCH.parent / "docs" / "make_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
