"""SmolLM3 decoders onto `DecoderOnlyLM`: the Llama conversion
(`llama.LlamaConverter`) with layers that use no rotary embedding.

`no_rope_layers[i]` is 1 where layer `i` applies the rotary embedding and 0
where it does not (every fourth layer by default, "NoPE"): it becomes
`DecoderOnlyLM(rotary_layers=...)`. With `use_sliding_window`, the
"sliding_attention" layers of `layer_types` get the window. The tensor
names are Llama's (`llama.py`).
"""

from keras_attn.convert import common
from keras_attn.convert import llama


class SmolLM3Converter(llama.LlamaConverter):
    def model_options(self):
        options = super().model_options()
        uses = getattr(self.config, "no_rope_layers", None)
        if uses is not None:
            if len(uses) != self.config.num_hidden_layers or set(uses) - {0, 1}:
                common.refuse("no_rope_layers", uses,
                              f"must hold a 0 or 1 for each of the {self.config.num_hidden_layers} layers")
            options["rotary_layers"] = [bool(use) for use in uses]
        return options


class SmolLM3Writer(llama.LlamaWriter):
    """A `DecoderOnlyLM` (layers without rotary allowed) as a `SmolLM3ForCausalLM`."""

    architectures = {"smollm3": "SmolLM3ForCausalLM"}
    free = ("rotary_layers",)
    mlp_bias = True

    def window_fields(self):
        fields = self.layer_windows()
        return dict(fields, use_sliding_window=fields["sliding_window"] is not None)

    def family_fields(self):
        uses = self.options["rotary_layers"] or [True] * self.options["num_layers"]
        return dict(super().family_fields(), no_rope_layers=[int(use) for use in uses])


def convert(checkpoint, *, dropout=None):
    """A `DecoderOnlyLM` with the weights and logits of a `SmolLM3ForCausalLM`
    (`dropout` is not used: the result has none)."""
    return SmolLM3Converter(checkpoint).convert()


FAMILY = common.Family(
    name="SmolLM3",
    model_types=("smollm3",),
    architectures=("*ForCausalLM",),
    convert=convert,
    projections=llama.projections,
)
