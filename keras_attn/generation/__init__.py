"""Incremental decoding: KV caches, cached search and prefill/decode export."""

from keras_attn.generation.cache import empty_cache, stack_cache, unstack_cache
from keras_attn.generation.lm_loss import CausalLMLoss
from keras_attn.generation.models import DecoderOnlyLM, Seq2SeqLM
from keras_attn.generation.search import beam_search, filter_logits, greedy_search, random_sampling

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
