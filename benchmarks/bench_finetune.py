"""LoRA fine-tuning at real size (issue 52): keras_attn beside PEFT on
transformers/torch, tokens/s and peak memory per training configuration.

Both sides train the same random-bfloat16 checkpoint folder in a published
configuration (bench_real_size.py writes it; `--work` reuses it), with the
weights and compute in each `--dtypes` entry (float32, or bfloat16 with
float32 adapters on both sides), ours on each `--backends` entry:

- ours: `keras_attn.convert.from_huggingface(folder, dtype=)`, `enable_lora(rank,
  target_names)`, `compile(AdamW(1e-4), SparseCategoricalCrossentropy(
  from_logits=True))`, `train_on_batch` (what `fit` runs per step); with
  `+savers`, `CausalLMLoss(chunk_size=--chunk)` (the head applied chunk by
  chunk, rematerialised) and `set_block_remat(True)` (each decoder block
  rematerialised); with `+chunked`, the chunked loss and the first
  `--remat-blocks` blocks rematerialised (none by default: the logits'
  memory saved without a second forward pass); `--attention blocked` runs
  ours on the blocked attention kernel (`keras_attn.ops.chunked`, whose
  backward pass recomputes score blocks instead of holding T x T tensors);
- PEFT: `AutoModelForCausalLM.from_pretrained(folder, dtype=)`,
  `get_peft_model(LoraConfig(r=rank, target_modules=...))` (adapters in
  float32 over a bfloat16 model: PEFT's `autocast_adapter_dtype`),
  `torch.optim.AdamW(lr=1e-4)`, `model(input_ids, labels=input_ids).loss`,
  backward, step.

Each configuration runs in a fresh process (`--lock FILE`: under `flock
FILE`, for machines where big jobs take turns). The batches are random ids,
every token a target. tokens/s counts `batch x length` per step over
`--steps` steps after `--warmup` steps (tracing and first allocations).
Peak RSS is the child's `ru_maxrss` (from `wait4`), loading included;
`loaded` is its RSS once the model is built and adapted (free heap pages
handed back), before the first step; `train peak` is the peak RSS during the
steps alone (VmHWM restarted after loading), so `train peak - loaded` is what
training adds (activations, logits, gradients, optimizer state).

    python benchmarks/bench_finetune.py --models qwen2.5-0.5b --lock /tmp/bigmem.lock
    python benchmarks/bench_finetune.py --quick
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import _common  # first: it sets the environment
import results_file  # noqa: E402

import bench_real_size  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GB = 1e9
TARGETS = {
    "qv": ("q_proj", "v_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
SHAPES = ((2, 256), (4, 512), (1, 2048))
SIDES = ("keras_attn", "keras_attn+savers", "keras_attn+chunked", "peft")
# int8: ours converts in float32, `quantize("int8")`, then adapts (a frozen
# int8 base, float32 compute); PEFT has no int8 base on a CPU (bitsandbytes'
# is for GPUs), so those rows stand beside PEFT's float32 run.
DTYPES = ("float32", "bfloat16", "int8")
BACKENDS = ("tensorflow", "jax", "torch")


def _rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak():
    """Hands the heap's free pages back (loading's temporaries) and restarts
    the kernel's peak-RSS count (VmHWM) from the current RSS, so the peak
    read after the steps is training's alone, not loading's."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _batch(vocab, batch, length):
    import numpy as np

    ids = np.random.default_rng(0).integers(0, vocab, (batch, length + 1)).astype("int32")
    return ids[:, :-1], ids[:, 1:], np.ones((batch, length), "float32")


def child_keras(args, folder, vocab):
    import keras

    from keras_attn.convert import from_huggingface
    from keras_attn.generation.lm_loss import CausalLMLoss

    lm = from_huggingface(folder, dtype="float32" if args.dtypes == "int8" else args.dtypes)
    if args.dtypes == "int8":
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras names each layer it cannot quantize
            lm.quantize("int8")
    lm.enable_lora(args.rank, target_names=TARGETS[args.targets])
    if args.side in ("keras_attn+savers", "keras_attn+chunked"):
        loss = CausalLMLoss(chunk_size=args.chunk)
        lm.set_block_remat(True if args.side == "keras_attn+savers" else args.remat_blocks)
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    lm.compile(keras.optimizers.AdamW(1e-4), loss=loss)
    x, y, w = _batch(vocab, args.batch, args.length)

    def step():
        return float(lm.train_on_batch(x, y, sample_weight=w))

    return step


def child_peft(args, folder, vocab):
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtypes))
    model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, target_modules=list(TARGETS[args.targets])))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    x, _, _ = _batch(vocab, args.batch, args.length)
    ids = torch.tensor(x, dtype=torch.long)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return float(loss)

    return step


