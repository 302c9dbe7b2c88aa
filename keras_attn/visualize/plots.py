"""Matplotlib pictures of attention maps: one head, or a grid of layers x heads."""

import re

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
                   cmap="viridis", padding=None, vmax=None):
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
        vmax: the weight drawn in the colour map's last colour (default: this
            map's largest weight); `plot_heads` gives every map the same one.

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
    if vmax is None:
        vmax = max(float(weights.max()), 1e-9)
    ax.imshow(weights, cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=7)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    if padding is not None:
        for j in np.flatnonzero(np.asarray(padding)):
            ax.axvspan(j - 0.5, j + 0.5, fill=False, hatch="///", edgecolor="0.6", linewidth=0)
    if title:
        ax.set_title(title, fontsize=8)
    return fig


_TITLE_SIZE = 8


def _text_width(text, weight="bold"):
    """Width in points of `text` in the titles' font (no renderer needed)."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextPath

    prop = FontProperties(size=_TITLE_SIZE, weight=weight)
    return TextPath((0, 0), text, prop=prop).get_extents().width


def _wrap_name(name, width):
    """`name` in lines at most `width` points wide, broken after `/` or `_`
    where it can (a layer path), inside a word only where it must."""
    pieces = re.findall(r"[^/_]*[/_]|[^/_]+$", name) or [name]
    lines, line = [], ""
    for piece in pieces:
        while _text_width(piece) > width and len(piece) > 1:  # cut a piece too long alone
            if line:
                lines.append(line)
                line = ""
            cut = max(n for n in range(1, len(piece)) if _text_width(piece[:n]) <= width
                      or n == 1)
            lines.append(piece[:cut])
            piece = piece[cut:]
        if line and _text_width(line + piece) > width:
            lines.append(line)
            line = ""
        line += piece
    if line:
        lines.append(line)
    return "\n".join(lines)


def plot_heads(maps, tokens=None, *, key_tokens=None, batch_index=0, layers=None, heads=None,
               cmap="viridis", cell_size=1.6):
    """A grid of attention maps: one row per layer, one column per head.

    Each row is headed by its layer's name (wrapped to the row's width, so
    long names stay readable however few heads there are), each map by its
    head, and every map shares one colour scale, drawn as a colour bar on
    the right (0 to the largest weight drawn).

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
    drawn = [m.scores[batch_index, [h for h in heads if h < m.num_heads]] for m in maps]
    vmax = max(max(float(s.max()) for s in drawn if s.size), 1e-9)
    plt = _pyplot()
    label_width = 0.8  # inches for the token labels left of the first column
    grid_width = cell_size * len(heads) + label_width
    fig = plt.figure(figsize=(grid_width + 0.9, (cell_size + 0.45) * len(maps) + 0.6),
                     layout="constrained")
    grid, bar = fig.subfigures(1, 2, width_ratios=[grid_width, 0.9])
    rows = np.atleast_1d(grid.subfigures(len(maps), 1))
    title_width = 0.9 * grid_width * 72  # points, with a margin each side
    image = None
    def key_axis(m):  # what a map's columns are: a row shows them unless the next row repeats them
        return (m.scores.shape[-1], m.scores.shape[-1] == m.scores.shape[-2])

    for row, (m, panel) in enumerate(zip(maps, rows)):
        panel.suptitle(_wrap_name(m.name, title_width), fontsize=_TITLE_SIZE, fontweight="bold")
        axes = np.atleast_1d(panel.subplots(1, len(heads)))
        scores = m.scores[batch_index]
        keys = tokens if scores.shape[-1] == scores.shape[-2] else key_tokens
        # Token labels no larger than a map's cell (72 points per inch), so
        # long sequences get small labels rather than overlapping ones.
        label_size = {"x": min(7.0, 0.8 * 72 * cell_size / scores.shape[-1]),
                      "y": min(7.0, 0.8 * 72 * cell_size / scores.shape[-2])}
        last = row == len(maps) - 1 or key_axis(maps[row + 1]) != key_axis(m)
        for col, (ax, h) in enumerate(zip(axes, heads)):
            if h >= m.num_heads:
                ax.axis("off")
                continue
            plot_attention(scores[h], tokens, keys, ax=ax, cmap=cmap, vmax=vmax,
                           padding=m.key_padding()[batch_index], title=f"head {h}")
            image = ax.images[-1]
            for axis, size in label_size.items():
                ax.tick_params(axis=axis, labelsize=size)
            if col:
                ax.set_yticklabels([])
            if not last:
                ax.set_xticklabels([])
    # The bar's own axes, placed by hand: a narrow strip (about 0.15 inch)
    # beside the maps, its ticks and label in the rest of the 0.9 inch.
    colorbar = bar.colorbar(image, cax=bar.add_axes((0.1, 0.1, 0.17, 0.8)))
    colorbar.ax.set_ylabel("attention weight", fontsize=_TITLE_SIZE)
    colorbar.ax.tick_params(labelsize=7)
    return fig
