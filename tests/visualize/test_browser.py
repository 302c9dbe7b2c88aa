"""`html_view`'s page, opened in headless Chromium: its script runs, the
tokens and layer names are in the DOM, the drawing is each layer's weights,
and a link to another layer (`#layer=1`) draws something else.

The docs site's built pages get the same smoke test in tests/project/test_docs.py."""

import html
import re

import numpy as np
import pytest

from keras_attn.visualize import AttentionMap, html_view
from tests import browser

pytestmark = pytest.mark.skipif(browser.chromium() is None, reason=browser.NO_CHROMIUM)

TOKENS = ["the", "cat", "sat", "on", "<pad>"]
NAMES = ["encoder_0/self_attention", "decoder_block_with_a_long_name_0/cross_attention_proj"]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    rng = np.random.default_rng(0)
    maps = []
    for layer, name in enumerate(NAMES):
        # Layer 0 spreads its weights, layer 1 puts each row on one key: the
        # two drawings differ in how many lines they have.
        logits = rng.standard_normal((1, 3, 5, 5)) * (1 + 8 * layer)
        scores = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        maps.append(AttentionMap(name, scores.astype("float32")))
    path = tmp_path_factory.mktemp("html") / "attention.html"
    html_view(maps, TOKENS, str(path), title="Explorer <test>")
    return maps, path


def _lines(scores):
    """How many lines the page draws for `scores` (B=0): one per head, query
    and key whose weight, rounded as in the file, is above 0.01."""
    return int(np.sum(np.round(scores.astype(np.float64), 4) > 0.01))


def test_the_page_script_runs_and_draws_each_layer(page):
    maps, path = page
    for layer in (0, 1):
        dom = browser.dump_dom(f"{path.as_uri()}#layer={layer}")
        assert "<title>Explorer &lt;test&gt;</title>" in dom
        for name in NAMES:  # the layer menu, filled by the script
            assert f">{html.escape(name)}</option>" in dom
        assert f'data-layer="{NAMES[layer]}"' in dom
        left = dom[dom.index('id="left"'):dom.index('<svg id="lines"')]
        assert re.findall(r"<div[^>]*>([^<]*)</div>", left) == [html.escape(t) for t in TOKENS]
        assert dom.count("<line ") == _lines(maps[layer].scores[0]), layer
        assert dom.count("<canvas") == 2 * 3  # the model view: layers x heads
    # A layer given by name, and one query's lines (as when hovering "sat").
    dom = browser.dump_dom(f"{path.as_uri()}#layer={NAMES[1]}&query=2")
    assert dom.count("<line ") == _lines(maps[1].scores[0, :, 2])


def test_screenshots_are_drawn_and_differ_between_layers(page, tmp_path):
    _, path = page
    first = browser.screenshot(f"{path.as_uri()}#layer=0", tmp_path / "layer0.png")
    second = browser.screenshot(f"{path.as_uri()}#layer=1", tmp_path / "layer1.png")
    for image in (first, second):
        assert image.shape[:2] == (900, 1000)
        assert 0.01 < browser.ink(image) < 0.6  # text, lines and thumbnails; not blank
    # The head view (tokens and lines, top left) changes with the layer.
    view = (slice(80, 260), slice(0, 400))
    assert np.mean(np.any(first[view] != second[view], axis=-1)) > 0.01
