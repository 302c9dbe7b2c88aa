"""Tensor-parallel sharding of a keras_attn language model (`keras.distribution`).

`DecoderOnlyLM.get_layout_map` / `Seq2SeqLM.get_layout_map` call
`layout_map`: Megatron-style, attention heads and the feed-forward's
intermediate features split over the mesh's model axis, everything else
replicated. The patterns follow the sublayer names of keras_attn's blocks
(`query`, `key`, `value`, `attention_output`, `feedforward_*_dense`,
`lm_head`, the embeddings).
"""

import keras


def layout_map(model, device_mesh, model_axis="model", data_axis="data"):
    """A `keras.distribution.LayoutMap` sharding `model` over `device_mesh`'s
    `model_axis` (`data_axis` is the batch's, for `ModelParallel`). See
    `DecoderOnlyLM.get_layout_map`.
    """
    names = tuple(device_mesh.axis_names)
    if model_axis not in names:
        raise ValueError(
            f"`model_axis` must be an axis of `device_mesh`. Received: model_axis="
            f"{model_axis!r}, device_mesh.axis_names={names}"
        )
    size = device_mesh.shape[names.index(model_axis)]
    for name in ("num_heads", "num_key_value_heads", "intermediate_dim", "vocabulary_size",
                 "per_layer_input_vocabulary_size"):
        # The per-layer input table (Gemma 4) is sharded as the token table;
        # sizes given per layer are checked layer by layer.
        value = getattr(model, name, None) or 0
        if any(v % size for v in (value if isinstance(value, list) else [value])):
            raise ValueError(
                f"`{name}`={getattr(model, name)} is not divisible by the {size} devices "
                f"of mesh axis {model_axis!r}."
            )
    m = model_axis
    layout = keras.distribution.LayoutMap(device_mesh)
    layout[r".*embedding.*/embeddings"] = (m, None)
    layout[r".*attention/(query|key|value)/kernel"] = (None, m, None)
    layout[r".*attention/(query|key|value)/bias"] = (m, None)
    layout[r".*attention/attention_output/kernel"] = (m, None, None)
    layout[r".*feedforward_(gate|intermediate)_dense/kernel"] = (None, m)
    layout[r".*feedforward_(gate|intermediate)_dense/bias"] = (m,)
    layout[r".*feedforward_output_dense/kernel"] = (m, None)
    layout[r".*lm_head/kernel"] = (None, m)
    return layout
