"""The converter table: which family converts which `model_type`.

Each family module (`bert.py`, `gpt2.py`, `llama.py`, `gemma.py`,
`gemma2.py`, `gemma4.py`, `modernbert.py`, `eurobert.py`, `nomic_bert.py`, `qwen3.py`, `smollm3.py`, `phi3.py`, `t5.py`)
declares a `FAMILY` (`common.Family`): the `model_type`s and architectures it
takes and its `convert(checkpoint, *, dropout=None)`. `FAMILIES` lists them,
one row each; adding a family is adding its module and its row. `REFUSED`
names the related model types that cannot be represented, and why.
"""

from keras_attn.convert import bert
from keras_attn.convert import common
from keras_attn.convert import eurobert
from keras_attn.convert import gemma
from keras_attn.convert import gpt2
from keras_attn.convert import gemma2
from keras_attn.convert import gemma4
from keras_attn.convert import llama
from keras_attn.convert import modernbert
from keras_attn.convert import nomic_bert
from keras_attn.convert import phi3
from keras_attn.convert import qwen3
from keras_attn.convert import smollm3
from keras_attn.convert import t5

FAMILIES = (
    bert.FAMILY,
    modernbert.FAMILY,
    eurobert.FAMILY,
    nomic_bert.FAMILY,
    gpt2.FAMILY,
    llama.FAMILY,
    gemma.FAMILY,
    gemma2.FAMILY,
    gemma4.FAMILY,
    qwen3.FAMILY,
    smollm3.FAMILY,
    phi3.FAMILY,
    t5.FAMILY,
)

_EXPERTS = "is a mixture-of-experts model (routed feed-forward experts), which keras_attn does not represent"
_LINEAR = "has linear-attention (Gated DeltaNet) layers, which keras_attn does not represent"
_VISION = "has a vision tower, which keras_attn does not represent"
# Relatives of the families above that keras_attn cannot represent, refused
# by what they have rather than as unknown model types.
REFUSED = {
    "qwen2_moe": _EXPERTS,
    "qwen3_moe": _EXPERTS,
    "qwen3_5_moe": "has routed feed-forward experts and linear-attention (Gated DeltaNet) "
                   "layers, which keras_attn does not represent",
    "qwen3_5_moe_text": _EXPERTS,
    "mixtral": _EXPERTS,
    "phimoe": _EXPERTS,
    "qwen3_next": _LINEAR,
    "qwen3_5": _LINEAR,
    "qwen3_5_text": _LINEAR,
    "gemma3n": "has AltUp and Laurel blocks, per-layer embeddings and audio/vision towers, "
               "which keras_attn does not represent",
    "gemma3n_text": "has AltUp and Laurel blocks and per-layer embeddings, which keras_attn "
                    "does not represent",
    "gemma3": _VISION + "; convert the text model, a Gemma3ForCausalLM (model_type "
              "'gemma3_text')",
    "gemma4": "has vision and audio towers, which keras_attn does not represent; convert "
              "the text model, a Gemma4ForCausalLM (model_type 'gemma4_text')",
    "qwen3_vl": _VISION,
    "paligemma": _VISION,
    "smolvlm": _VISION,
    "phi4_multimodal": "has vision and audio towers, which keras_attn does not represent",
}


def _by_model_type(families):
    table = {}
    for family in families:
        for model_type in family.model_types:
            if model_type in table:
                raise ValueError(
                    f"model_type={model_type!r} is declared by two converter families: "
                    f"{table[model_type].name} and {family.name}"
                )
            table[model_type] = family
    return table


# `model_type` -> the family that converts it.
CONVERTERS = _by_model_type(FAMILIES)


def find(checkpoint):
    """The `common.Family` that converts `checkpoint`, or a ValueError naming
    the `model_type` or architecture that no family takes."""
    if checkpoint.model_type in REFUSED:
        common.refuse("model_type", checkpoint.model_type, REFUSED[checkpoint.model_type])
    family = CONVERTERS.get(checkpoint.model_type)
    if family is None:
        raise ValueError(
            "Received an unsupported model: `model_type` must be one of "
            f"{list(CONVERTERS)}. Received: model_type={checkpoint.model_type!r} "
            f"({checkpoint.architecture})"
        )
    if not family.takes(checkpoint.architecture):
        common.refuse_architecture(checkpoint, family.architectures)
    return family


def convert(checkpoint, *, dropout=None):
    """`checkpoint` (`common.Checkpoint`) converted by its family, each
    variable made once from its tensor (`common.values_from_checkpoint`)."""
    family = find(checkpoint)
    with common.values_from_checkpoint():
        return family.convert(checkpoint, dropout=dropout)
