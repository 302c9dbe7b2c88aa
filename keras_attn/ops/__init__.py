"""Pure functions on `keras.ops`: the attention core and mask helpers."""

from keras_attn.ops.attention import additive_attention
from keras_attn.ops.attention import attend_from_logits
from keras_attn.ops.attention import dot_product_attention
from keras_attn.ops.masking import causal_mask
from keras_attn.ops.masking import combine_masks
from keras_attn.ops.masking import normalize_attention_mask
from keras_attn.ops.masking import padding_mask_to_attention_mask
from keras_attn.ops.masking import sliding_window_mask

__all__ = [
    "additive_attention",
    "attend_from_logits",
    "causal_mask",
    "combine_masks",
    "dot_product_attention",
    "normalize_attention_mask",
    "padding_mask_to_attention_mask",
    "sliding_window_mask",
]
