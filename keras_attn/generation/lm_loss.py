"""The causal-LM loss, optionally over the vocabulary in chunks of positions.

A causal LM's loss is the cross-entropy of each position's logits against
the next token. Materialised whole, those logits are `B x T x V` float32 and
so is their gradient: at Qwen2.5-0.5B's 151,936 columns, a 4 x 512 batch
holds 1.2 GB of logits plus as much gradient, more than the activations of
all 24 blocks together. `CausalLMLoss(chunk_size=C)` on a `DecoderOnlyLM`
makes `fit` take the final hidden states from the model instead and apply the
output head `C` positions at a time, each chunk rematerialised
(`keras.remat`): the forward pass keeps no logits, the backward pass
recomputes one chunk's at a time. The loss is the same number.
"""

import keras
from keras import ops

from keras_attn import checks
from keras_attn.saving import register


def token_cross_entropy(logits, targets):
    """Per-token `logsumexp(logits) - logits[target]`, in float32."""
    logits = ops.cast(logits, "float32")
    picked = ops.take_along_axis(logits, ops.expand_dims(ops.cast(targets, "int32"), -1), axis=-1)
    return ops.logsumexp(logits, axis=-1) - ops.squeeze(picked, -1)


@register
class CausalLMLoss(keras.losses.Loss):
    """Next-token cross-entropy from logits, optionally chunked over positions.

    On logits `(B, T, V)` and integer targets `(B, T)` it is
    `SparseCategoricalCrossentropy(from_logits=True)`: per-token sample
    weights (`keras_attn.data.causal_lm_dataset`'s third element) multiply
    each token's term and the sum is divided by `B * T` (Keras's
    `"sum_over_batch_size"`), so the weighted-out prompt and padding tokens
    count in the denominator exactly as there.

    With `chunk_size`, a `DecoderOnlyLM` compiled with this loss trains
    without materialising the logits: during `fit` (training only) the
    model returns its final normalised hidden states `(B, T, hidden_dim)`,
    and the loss applies the model's own output head (tied or untied, soft
    cap included) to `chunk_size` positions at a time, rematerialised, so
    the backward pass holds one `B x chunk_size x V` float32 chunk. The
    model's `call(training=False)`, `predict`, `evaluate` and generation
    give logits as before. Compiled metrics would see the hidden states, so
    the model refuses them with a chunked loss.

    Args:
        chunk_size: None (the whole logits, computed by the model), or the
            positions per chunk, a positive int.
        name: the loss's name.

    Example:

        lm.enable_lora(16, target_names=("q_proj", "v_proj"))
        lm.compile(keras.optimizers.AdamW(1e-4), loss=CausalLMLoss(chunk_size=128))
        lm.fit(causal_lm_dataset(pairs, folder, sequence_length=512, batch_size=4))
    """

    def __init__(self, chunk_size=None, name="causal_lm_loss", reduction="sum_over_batch_size",
                 dtype=None):
        if reduction != "sum_over_batch_size":
            raise ValueError(
                "Received an invalid value for argument `reduction`: CausalLMLoss reduces as "
                "SparseCategoricalCrossentropy's default does (the weighted sum over B * T). "
                f"Expected 'sum_over_batch_size'. Received: reduction={reduction!r}"
            )
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.chunk_size = checks.check_positive_int("chunk_size", chunk_size, allow_none=True)

    def call(self, y_true, y_pred):
        return token_cross_entropy(y_pred, y_true)

    def from_hidden(self, model, hidden, targets, sample_weight=None):
        """The loss of `model`'s head over `hidden` `(B, T, D)`, chunk by chunk."""
        length = hidden.shape[1]
        if length is None:
            raise ValueError(
                "CausalLMLoss(chunk_size=...) chunks the sequence axis, which must be static; "
                f"received hidden states of shape {tuple(hidden.shape)}. Batch the data with "
                "one sequence length (causal_lm_dataset does)."
            )
        total = None
        for start in range(0, length, self.chunk_size):
            stop = min(start + self.chunk_size, length)
            weights = None if sample_weight is None else sample_weight[:, start:stop]
            part = keras.remat(_chunk_loss(model, weights is not None))(
                hidden[:, start:stop], targets[:, start:stop],
                *(() if weights is None else (weights,)),
            )
            total = part if total is None else total + part
        count = ops.cast(ops.shape(targets)[0] * length, "float32")
        return total / count

    def get_config(self):
        return {"name": self.name, "chunk_size": self.chunk_size}


def _chunk_loss(model, weighted):
    """Sum over one chunk of the (weighted) token losses of `model`'s head."""
    def chunk(hidden, targets, weights=None):
        logits = model._logits(model.embedding, hidden)
        losses = token_cross_entropy(logits, targets)
        if weighted:
            losses = losses * ops.cast(weights, "float32")
        return ops.sum(losses)

    return chunk
