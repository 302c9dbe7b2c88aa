"""Section-scoped writes to benchmarks/RESULTS.md.

Each section of the results file sits between two marker comments:

    ## Title: `python benchmarks/<script>.py --write-results`

    <!-- results:NAME -->
    ...the table and its provenance line...
    <!-- /results:NAME -->

`replace_section` swaps the text between one pair of markers and leaves every
other byte of the file as it was, so regenerating one benchmark cannot drop or
reorder another one's table. The heading stays outside the markers: it names
the command, which a rerun does not change.
"""

import contextlib
import datetime
import io
import os
import platform
import re
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
_NAME = re.compile(r"^[a-z0-9_]+$")


def _markers(name):
    if not _NAME.match(name or ""):
        raise ValueError(f"section name {name!r}: use lowercase letters, digits and '_'")
    return f"<!-- results:{name} -->", f"<!-- /results:{name} -->"


def section_names(text):
    """Names of the sections marked in `text`, in file order."""
    return re.findall(r"<!-- results:([a-z0-9_]+) -->", text)


def get_section(text, name):
    """The text between `name`'s markers (without the markers' own lines)."""
    start, end = _span(text, name)
    return text[start:end]


def _span(text, name):
    open_mark, close_mark = _markers(name)
    if text.count(open_mark) != 1 or text.count(close_mark) != 1:
        known = ", ".join(section_names(text)) or "none"
        if open_mark not in text:
            raise ValueError(f"no section {name!r} in the results file (sections: {known})")
        raise ValueError(
            f"section {name!r} needs exactly one {open_mark} and one {close_mark} "
            f"(found {text.count(open_mark)} and {text.count(close_mark)})")
    start = text.index(open_mark) + len(open_mark)
    end = text.index(close_mark)
    if end < start:
        raise ValueError(f"section {name!r}: {close_mark} comes before {open_mark}")
    return start, end


def replace_section(text, name, body):
    """`text` with `name`'s section replaced by `body`; nothing else changes."""
    start, end = _span(text, name)
    body = body.strip("\n")
    for other in section_names(body) + re.findall(r"<!-- /results:([a-z0-9_]+) -->", body):
        raise ValueError(f"the new body of {name!r} contains a marker of section {other!r}")
    return text[:start] + "\n" + body + "\n" + text[end:]


def write_section(name, body, path=RESULTS):
    """Replaces section `name` of the file at `path` (atomically)."""
    with open(path) as f:
        text = f.read()
    new = replace_section(text, name, body)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)
    return path


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _version(module):
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or broken: say so instead of failing the run
        return "not installed"


def provenance(command, started=None):
    """One line: when, on what and with which versions the section was measured."""
    started = started or datetime.datetime.now(datetime.timezone.utc)
    load = os.getloadavg()
    return (
        f"Measured {started:%Y-%m-%d %H:%M} UTC by `{command}` on {cpu_model()}, "
        f"{os.cpu_count()} cores, load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} "
        f"at the start; TensorFlow {_version('tensorflow')}, Keras {_version('keras')}, "
        f"onnxruntime {_version('onnxruntime')}; "
        f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'default (on)')}."
    )


def command_line(argv=None):
    """The command as typed, for the provenance line (`python benchmarks/x.py ...`)."""
    argv = list(sys.argv if argv is None else argv)
    script = os.path.relpath(os.path.abspath(argv[0]), os.path.dirname(os.path.dirname(RESULTS)))
    return " ".join(["python", script, *argv[1:]])


def add_argument(parser, default=None):
    """`--write-results [SECTION]`: write this run's tables into RESULTS.md's section SECTION.

    Call `start(args)` right after parsing, so a wrong name fails before the run.
    """
    kwargs = dict(nargs="?", const=default) if default else {}
    parser.add_argument(
        "--write-results", default=None, metavar="SECTION", **kwargs,
        help="replace section SECTION" + (f" (default {default!r})" if default else "")
             + " of benchmarks/RESULTS.md with this run's tables; the other sections stay as they are")
    parser.add_argument("--results-file", default=RESULTS,
                        help="the file --write-results writes into (default benchmarks/RESULTS.md)")


def start(args):
    """Checks `--write-results`'s section and notes the run's provenance (its start)."""
    name = getattr(args, "write_results", None)
    if name:
        with open(args.results_file) as f:
            _span(f.read(), name)
        args.results_provenance = provenance(command_line())
    return args


def finish(args, text):
    """Writes `text` under the provenance line into the section, with `--write-results`."""
    name = getattr(args, "write_results", None)
    if name:
        write_section(name, args.results_provenance + "\n\n" + text.strip("\n"), args.results_file)
        print(f"wrote section {name!r} of {args.results_file}")


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for stream in self.streams:
            stream.write(s)
        return len(s)

    def flush(self):
        for stream in self.streams:
            stream.flush()


@contextlib.contextmanager
def recording(args):
    """Prints as usual and, with `--write-results`, writes what was printed inside
    the block (after the provenance line) into the results file's section.

    Without an earlier `start(args)` the section is checked here, before the block runs.
    """
    if not getattr(args, "write_results", None):
        yield
        return
    if not hasattr(args, "results_provenance"):
        start(args)
    buffer = io.StringIO()
    stdout = sys.stdout
    sys.stdout = _Tee(stdout, buffer)
    try:
        yield
    finally:
        sys.stdout = stdout
    finish(args, buffer.getvalue())
