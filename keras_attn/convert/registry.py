"""The converter table: which family converts which `model_type`.

Each family module (`bert.py`, `gpt2.py`, `llama.py`, `gemma.py`, `t5.py`)
declares a `FAMILY` (`common.Family`): the `model_type`s and architectures it
takes and its `convert(checkpoint, *, dropout=None)`. `FAMILIES` lists them,
one row each; adding a family is adding its module and its row.
"""

from keras_attn.convert import bert
from keras_attn.convert import common
from keras_attn.convert import gemma
from keras_attn.convert import gpt2
from keras_attn.convert import llama
from keras_attn.convert import t5

FAMILIES = (
    bert.FAMILY,
    gpt2.FAMILY,
    llama.FAMILY,
    gemma.FAMILY,
    t5.FAMILY,
)


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
    """`checkpoint` (`common.Checkpoint`) converted by its family."""
    return find(checkpoint).convert(checkpoint, dropout=dropout)
