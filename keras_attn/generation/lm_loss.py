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
        head = _head_weights(model)
        count = ops.cast(ops.shape(targets)[0] * length, "float32")
        if head is not None and not head[2]:
            return _frozen_head_loss(model, head[0], head[1], hidden, targets, sample_weight,
                                     self.chunk_size) / count
        total = None
        for start in range(0, length, self.chunk_size):
            stop = min(start + self.chunk_size, length)
            weights = None if sample_weight is None else sample_weight[:, start:stop]
            part = _chunk_loss(model, head, hidden[:, start:stop], targets[:, start:stop], weights)
            total = part if total is None else total + part
        return total / count

    def get_config(self):
        return {"name": self.name, "chunk_size": self.chunk_size}


def _head_weights(model):
    """`(kernel, bias, trainable)` of `model`'s output head: the `(V, D)`
    token table of a tied head or the `(D, V)` kernel of an untied one, in
    the compute dtype, read once for every chunk."""
    layer = model.lm_head
    if layer is None:
        layer = model.embedding if model.position in ("rotary", "relative") else model.embedding.token_embedding
        kernel = layer.embeddings
    else:
        if layer.quantization_mode is not None or getattr(layer, "lora_enabled", False):
            return None  # only the layer itself knows how to apply it
        kernel = layer.kernel
    bias = getattr(layer, "bias", None) if model.lm_head is not None else None
    trainable = layer.trainable and any(v.trainable for v in layer.weights)
    cast = lambda v: None if v is None else ops.cast(ops.convert_to_tensor(v), layer.compute_dtype)  # noqa: E731
    return cast(kernel), cast(bias), trainable


def _frozen_head_loss(model, kernel, bias, hidden, targets, sample_weight, chunk_size):
    """The summed token losses of a frozen head over `hidden`, with the
    gradient with respect to `hidden` computed chunk by chunk in the forward
    pass (the loss is a scalar, so `d loss / d hidden` is all the backward
    pass needs): each chunk's logits are made once and dropped, as in the
    rematerialised path, without recomputing them in the backward pass.
    """
    tied = model.lm_head is None
    cap = model.final_logit_soft_cap
    length = hidden.shape[1]

    @ops.custom_gradient
    def loss_of(hidden):
        total, grads = None, []
        for start in range(0, length, chunk_size):
            stop = min(start + chunk_size, length)
            h = ops.cast(hidden[:, start:stop], kernel.dtype)
            logits = ops.einsum("btd,vd->btv" if tied else "btd,dv->btv", h, kernel)
            if bias is not None:
                logits = logits + bias
            logits = ops.cast(logits, "float32")
            if cap is not None:
                squashed = ops.tanh(logits / cap)
                logits = squashed * cap
            target = ops.cast(targets[:, start:stop], "int32")
            lse = ops.logsumexp(logits, axis=-1, keepdims=True)
            picked = ops.take_along_axis(logits, ops.expand_dims(target, -1), axis=-1)
            losses = ops.squeeze(lse - picked, -1)
            # d ce / d logits = softmax - one_hot(target).
            dlogits = ops.exp(logits - lse) - ops.one_hot(target, logits.shape[-1], dtype="float32")
            if sample_weight is not None:
                weights = ops.cast(sample_weight[:, start:stop], "float32")
                losses = losses * weights
                dlogits = dlogits * ops.expand_dims(weights, -1)
            if cap is not None:
                dlogits = dlogits * (1.0 - ops.square(squashed))
            dlogits = ops.cast(dlogits, kernel.dtype)
            grads.append(ops.einsum("btv,vd->btd" if tied else "btv,dv->btd", dlogits, kernel))
            part = ops.sum(losses)
            total = part if total is None else total + part
        dhidden = ops.concatenate(grads, axis=1) if len(grads) > 1 else grads[0]

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            return ops.cast(dhidden * ops.cast(upstream, dhidden.dtype), hidden.dtype)

        return total, grad

    return loss_of(hidden)


def _chunk_loss(model, head, hidden, targets, weights):
    """Sum over one chunk of the (weighted) token losses of `model`'s head,
    rematerialised.

    A frozen head's weights are closed over rather than passed in: TensorFlow's
    `recompute_grad` differentiates with respect to every argument and every
    variable read inside, and the gradient of a frozen 151,936-row table
    would cost a matmul and a table-sized buffer per chunk.
    """
    tied = model.lm_head is None
    cap = model.final_logit_soft_cap

    def logits_of(hidden, kernel, bias):
        if head is None:
            return model._logits(model.embedding, hidden)
        hidden = ops.cast(hidden, kernel.dtype)
        logits = ops.einsum("btd,vd->btv" if tied else "btd,dv->btv", hidden, kernel)
        if bias is not None:
            logits = logits + bias
        if cap is not None:
            logits = ops.tanh(logits / ops.cast(cap, logits.dtype)) * ops.cast(cap, logits.dtype)
        return logits

    def losses_of(hidden, targets, weights, kernel, bias):
        losses = token_cross_entropy(logits_of(hidden, kernel, bias), targets)
        if weights is not None:
            losses = losses * ops.cast(weights, "float32")
        return ops.sum(losses)

    if head is None or not head[2]:
        kernel, bias = (None, None) if head is None else head[:2]
        return keras.remat(lambda h: losses_of(h, targets, weights, kernel, bias))(hidden)
    kernel, bias = head[:2]
    if bias is None:
        return keras.remat(lambda h, k: losses_of(h, targets, weights, k, None))(hidden, kernel)
    return keras.remat(lambda h, k, b: losses_of(h, targets, weights, k, b))(hidden, kernel, bias)
