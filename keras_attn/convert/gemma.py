"""Gemma (1) decoders onto `DecoderOnlyLM`: the Llama conversion
(`llama.LlamaConverter`) with Gemma's three differences.

- the activation is `hidden_activation` (GeGLU with tanh-GELU), falling
  back to `hidden_act`;
- token embeddings are multiplied by `sqrt(hidden_size)` (in float32, as
  Gemma rounds it) before the first block; a tied head uses the unscaled
  table;
- RMSNorm multiplies by `(1 + weight)`: folded into the scale.

`head_dim` independent of the hidden size comes from the config as for any
Llama-like model. The tensor names are Llama's (`llama.py`).
"""

import numpy as np

from keras_attn.convert import common
from keras_attn.convert import llama


class GemmaConverter(llama.LlamaConverter):
    def activation(self):
        config = self.config
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        return common.mapped_activation("hidden_act", act)

    def model_options(self):
        options = super().model_options()
        options["embedding_scale"] = float(np.float32(self.config.hidden_size**0.5))
        return options

    def norm_scale(self, weight):
        return weight + 1.0


class GemmaWriter(llama.LlamaWriter):
    """A `DecoderOnlyLM` with Gemma's embedding scale as a `GemmaForCausalLM`:
    norm weights `scale - 1`."""

    architectures = {"gemma": "GemmaForCausalLM"}

    @property
    def required(self):
        return {"embedding_scale": float(np.float32(self.options["hidden_dim"] ** 0.5))}

    def family_fields(self):
        return dict(super().family_fields(), hidden_activation=self.options["activation"])

    def norm_weight(self, scale):
        return scale - 1.0


def convert(checkpoint, *, dropout=None):
    """A `DecoderOnlyLM` with the weights and logits of a `GemmaForCausalLM`
    (`dropout` is not used: the result has none)."""
    return GemmaConverter(checkpoint).convert()


FAMILY = common.Family(
    name="Gemma",
    model_types=("gemma",),
    architectures=("*ForCausalLM",),
    convert=convert,
    projections=llama.projections,
)
