"""EuroBERT encoders (`EuroBertModel`, `EuroBertForMaskedLM`) onto a
functional `keras.Model` of `TransformerEncoderBlock`s: a Llama
(`llama.py`: RMSNorm, SwiGLU, rotary grouped-query heads, the config's
`attention_bias` / `mlp_bias`) without the causal mask
(`llama.EncoderConverter`). Inputs `input_ids`, `attention_mask`; output
`last_hidden_state`, or the masked LM's `logits` from `lm_head` (bias per
`mlp_bias`; the token table when `tie_word_embeddings`). The tensor names
are Llama's under `model.`, plus `lm_head.*`.
"""

from keras_attn.convert import common
from keras_attn.convert import llama


class EuroBertConverter(llama.EncoderConverter, llama.LlamaConverter):
    bidirectional = True


def convert(checkpoint, *, dropout=None):
    """A functional encoder with the weights and outputs of an EuroBERT model
    (`dropout` is not used: the result has none)."""
    return EuroBertConverter(checkpoint).convert()


FAMILY = common.Family(
    name="EuroBERT",
    model_types=("eurobert",),
    architectures=("EuroBertModel", "EuroBertForMaskedLM"),
    convert=convert,
)
