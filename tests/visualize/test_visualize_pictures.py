"""`plot_heads` stays readable: layer names whole and clear of every other
text at any number of heads and any name length, one colour scale for every
map with a colour bar."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from keras_attn.visualize import AttentionMap, plot_heads  # noqa: E402

LONG = "decoder_block_with_a_long_name_0/cross_attention_projections"  # 60 characters
TOKENS = ["the", "cat", "sat", "on", "<pad>", "<pad>"]


def _maps(num_heads):
    rng = np.random.default_rng(num_heads)
    names = [LONG, "enc1/self_attention", "averyveryverylongname" * 3]
    maps = []
    for name in names:
        scores = rng.random((1, num_heads, 6, 6)) ** 4
        maps.append(AttentionMap(name, (scores / scores.sum(-1, keepdims=True)).astype("f4")))
    return maps


@pytest.mark.parametrize("num_heads", [1, 4, 12, 16])
def test_plot_heads_titles_are_whole_apart_and_inside(num_heads):
    assert len(LONG) == 60
    maps = _maps(num_heads)
    fig = plot_heads(maps, TOKENS)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    page = fig.bbox
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    boxes = {id(t): t.get_window_extent(renderer) for t in texts}
    layer_titles = [t for t in texts if t.get_text().replace("\n", "") in {m.name for m in maps}]
    # One title per layer, the whole name (wrapped at most, never cut).
    assert sorted(t.get_text().replace("\n", "") for t in layer_titles) == sorted(
        m.name for m in maps)
    head_titles = [ax.title for ax in fig.axes if ax.get_title()]
    assert len(head_titles) == num_heads * len(maps)
    for title in layer_titles + head_titles:
        box = boxes[id(title)]
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 <= box.y1 <= page.y1, (
            title.get_text(), box, page)
        for other in texts:
            if other is not title:
                assert not box.overlaps(boxes[id(other)]), (title.get_text(), other.get_text())
    plt.close(fig)


def test_plot_heads_shares_one_colour_scale_with_a_colour_bar():
    maps = _maps(4)
    maps[1].scores[:] = 1.0 / 6  # a uniform layer: drawn dark on a shared scale
    fig = plot_heads(maps, TOKENS, heads=[0, 2])
    largest = max(float(m.scores[0, [0, 2]].max()) for m in maps)  # NumPy, not the plot
    images = [im for ax in fig.axes for im in ax.images]
    assert len(images) == 2 * len(maps)
    for image in images:
        assert image.get_clim() == pytest.approx((0.0, largest))
    bars = [ax for ax in fig.axes if ax.get_ylabel() == "attention weight"]
    assert len(bars) == 1
    assert bars[0].get_ylim() == pytest.approx((0.0, largest))
    plt.close(fig)


def test_long_key_axes_get_labels_that_do_not_overlap():
    """Decoder self-attention (10 keys) above cross-attention (40 encoder keys):
    each row shows its own key labels, and 40 labels under a 1.6 inch map are
    sized to fit rather than printed over each other."""
    rng = np.random.default_rng(1)
    decoder, encoder = [f"d{i}" for i in range(10)], [f"e{i}" for i in range(40)]
    maps = []
    for name, keys in (("decoder_0/self_attention", 10), ("decoder_0/cross_attention", 40)):
        scores = rng.random((1, 2, 10, keys))
        maps.append(AttentionMap(name, (scores / scores.sum(-1, keepdims=True)).astype("f4")))
    fig = plot_heads(maps, decoder, key_tokens=encoder)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    drawn = [ax for ax in fig.axes if ax.images]
    for ax, keys in zip(drawn, (decoder, decoder, encoder, encoder)):
        labels = [t for t in ax.get_xticklabels() if t.get_text()]
        assert [t.get_text() for t in labels] == keys
        boxes = [t.get_window_extent(renderer) for t in labels]
        for left, right in zip(boxes, boxes[1:]):
            assert left.x1 <= right.x0 + 0.5, (left, right)  # side by side, not over
        assert all(fig.bbox.contains(b.x0, b.y0) and fig.bbox.contains(b.x1, b.y1)
                   for b in boxes)
    plt.close(fig)
