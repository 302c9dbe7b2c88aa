"""Shared pieces of the benchmarks: environment, matmul ceiling, interleaved timing."""

import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# PyTorch's OpenMP threads otherwise keep spinning after each torch call and
# take CPU from whatever runs next in the interleaved rounds.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

# The tests' float32 bounds (rounding of the summed terms, not a constant that
# held on one CPU) check the benchmarks' own parity claims too.
from tests import tolerance  # noqa: E402,F401


def matmul_ceiling_gflops(n=2048, repeats=7):
    """Median GFLOP/s of an `n^3` float32 matmul in TensorFlow (graph mode): the ceiling."""
    import tensorflow as tf

    a = tf.constant(np.random.default_rng(0).normal(size=(n, n)).astype("float32"))
    f = tf.function(lambda a: tf.matmul(a, a))
    f(a).numpy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f(a).numpy()
        times.append(time.perf_counter() - start)
    return 2.0 * n**3 / float(np.median(times)) / 1e9


def ceiling_fn(n=2048):
    """A zero-argument function running one `n^3` matmul, and its FLOPs.

    Put it into the `interleaved` dict so the ceiling is measured under the
    same load as the code it is compared with.
    """
    import tensorflow as tf

    a = tf.constant(np.random.default_rng(0).normal(size=(n, n)).astype("float32"))
    f = tf.function(lambda a: tf.matmul(a, a))
    return (lambda: f(a)), 2.0 * n**3


def ort_session(source, threads=2):
    """An onnxruntime CPU session on `source` (a path or the model's bytes)
    with `threads` intra-op threads that do not spin-wait: the benchmarks
    run several sessions in turn in one process, and a session whose
    threads keep spinning after its call takes the cores from the next one
    (ModernBERT-base at 32 tokens after another session: 82 ms spinning,
    46 ms not; the same on its own: 45 ms either way)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _block(result):
    import tensorflow as tf

    for t in tf.nest.flatten(result):
        if hasattr(t, "numpy"):
            t.numpy()


def time_ms(fn, repeats, warmup=2, statistic=np.median):
    """`statistic` (median by default) of `repeats` calls of `fn`, in
    milliseconds, after `warmup` untimed calls (tracing, first allocations)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(statistic(times)) * 1e3


def interleaved(fns, repeats=5, calls=1, warmup=2):
    """Median seconds per call of each function in `fns` (a dict), run interleaved.

    Each function is warmed up (traced/compiled) first; then `repeats` rounds
    run every function `calls` times in turn, so that load from other
    processes hits all of them alike. The order rotates from round to round,
    so no function always runs right after the same one (e.g. after the
    ceiling matmul, which leaves the caches cold).
    """
    for f in fns.values():
        for _ in range(warmup):
            _block(f())
    samples = {name: [] for name in fns}
    names = list(fns)
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            f = fns[name]
            start = time.perf_counter()
            for _ in range(calls):
                out = f()
            _block(out)
            samples[name].append((time.perf_counter() - start) / calls)
    return {name: float(np.median(s)) for name, s in samples.items()}


def conditions():
    """One line describing the run: machine, load, versions."""
    import keras
    import tensorflow as tf

    load = os.getloadavg()
    return (
        f"{os.cpu_count()} CPUs, load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at start, "
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, float32, "
        f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'default (on)')}"
    )


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def emit(text, args, **raw):
    """Prints a result table and writes it (`--markdown`), the raw rows (`--json`) and,
    with `--write-results`, its section of RESULTS.md (see results_file.py)."""
    import json

    import results_file

    print(text)
    results_file.finish(args, text)
    if getattr(args, "markdown", None):
        with open(args.markdown, "w") as f:
            f.write(text)
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


def peak_rss_kib():
    """This process's peak resident set (VmHWM).

    Not `ru_maxrss`: on Linux that survives fork+exec, so a child would report
    its parent's peak if the parent was bigger.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def time_self_attention(layer, x, mode, repeats, **call_kwargs):
    """Median warm seconds of `layer(x, x, **call_kwargs)` in a `tf.function`:
    the forward pass ("fwd") or it and the gradients w.r.t. `x` and every
    weight ("fwd+bwd"); the first (tracing) call is not counted."""
    import tensorflow as tf

    @tf.function
    def fwd(x):
        return tf.reduce_sum(layer(x, x, **call_kwargs))

    @tf.function
    def fwd_bwd(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.square(layer(x, x, **call_kwargs)))
        return tape.gradient(loss, [x] + layer.trainable_variables)

    fn = fwd if mode == "fwd" else fwd_bwd
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        out = fn(x)
        _ = [np.asarray(o) for o in tf.nest.flatten(out)]
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def check_known(parser, choices):
    """`parser.error` for the first `(values, known, flag)` with a value not in `known`."""
    for values, known, flag in choices:
        unknown = [v for v in values if v not in known]
        if unknown:
            parser.error(f"{flag}: unknown {unknown}; expected some of {list(known)}")


def add_llm_size_args(parser, *, prompt=128, new=128, rounds=5):
    """The LLM runtime benchmarks' model and run sizes (`--quick`: a small model).

    Call `apply_quick(args)` after parsing.
    """
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", type=int, default=prompt)
    parser.add_argument("--new", type=int, default=new)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--quick", action="store_true",
                        help="2 layers, hidden 128, vocabulary 4000, 32 + 32 tokens, 3 rounds")
    parser.add_argument("--json", help="write the results here")


def apply_quick(args):
    if args.quick:
        args.layers, args.hidden, args.heads, args.kv_heads = 2, 128, 4, 2
        args.vocab, args.prompt, args.new, args.rounds = 4000, 32, 32, 3
    return args