def run_child_side(args):
    name = args.models
    folder = bench_real_size._paths(args, name)["checkpoint"]
    vocab = bench_real_size.MODELS[name]["config"]["vocab_size"]
    start = time.perf_counter()
    step = (child_peft if args.side == "peft" else child_keras)(args, folder, vocab)
    load_seconds = time.perf_counter() - start
    _reset_peak()
    loaded = _rss_bytes()
    losses = [step() for _ in range(args.warmup)]
    start = time.perf_counter()
    losses += [step() for _ in range(args.steps)]
    seconds = time.perf_counter() - start
    return {"tokens_per_s": args.batch * args.length * args.steps / seconds, "loaded": loaded,
            "load_seconds": load_seconds, "step_seconds": seconds / args.steps,
            "loss": losses[-1], "train_peak": _common.peak_rss_kib() * 1024}


def run_child(args, name, side, targets, batch, length, dtype, backend):
    """One configuration in a fresh process; its result with the child's ru_maxrss."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", side, "--models", name,
           "--work", args.work, "--targets", targets, "--batch", str(batch), "--length", str(length),
           "--rank", str(args.rank), "--chunk", str(args.chunk), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--dtypes", dtype, "--remat-blocks", str(args.remat_blocks)]
    if args.lock:
        cmd = ["flock", args.lock] + cmd
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    result = {"model": name, "side": side, "targets": targets, "batch": batch, "length": length,
              "dtype": dtype, "backend": backend}
    if side == "keras_attn+chunked" and args.remat_blocks:
        result["remat_blocks"] = args.remat_blocks
    if args.attention != "auto" and side != "peft":
        env["KERAS_ATTN_ATTENTION_IMPLEMENTATION"] = result["attention"] = args.attention
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=HERE, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        out.seek(0)
        err.seek(0)
        lines = out.read().strip().splitlines()
        result["ru_maxrss"] = usage.ru_maxrss * 1024
        if os.waitstatus_to_exitcode(status) != 0 or not lines:
            result["error"] = (err.read().strip().splitlines() or ["?"])[-1][:200]
        else:
            result.update(json.loads(lines[-1]))
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def _side(r):
    """The side, with how many blocks its run rematerialised where not all
    or none, and its attention kernel where forced."""
    notes = ([f"first {r['remat_blocks']} blocks remat"] if r.get("remat_blocks") else []) + (
        [f"{r['attention']} attention"] if r.get("attention") else [])
    return r["side"] + (f" ({', '.join(notes)})" if notes else "")


def _ratio(a, b):
    return f"{a / b:.2f}" if a and b else ""


def table(results):
    """One row per run; ours beside PEFT's run of the same model, targets,
    shape and dtype that follows it (an invocation writes ours, then
    PEFT's), else the last one before it. Lines of older runs (no dtype or
    backend) were float32 on TensorFlow."""
    rows = [("| model | LoRA targets | batch x length | dtype | side | backend | tokens/s | peak RSS GB "
             "| loaded GB | train peak GB | speed ours / PEFT | peak ours / PEFT |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def key(r):
        dtype = r.get("dtype", "float32")
        return r["model"], r["targets"], r["batch"], r["length"], "float32" if dtype == "int8" else dtype

    peft = [(i, r) for i, r in enumerate(results) if r["side"] == "peft" and "error" not in r]

    def peer_of(i, r):
        """PEFT's run of the same configuration next after this one (a run
        writes ours, then PEFT's), else the last before it."""
        same = [(j, p) for j, p in peft if key(p) == key(r)]
        after = [p for j, p in same if j > i]
        return after[0] if after else (same[-1][1] if same else None)

    for i, r in enumerate(results):
        head = (f"| {r['model']} | {r['targets']} | {r['batch']}x{r['length']} | {r.get('dtype', 'float32')} "
                f"| {_side(r)} "
                f"| {'torch' if r['side'] == 'peft' else r.get('backend', 'tensorflow')} ")
        if "error" in r:
            rows.append(f"{head}| error: {r['error']} | {r['ru_maxrss'] / GB:.2f} | | | | |")
            continue
        peer = peer_of(i, r) if r["side"] != "peft" else None
        rows.append(
            f"{head}| {r['tokens_per_s']:.0f} "
            f"| {r['ru_maxrss'] / GB:.2f} | {r['loaded'] / GB:.2f} | {r['train_peak'] / GB:.2f} "
            f"| {_ratio(r['tokens_per_s'], peer and peer['tokens_per_s'])} "
            f"| {_ratio(r['ru_maxrss'], peer and peer['ru_maxrss'])} |")
    return "\n".join(rows)


