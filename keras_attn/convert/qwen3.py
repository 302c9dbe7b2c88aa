"""Qwen3 decoders onto `DecoderOnlyLM`: the Llama conversion
(`llama.LlamaConverter`) with an RMSNorm over each query and key head
(`use_qk_norm`), applied before the rotary embedding.

`head_dim` is the config's, independent of `hidden_size / num_attention_heads`;
q/k/v biases follow `attention_bias`; with `use_sliding_window`, the layers
that `layer_types` marks "sliding_attention" get the window, the others full
attention. Mixture-of-experts (`qwen3_moe`) and linear-attention
(`qwen3_next`, `qwen3_5`) models are refused by `registry.REFUSED`.

| Hugging Face tensor (prefix `model.`)       | keras_attn variable (`DecoderOnlyLM`)                  |
|---------------------------------------------|--------------------------------------------------------|
| `layers.i.self_attn.q_norm.weight`          | `decoder_i/self_attention/query_norm/scale`            |
| `layers.i.self_attn.k_norm.weight`          | `decoder_i/self_attention/key_norm/scale`              |
| (everything else)                           | as Llama (`llama.py`)                                  |
"""

from keras_attn.convert import common
from keras_attn.convert import llama


class Qwen3Converter(llama.LlamaConverter):
    def model_options(self):
        options = super().model_options()
        options["use_qk_norm"] = True
        return options

    def set_attention(self, attention, prefix):
        super().set_attention(attention, prefix)
        self.set_norm(attention.query_norm, prefix + "q_norm")
        self.set_norm(attention.key_norm, prefix + "k_norm")


class Qwen3Writer(llama.LlamaWriter):
    """A `DecoderOnlyLM` with query/key norms as a `Qwen3ForCausalLM`."""

    architectures = {"qwen3": "Qwen3ForCausalLM"}
    required = {"use_qk_norm": True}

    def window_fields(self):
        fields = self.layer_windows()
        return dict(fields, use_sliding_window=fields["sliding_window"] is not None)

    def norms(self, block):
        return {**super().norms(block), "self_attn.q_norm": block.self_attention.query_norm,
                "self_attn.k_norm": block.self_attention.key_norm}


def convert(checkpoint, *, dropout=None):
    """A `DecoderOnlyLM` with the weights and logits of a `Qwen3ForCausalLM`
    (`dropout` is not used: the result has none)."""
    return Qwen3Converter(checkpoint).convert()


FAMILY = common.Family(
    name="Qwen3",
    model_types=("qwen3",),
    architectures=("*ForCausalLM",),
    convert=convert,
    projections=llama.projections,
)
