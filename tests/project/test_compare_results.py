"""benchmarks/compare_results.py: rows matched by their key columns, ratios compared."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location(
        "compare_results", ROOT / "benchmarks" / "compare_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLE = """# Benchmark results

## Attention

| T | case | ours ms | Keras ms | Keras / ours | peak (GiB) |
|---|---|---|---|---|---|
| 128 | self | 1.0 | 2.0 | {a}x | 0.50 |
| 512 | self | 4.0 | 6.0 | {b}x | 1.00 |

## Only here

| T | x / y |
|---|---|
| 1 | 2.00x |
"""


def test_rows_match_on_keys_and_ratios_divide(tmp_path):
    before, after = tmp_path / "before.md", tmp_path / "after.md"
    before.write_text(TABLE.format(a="2.00", b="1.50"))
    after.write_text(TABLE.format(a="1.00", b="1.50").replace("## Only here", "## Other"))
    lines = _module().compare(before, after)
    assert "### Attention" in lines and not any("Only here" in line or "Other" in line
                                                 for line in lines)
    assert "| 128 | self | Keras / ours | 2.00x | 1.00x | 0.50 |" in lines
    assert "| 512 | self | Keras / ours | 1.50x | 1.50x | 1.00 |" in lines
    assert "| 512 | self | peak (GiB) | 1.00 | 1.00 | 1.00 |" in lines
    summary = [line for line in lines if line.startswith("Ratios")]
    assert summary == ["Ratios (ours vs peer), after / before: 2 rows, min 0.50, "
                       "median 1.00, max 1.00."]
