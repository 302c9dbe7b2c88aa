"""Every measured figure README.md and the docs quote is in benchmarks/RESULTS.md.

Which text is read:

- README.md: all of it outside fenced code blocks.
- docs/*.md and docs/guides/*.md: every sentence containing "measured" (any case) or
  citing `RESULTS.md`, and,
  when the paragraph holding such a sentence ends with ":" and a table follows it, that
  table's cells. Not read: docs/benchmarks.md and docs/changelog.md (they include
  RESULTS.md and CHANGELOG.md themselves) and docs/examples.md (the examples' own
  results, produced by benchmarks/bench_examples.py, not by a benchmark in RESULTS.md).

Which figures: ratios (`1.21x`, `0.23-0.82x`, `1.19x-1.46x`: a range is checked end
by end), memory (`GiB`, `GB`, `MiB`, `MB`, `KiB`) and times (`ms`, `s`), including
`A / B unit` and `A vs B unit` pairs.

When a figure counts as found: RESULTS.md holds the same kind of figure (the same
unit, or a ratio) whose value, rounded to the decimals the quote shows, equals the
quote (`1.3x` is found as `1.302x`, `0.98x` as `0.981x`); a quote without decimals
needs that integer exactly. In RESULTS.md a number also carries a unit when it sits in
a table column whose header names the unit (`ours peak RSS (GiB)`, `prefill ms`,
`export s`), and is a ratio in a column of ratios (`4096 / 512`, `Keras / ours`,
`time vs full causal`).
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
NOT_READ = {"benchmarks.md", "changelog.md", "examples.md"}

NUM = r"\d+(?:\.\d+)?"
SEP = r"\s*(?:-|–|to|/|vs)\s*"
EDGE = r"(?<![\w.\-/^])"  # not part of a longer token (8x8, 2048^3, T=512x)
RATIO = re.compile(rf"{EDGE}({NUM})(?:x?{SEP}({NUM}))?x(?![\w])")
UNITS = ("GiB", "GB", "MiB", "MB", "KiB", "ms", "s")
QUANTITY = re.compile(rf"{EDGE}({NUM})(?:{SEP}({NUM}))?\s?({'|'.join(UNITS)})(?![\w/])")
HEADER_RATIO = re.compile(r"\S\s/\s\S|speed-up|\bvs\b")
HEADER_UNIT = re.compile(r"\b(GiB|GB|MiB|MB|KiB|ms)\b|(?<![/\w])s\b(?!/)|\bseconds\b")


def figures(text):
    """`[(kind, value text)]`: kind is "x" for a ratio or the unit."""
    found = []
    for m in RATIO.finditer(text):
        found += [("x", v) for v in m.groups() if v]
    for m in QUANTITY.finditer(text):
        found += [(m.group(3), v) for v in m.groups()[:2] if v]
    return found


def _table_cells(lines):
    """`[(header, cell)]` of the markdown table made of `lines`."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    if len(rows) < 2:
        return []
    header = rows[0]
    return [(header[i] if i < len(header) else "", cell)
            for row in rows[2:] for i, cell in enumerate(row)]


def _strip_code(lines):
    out, fenced = [], False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return out


def results_index():
    """`{kind: [value text]}` of every figure in RESULTS.md (prose, cells, headed columns)."""
    index = {}
    lines = RESULTS.read_text().splitlines()
    for kind, value in figures("\n".join(lines)):
        index.setdefault(kind, []).append(value)
    i = 0
    while i < len(lines):
        if lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            for header, cell in _table_cells(lines[i:j]):
                m = HEADER_UNIT.search(header)
                if m:
                    unit = m.group(1) or "s"
                elif HEADER_RATIO.search(header) and "/s" not in header:
                    unit = "x"
                else:
                    continue
                for number in re.findall(rf"{EDGE}{NUM}(?![\w.])", cell):
                    index.setdefault(unit, []).append(number)
            i = j
        else:
            i += 1
    return index


def _decimals(value):
    return len(value.split(".")[1]) if "." in value else 0


def is_found(kind, value, index):
    quoted, places = float(value), _decimals(value)
    for candidate in index.get(kind, []):
        if _decimals(candidate) < places:
            continue
        if places == 0:
            if float(candidate) == quoted:
                return True
        elif round(float(candidate), places) == quoted:
            return True
    return False


