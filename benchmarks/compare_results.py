"""Compares two `run_all.py` result files row by row.

    python benchmarks/compare_results.py BEFORE.md AFTER.md [--markdown OUT.md]

For every table present in both files, rows are matched on their leading
text columns (T, case, block, mode, ...), and every ratio column (values
like `1.53x`) and peak-memory column (GiB) is printed before, after and
after / before. Ratios are ours-vs-peer figures measured within one run, so
comparing them across runs cancels most of the machine's speed; their spread
between two runs of the same code is the noise to read the result against.
"""

import argparse
import re

_NUMBER = re.compile(r"^-?\d+(\.\d+)?x?$")


def tables(path):
    """`{section title: (header, rows)}` of the first table in each `## ` section."""
    found, title, header, rows = {}, None, None, []
    for line in open(path).read().splitlines() + [""]:
        if line.startswith("## "):
            title, header, rows = line[3:], None, []
            continue
        if title is None or title in found:
            continue
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
            elif not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif header is not None:
            found[title] = (header, rows)
    return found


def _key_width(header, rows):
    """Number of leading columns that identify a row (text, or T / n sizes)."""
    width = 0
    for i, name in enumerate(header):
        values = [r[i] for r in rows if i < len(r)]
        sizes = name in ("T", "n")
        if sizes or not all(_NUMBER.match(v) for v in values if v not in ("-", "n/a")):
            width = i + 1
        else:
            break
    return width


def _compared_columns(header):
    return [i for i, name in enumerate(header)
            if ("/" in name and "GFLOP/s" not in name) or "speed-up" in name or "GiB" in name]


def _value(cell):
    cell = cell.rstrip("x")
    try:
        return float(cell)
    except ValueError:
        return None


def compare(before_path, after_path):
    """Markdown lines: one table per section present in both files."""
    before, after = tables(before_path), tables(after_path)
    lines = []
    for title, (header, rows_after) in after.items():
        if title not in before or before[title][0] != header:
            continue
        rows_before = before[title][1]
        width = _key_width(header, rows_after)
        columns = _compared_columns(header)
        if not columns:
            continue
        old = {tuple(r[:width]): r for r in rows_before}
        changes = []
        lines += [f"### {title}", "",
                  "| " + " | ".join(header[:width]) + " | figure | before | after | after / before |",
                  "|" + "---|" * (width + 4)]
        for row in rows_after:
            match = old.get(tuple(row[:width]))
            if match is None:
                continue
            for i in columns:
                a, b = _value(match[i]), _value(row[i])
                change = f"{b / a:.2f}" if a and b is not None else "-"
                if a and b is not None and match[i].endswith("x"):
                    changes.append(b / a)
                lines.append("| " + " | ".join(row[:width])
                             + f" | {header[i]} | {match[i]} | {row[i]} | {change} |")
        if changes:
            changes.sort()
            lines += ["", f"Ratios (ours vs peer), after / before: {len(changes)} rows, "
                      f"min {changes[0]:.2f}, median {changes[len(changes) // 2]:.2f}, "
                      f"max {changes[-1]:.2f}."]
        lines.append("")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--markdown", help="also write the tables to this file")
    args = parser.parse_args(argv)
    lines = compare(args.before, args.after)
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
