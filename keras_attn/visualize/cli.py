"""`keras-attn attention`: the attention maps of a saved model, as PNG and HTML."""

import os

import numpy as np


def _ids(args):
    if args.ids is not None:
        try:
            ids = [int(t) for t in args.ids.replace(",", " ").split()]
        except ValueError:
            raise SystemExit(f"--ids must be integers separated by commas or spaces. Received: {args.ids!r}")
        return ids, [str(t) for t in ids]
    if args.vocab is None:
        raise SystemExit("--text needs --vocab (a file with one token per line, line i = id i)")
    with open(args.vocab, encoding="utf-8") as f:
        vocab = [line.rstrip("\n") for line in f]
    index = {t: i for i, t in enumerate(vocab)}
    pieces = list(args.text) if args.split == "chars" else args.text.split()
    missing = sorted({p for p in pieces if p not in index})
    if missing:
        raise SystemExit(f"--text has tokens not in --vocab: {missing[:10]}")
    return [index[p] for p in pieces], pieces


def _feed(model, ids):
    """One row of ids for the model's inputs (converted BERT-style models
    also get an all-ones `attention_mask` and zero `token_type_ids`)."""
    batch = np.array([ids], np.int32)
    inputs = getattr(model, "inputs", None)
    if not inputs or len(inputs) == 1:
        return batch
    extra = {"attention_mask": np.ones_like(batch), "token_type_ids": np.zeros_like(batch)}
    feed = []
    for tensor in inputs:
        name = tensor.name.split(":")[0]
        if name in ("input_ids", "tokens", "token_ids") or name not in extra:
            feed.append(batch)
        else:
            feed.append(extra[name])
    return feed


def run(args):
    import keras

    import keras_attn  # noqa: F401  (registers the layers for loading)
    from keras_attn.visualize import attention_maps, html_view, plot_heads

    ids, tokens = _ids(args)
    model = keras.saving.load_model(args.model, safe_mode=not args.unsafe_deserialization)
    maps = attention_maps(model, _feed(model, ids))
    if not maps:
        raise SystemExit(f"{args.model} has no keras_attn attention layer to show.")
    os.makedirs(args.out, exist_ok=True)
    fig = plot_heads(maps, tokens)
    png = os.path.join(args.out, "attention_heads.png")
    fig.savefig(png, dpi=100)
    page = html_view(maps, tokens, os.path.join(args.out, "attention.html"),
                     title=os.path.basename(args.model))
    print(f"{len(maps)} attention maps: {', '.join(m.name for m in maps)}")
    print(f"wrote {png} and {page}")
    return 0
