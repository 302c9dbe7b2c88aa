"""Incremental decoding: KV caches, cached search and prefill/decode export."""

from typing import TYPE_CHECKING

from keras_attn.generation.cache import empty_cache, stack_cache, unstack_cache
from keras_attn.generation.lm_loss import CausalLMLoss
from keras_attn.generation.models import DecoderOnlyLM, Seq2SeqLM

# The searches are TensorFlow functions: imported on first use, so a model
# built, converted or trained on JAX or torch does not load TensorFlow
# (about 0.45 GB of resident memory).
_SEARCH_NAMES = ("beam_search", "filter_logits", "greedy_search", "random_sampling")

if TYPE_CHECKING:  # what readers and the API docs resolve the names to
    from keras_attn.generation.search import beam_search, filter_logits, greedy_search, random_sampling


def __getattr__(name):
    if name in _SEARCH_NAMES:
        from keras_attn.generation import search

        return getattr(search, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CausalLMLoss",
    "DecoderOnlyLM",
    "Seq2SeqLM",
    "beam_search",
    "empty_cache",
    "filter_logits",
    "greedy_search",
    "random_sampling",
    "stack_cache",
    "unstack_cache",
]
