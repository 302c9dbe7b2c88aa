"""An embedding table that also serves as the tied output projection."""

import keras
from keras import ops

from keras_attn import checks
from keras_attn import saving


@saving.register
class ReversibleEmbedding(keras.layers.Embedding):
    """`keras.layers.Embedding` whose table is reused as the output head.

    `call(ids)` embeds token ids as `keras.layers.Embedding` does (same
    variable, `embeddings`, so checkpoints of a plain `Embedding` load);
    `call(hidden, reverse=True)` projects hidden states back onto the
    vocabulary with the transposed table, `hidden @ embeddings.T`, without a
    bias: the tied input/output embeddings of GPT-2, BERT's MLM head and
    most language models since (Press & Wolf, 2017, "Using the Output
    Embedding to Improve Language Models"). As KerasHub's
    `ReversibleEmbedding(tie_weights=True)`.

    Args: as `keras.layers.Embedding` (`input_dim` = vocabulary size,
        `output_dim` = embedding size).

    Call arguments:
        inputs: integer ids `(...)` in `[0, input_dim)`, or with
            `reverse=True` hidden states `(..., output_dim)`. Float ids
            raise a TypeError; in an eager call, an id out of range raises
            a ValueError naming it (traced calls are not checked).
        reverse: project onto the vocabulary instead of embedding.

    Returns:
        `(..., output_dim)` embeddings, or `(..., input_dim)` logits.

    Example:

    >>> import numpy as np
    >>> emb = ReversibleEmbedding(50, 8)
    >>> h = emb(np.array([[1, 2, 3]]))
    >>> tuple(emb(h, reverse=True).shape)
    (1, 3, 50)
    """

    def call(self, inputs, reverse=False):
        if not reverse:
            layer = f"ReversibleEmbedding '{self.name}'"
            checks.check_integer_ids(layer, "inputs", inputs)
            checks.check_ids_in_range(layer, "inputs", inputs, self.input_dim,
                                      "vocabulary_size (input_dim)")
            return super().call(inputs)
        if inputs.shape[-1] is not None and inputs.shape[-1] != self.output_dim:
            raise ValueError(
                f"With reverse=True, `inputs` must have {self.output_dim} features "
                f"(the embedding size). Received: inputs.shape={tuple(inputs.shape)}"
            )
        kernel = ops.cast(ops.transpose(ops.convert_to_tensor(self.embeddings)), self.compute_dtype)
        inputs = ops.cast(inputs, self.compute_dtype)
        # As a 2-D matmul: `(..., D) @ (D, V)`.
        shape = ops.shape(inputs)
        flat = ops.reshape(inputs, (-1, self.output_dim))
        logits = ops.matmul(flat, kernel)
        return ops.reshape(logits, tuple(shape[:-1]) + (self.input_dim,))

    def compute_mask(self, inputs, mask=None):
        # Hidden states (reverse=True) keep their mask; ids give one with mask_zero.
        if "float" in keras.backend.standardize_dtype(inputs.dtype):
            return mask
        return super().compute_mask(inputs, mask)

    def compute_output_shape(self, input_shape, reverse=False):
        if reverse:
            return tuple(input_shape[:-1]) + (self.input_dim,)
        return super().compute_output_shape(input_shape)

    def compute_output_spec(self, inputs, reverse=False):
        shape = self.compute_output_shape(inputs.shape, reverse=reverse)
        return keras.KerasTensor(shape, dtype=self.compute_dtype)