def _paragraphs(lines):
    """`[(first line number, [lines])]` of prose paragraphs and tables, blank-line separated."""
    blocks, current, start = [], [], None
    for number, line in enumerate(lines, 1):
        is_table = line.startswith("|")
        starts_new = (not line.strip() or line.startswith("#")
                      or (current and is_table != current[-1].startswith("|"))
                      or (line.lstrip().startswith(("- ", "* ")) and not is_table))
        if starts_new and current:
            blocks.append((start, current))
            current = []
        if line.strip() and not line.startswith("#"):
            if not current:
                start = number
            current.append(line)
    if current:
        blocks.append((start, current))
    return blocks


def quoted_figures():
    """`[(file, line, kind, value, context)]` of every figure the rule above reads."""
    out = []
    readme = _strip_code(ROOT.joinpath("README.md").read_text().splitlines())
    for number, line in enumerate(readme, 1):
        for kind, value in figures(line):
            out.append(("README.md", number, kind, value, line.strip()))
    docs = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "guides").glob("*.md"))
    for path in docs:
        if path.name in NOT_READ:
            continue
        name = path.relative_to(ROOT).as_posix()
        lines = _strip_code(path.read_text().splitlines())
        blocks = _paragraphs(lines)
        for k, (start, block) in enumerate(blocks):
            if block[0].startswith("|"):
                continue
            text = " ".join(line.strip() for line in block)
            sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z`(*\[])", text)
            measured = [s for s in sentences if "measured" in s.lower() or "RESULTS.md" in s]
            for sentence in measured:
                for kind, value in figures(sentence):
                    line = next((start + i for i, l in enumerate(block) if value in l), start)
                    out.append((name, line, kind, value, sentence))
            following = blocks[k + 1] if k + 1 < len(blocks) else None
            if measured and text.rstrip().endswith(":") and following and following[1][0].startswith("|"):
                table_start, table = following
                for i, line in enumerate(table):
                    if i < 2:
                        continue
                    for kind, value in figures(line):
                        out.append((name, table_start + i, kind, value, line.strip()))
    return out


def test_every_quoted_figure_is_in_the_results_file():
    index = results_index()
    missing = [f"{name}:{line}: {value}{'x' if kind == 'x' else ' ' + kind}  ({context[:120]})"
               for name, line, kind, value, context in quoted_figures()
               if not is_found(kind, value, index)]
    assert not missing, "figures not in benchmarks/RESULTS.md:\n" + "\n".join(missing)


def test_the_readme_claims_are_read():
    """The reader sees the README's claims (so the test above can fail on them)."""
    quoted = {(kind, value) for name, _, kind, value, _ in quoted_figures() if name == "README.md"}
    assert len(quoted) >= 10
    assert ("x", "1.21") in quoted and ("GiB", "1.11") in quoted and ("ms", "0.371") in quoted


@pytest.mark.parametrize("text, expected", [
    ("is 1.21x faster", [("x", "1.21")]),
    ("in 0.23-0.82x the time", [("x", "0.23"), ("x", "0.82")]),
    ("1.19x-1.46x faster", [("x", "1.19"), ("x", "1.46")]),
    ("1.04 GiB at T=16384", [("GiB", "1.04")]),
    ("TFLite 0.71 vs 0.74 ms", [("ms", "0.71"), ("ms", "0.74")]),
    ("8.95 / 10.21 GB, 13.3 s", [("GB", "8.95"), ("GB", "10.21"), ("s", "13.3")]),
    ("8x8 digits, 2048^3 matmul, 32 tok/s, 5 steps", []),
])
def test_figure_reader(text, expected):
    assert figures(text) == expected


def test_a_figure_that_is_not_in_the_file_is_reported():
    index = results_index()
    assert is_found("x", "1.21", index) and is_found("GiB", "7.13", index)
    assert is_found("x", "1.3", index)  # 1.302x rounded to the quote's decimals
    assert not is_found("x", "1.74", index)  # the README's stale claim
    assert not is_found("GiB", "6.91", index) and not is_found("ms", "0.71", index)
