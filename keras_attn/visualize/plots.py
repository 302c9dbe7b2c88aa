"""Matplotlib pictures of attention maps: one head, or a grid of layers x heads."""

import numpy as np

from keras_attn.visualize.maps import AttentionMap


def _pyplot():
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "pdf", "svg", "ps", "cairo"):
        try:
            matplotlib.use("Agg")
        except Exception:  # noqa: BLE001 - an interactive backend already in use stays
            pass
    import matplotlib.pyplot as plt

    return plt


def _labels(tokens, length, name):
    if tokens is None:
        return [str(i) for i in range(length)]
    tokens = [str(t) for t in tokens]
    if len(tokens) != length:
        raise ValueError(
            f"`{name}` has {len(tokens)} labels for an axis of {length} positions. "
            f"Received: {name}={tokens!r}"
        )
    return tokens


def plot_attention(weights, query_tokens=None, key_tokens=None, *, ax=None, title=None,
                   cmap="viridis", padding=None):
    """Draws one `(T_q, T_k)` attention map with token labels on both axes.

    Args:
        weights: a `(T_q, T_k)` array (e.g. `attention_map.scores[b, h]`).
        query_tokens, key_tokens: labels of the rows and columns (defaults:
            positions); `key_tokens` defaults to `query_tokens` for square maps.
        ax: a matplotlib Axes to draw into (a new figure when None).
        title: the axes title.
        cmap: colour map.
        padding: optional `(T_k,)` bool, True for padded keys: their columns
            are hatched.

    Returns:
        The matplotlib `Figure`.
    """
    weights = np.asarray(weights)
    if weights.ndim != 2:
        raise ValueError(
            "plot_attention draws one head: `weights` must be (T_q, T_k). Received: "
            f"weights.shape={weights.shape}"
        )
    plt = _pyplot()
    if ax is None:
        size = (max(3.0, 0.35 * weights.shape[1] + 1.5), max(2.5, 0.35 * weights.shape[0] + 1.0))
        fig, ax = plt.subplots(figsize=size)
    fig = ax.figure
    if key_tokens is None and weights.shape[0] == weights.shape[1]:
        key_tokens = query_tokens
    rows = _labels(query_tokens, weights.shape[0], "query_tokens")
    cols = _labels(key_tokens, weights.shape[1], "key_tokens")
    ax.imshow(weights, cmap=cmap, vmin=0.0, vmax=max(float(weights.max()), 1e-9), aspect="auto")
    ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=7)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    if padding is not None:
        for j in np.flatnonzero(np.asarray(padding)):
            ax.axvspan(j - 0.5, j + 0.5, fill=False, hatch="///", edgecolor="0.6", linewidth=0)
    if title:
        ax.set_title(title, fontsize=8)
    return fig


def plot_heads(maps, tokens=None, *, key_tokens=None, batch_index=0, layers=None, heads=None,
               cmap="viridis", cell_size=1.6):
    """A grid of attention maps: one row per layer, one column per head.

    Args:
        maps: `AttentionMap`s (from `attention_maps`).
        tokens: labels of the query positions (and keys of self-attention).
        key_tokens: labels of the keys of cross-attention maps (where the key
            length differs from the query length).
        batch_index: which example of the batch.
        layers: indices or names of the maps to draw (default all).
        heads: head indices to draw (default all).
        cmap: colour map.
        cell_size: inches per map.

    Returns:
        The matplotlib `Figure` (save it with `fig.savefig("heads.png")`).
    """
    maps = list(maps)
    if not maps or not all(isinstance(m, AttentionMap) for m in maps):
        raise ValueError("`maps` must be a non-empty list of AttentionMap (see attention_maps).")
    if layers is not None:
        by_name = {m.name: m for m in maps}
        maps = [by_name[layer] if isinstance(layer, str) else maps[layer] for layer in layers]
    num_heads = max(m.num_heads for m in maps)
    heads = list(range(num_heads)) if heads is None else list(heads)
    plt = _pyplot()
    fig, axes = plt.subplots(len(maps), len(heads), squeeze=False,
                             figsize=(cell_size * len(heads) + 1, cell_size * len(maps) + 0.5))
    for row, m in enumerate(maps):
        scores = m.scores[batch_index]
        keys = tokens if scores.shape[-1] == scores.shape[-2] else key_tokens
        for col, h in enumerate(heads):
            ax = axes[row, col]
            if h >= m.num_heads:
                ax.axis("off")
                continue
            plot_attention(scores[h], tokens, keys, ax=ax, cmap=cmap,
                           padding=m.key_padding()[batch_index],
                           title=f"{m.name} h{h}" if row == 0 or col == 0 else f"h{h}")
            if col:
                ax.set_yticklabels([])
            if row != len(maps) - 1:
                ax.set_xticklabels([])
    fig.tight_layout()
    return fig