def _conditions(args, machine):
    return (f"Conditions: {machine}; bfloat16 rows: weights and compute in bfloat16, LoRA adapters "
            f"float32 (both sides); int8 rows: ours `quantize('int8')` before `enable_lora` (int8 frozen "
            f"kernels, float32 compute and adapters), beside PEFT's float32 run; LoRA rank {args.rank}; "
            f"{args.warmup} warm-up + {args.steps} timed steps; savers: CausalLMLoss(chunk_size="
            f"{args.chunk}) + set_block_remat(True); chunked: CausalLMLoss(chunk_size={args.chunk}), and "
            "set_block_remat(n) where the side names n blocks")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen2.5-0.5b", help="comma-separated, from bench_real_size.MODELS")
    parser.add_argument("--targets", default="qv,all", help=f"comma-separated, of {sorted(TARGETS)}")
    parser.add_argument("--shapes", default=",".join(f"{b}x{t}" for b, t in SHAPES),
                        help="comma-separated batch x length")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {list(SIDES)}")
    parser.add_argument("--rows", help="instead of --models x --targets x --shapes: comma-separated "
                        "MODEL:TARGETS:BxT, run in this order")
    parser.add_argument("--dtypes", default="float32", help=f"comma-separated, of {list(DTYPES)}")
    parser.add_argument("--backends", default="tensorflow",
                        help=f"our sides' Keras backends, comma-separated, of {list(BACKENDS)}")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=128, help="CausalLMLoss chunk_size (+savers)")
    parser.add_argument("--remat-blocks", type=int, default=0,
                        help="+chunked: how many blocks (the first) are rematerialised")
    parser.add_argument("--attention", default="auto",
                        help="ours: the attention kernel, of keras_attn.config.IMPLEMENTATIONS ('blocked' "
                             "keeps no T x T tensor for the backward pass)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "keras_attn_real_size"),
                        help="checkpoints (shared with bench_real_size.py)")
    parser.add_argument("--shard-gb", type=float, default=5.0, help=argparse.SUPPRESS)
    parser.add_argument("--lock", help="run each child under `flock LOCK`")
    parser.add_argument("--quick", action="store_true",
                        help="tiny-llama, 2x16, our two sides, in a temporary --work (no peers needed)")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--from-log", help="no run: the table of the result lines (one JSON object "
                        "each, as every run prints to stderr per child) in this file, e.g. of a run cut short")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    results_file.add_argument(parser)
    args = parser.parse_args(argv)
    if args.child:
        args.side = args.child
        print(json.dumps(run_child_side(args)))
        return
    results_file.start(args)
    if args.from_log:
        with open(args.from_log) as f:
            results = [json.loads(line) for line in f if line.startswith('{"model"')]
        machine = "from the result lines of runs (each configuration a fresh process)"
        _common.emit("\n".join([_conditions(args, machine), "", table(results)]), args, results=results)
        return
    if args.quick:
        args.models, args.targets, args.shapes = "tiny-llama", "qv", "2x16"
        args.sides, args.steps, args.warmup = "keras_attn,keras_attn+savers", 1, 1
        args.chunk = 8
        args.work = tempfile.mkdtemp(prefix="finetune_")
    sides = args.sides.split(",")
    if args.rows:
        rows = [row.split(":") for row in args.rows.split(",")]
    else:
        rows = [(name, target, shape) for name in args.models.split(",")
                for target in args.targets.split(",") for shape in args.shapes.split(",")]
    rows = [(name, target, tuple(int(v) for v in shape.split("x"))) for name, target, shape in rows]
    models = list(dict.fromkeys(name for name, _, _ in rows))
    targets = list(dict.fromkeys(target for _, target, _ in rows))
    dtypes, backends = args.dtypes.split(","), args.backends.split(",")
    from keras_attn import config

    _common.check_known(parser, ((models, bench_real_size.MODELS, "--models"),
                                 (targets, TARGETS, "--targets"), (sides, SIDES, "--sides"),
                                 (dtypes, DTYPES, "--dtypes"), (backends, BACKENDS, "--backends"),
                                 ([args.attention], config.IMPLEMENTATIONS, "--attention")))
    results = []
    try:
        for name in models:
            paths = bench_real_size._paths(args, name)
            if not os.path.isdir(paths["checkpoint"]):
                os.makedirs(paths["work"], exist_ok=True)
                made = bench_real_size.run_child(
                    argparse.Namespace(work=args.work, shard_gb=args.shard_gb, prompt=0, new=0, rounds=0,
                                       dtype=None, max_rss_gb=20.0), name, "checkpoint")
                if "error" in made:
                    parser.error(f"writing the {name} checkpoint failed: {made['error']}")
        for name, target, (batch, length) in rows:
            for dtype in dtypes:
                for side in sides:
                    if side == "peft" and dtype == "int8":
                        continue
                    for backend in (["torch"] if side == "peft" else backends):
                        results.append(run_child(args, name, side, target, batch, length, dtype, backend))
    finally:
        if args.quick:
            import shutil

            shutil.rmtree(args.work, ignore_errors=True)
    lines = [_conditions(args, _common.conditions()), "", table(results)]
    _common.emit("\n".join(lines), args, results=results)
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
