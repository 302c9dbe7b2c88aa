"""See what a model attends to: every attention map, pictures, an HTML explorer.

- `attention_maps(model, inputs)`: every keras_attn attention layer's
  probabilities for one call, per layer and head, masks included.
- `plot_attention`, `plot_heads`: matplotlib figures (PNG/SVG).
- `attention_rollout`: attention flow through a stack (Abnar & Zuidema, 2020).
- `html_view`: one self-contained HTML file (head view, model view).
- `AttentionMapCallback`: the head grid in TensorBoard while `fit` runs.
"""

from keras_attn.visualize.callback import AttentionMapCallback
from keras_attn.visualize.html import html_view
from keras_attn.visualize.maps import AttentionMap, attention_maps, attention_rollout
from keras_attn.visualize.plots import plot_attention, plot_heads

__all__ = [
    "AttentionMap",
    "AttentionMapCallback",
    "attention_maps",
    "attention_rollout",
    "html_view",
    "plot_attention",
    "plot_heads",
]
