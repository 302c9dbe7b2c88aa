"""Pure functions on `keras.ops`: the attention core and mask helpers.

`dot_product_attention` runs one of several kernels, chosen by
`keras_attn.ops.dispatch.select_kernel` (see `keras_attn.config`);
`explain_kernel` and `last_kernel` say which.
"""

from keras_attn.ops.attention import additive_attention
from keras_attn.ops.attention import attend_from_logits
from keras_attn.ops.attention import dot_product_attention
from keras_attn.ops.attention import explain_kernel
from keras_attn.ops.cache import check_cache_write
from keras_attn.ops.cache import write_cache
from keras_attn.ops.dispatch import KernelPlan
from keras_attn.ops.dispatch import last_kernel
from keras_attn.ops.dispatch import select_kernel
from keras_attn.ops.masking import AttentionMask
from keras_attn.ops.masking import broadcast_attention_mask
from keras_attn.ops.masking import band
from keras_attn.ops.masking import causal_mask
from keras_attn.ops.masking import combine_masks
from keras_attn.ops.masking import key_padding_mask_to_attention_mask
from keras_attn.ops.masking import mask_from_positions
from keras_attn.ops.masking import normalize_attention_mask
from keras_attn.ops.masking import padding_mask_to_attention_mask
from keras_attn.ops.masking import sliding_window_mask

__all__ = [
    "AttentionMask",
    "KernelPlan",
    "additive_attention",
    "attend_from_logits",
    "band",
    "broadcast_attention_mask",
    "causal_mask",
    "check_cache_write",
    "combine_masks",
    "dot_product_attention",
    "explain_kernel",
    "key_padding_mask_to_attention_mask",
    "last_kernel",
    "mask_from_positions",
    "normalize_attention_mask",
    "padding_mask_to_attention_mask",
    "select_kernel",
    "sliding_window_mask",
    "write_cache",
]
