"""The one place that chooses an attention kernel: `select_kernel`.

`keras_attn.ops.dot_product_attention` validates its inputs, asks
`select_kernel` for a `KernelPlan`, and runs its kernel (see
`keras_attn.config` for the names and the user setting); the layers ask it
too, for the fused projections and the LayerNorm kernel, and nothing else
decides by backend or device. `select_kernel` decides from static facts only (backend, device type, the setting, static
sequence lengths, whether dropout or the scores are needed), so the choice is
made once per trace and can be checked in tests without the device.

`last_kernel()` names the kernel of the most recent trace or eager call;
`keras_attn.ops.explain_kernel(query, key, value, ...)` the kernel a call
would use.
"""

from typing import NamedTuple

import keras

from keras_attn import config

AUTO_CHUNK_MIN_SCORES = 4096 * 4096
"""With `chunk_size=None`, attention is blocked when the static `T_q * T_k`
exceeds this: beyond 4096 x 4096, the unblocked score tensors of a batch-1,
8-head layer already take 512 MiB each."""

DEFAULT_CHUNK_SIZE = 1024
"""The forward block size of the blocked path when it is picked automatically
(larger blocks take fewer loop steps; benchmarks/README.md)."""

_last = {"kernel": None}


class KernelPlan(NamedTuple):
    """Everything that depends on the backend, device, dtype and setting.

    Attributes:
        attention: the attention kernel, `"reference"`, `"tf_cpu"`,
            `"blocked"` or `"keras"`.
        cpu_kernels: the TensorFlow CPU optimisations of
            `keras_attn.ops.tf_kernels` may run: the fused softmax and
            weighted sum, head groups on the blocked path, the Transformer
            blocks' LayerNorm with its written-out backward pass.
        fused_projections: a `(batch, seq, features)` input's query, key,
            value (and gate) projections run as one 2-D matmul, the output
            and feed-forward projections on `(batch * seq, features)`.
        flash: `keras.ops.dot_product_attention(flash_attention=...)` for
            the `"keras"` kernel (None: Keras decides).
    """

    attention: str
    cpu_kernels: bool
    fused_projections: bool
    flash: object = None


def _cpu_kernels(implementation, backend, device):
    if implementation == "tf_cpu":
        return True
    return implementation == "auto" and backend == "tensorflow" and device == "cpu"


def _attention_kernel(implementation, backend, device, query_length, key_length, chunk_size,
                      needs_scores, flash, soft_capped=False):
    if flash:
        return "keras"
    if implementation == "reference":
        return "reference"
    if implementation in ("blocked", "keras"):
        # Neither kernel builds the score matrix, nor caps logits.
        return "reference" if needs_scores or soft_capped else implementation
    if implementation == "tf_cpu":
        return "tf_cpu"
    # "auto"
    if isinstance(chunk_size, tuple):
        return "blocked"
    if soft_capped:
        # Only the kernels that form the logits cap them.
        return "tf_cpu" if backend == "tensorflow" and device == "cpu" else "reference"
    if (
        chunk_size is None
        and not needs_scores
        and query_length is not None
        and key_length is not None
        and query_length * key_length > AUTO_CHUNK_MIN_SCORES
    ):
        return "blocked"
    if backend == "tensorflow" and device == "cpu":
        return "tf_cpu"
    if device == "gpu" and backend in ("jax", "torch") and not needs_scores:
        return "keras"
    return "reference"


def select_kernel(
    *,
    query_length=None,
    key_length=None,
    chunk_size=None,
    dropout_active=False,
    return_attention_scores=False,
    flash_attention=None,
    logit_soft_cap=None,
    implementation=None,
    backend=None,
    device=None,
):
    """The `KernelPlan` of one attention call, or (without sizes) of a layer.

    Args:
        query_length, key_length: static sequence lengths (None if unknown).
        chunk_size: the call's `chunk_size` (validated by
            `keras_attn.checks.check_chunk_size`): a pair asks for the
            blocked path, 0 forbids it, None lets the sizes decide.
        dropout_active: dropout on the probabilities in training.
        return_attention_scores: the caller wants the probabilities.
        flash_attention: a layer's `flash_attention=True` runs
            `keras.ops.dot_product_attention(flash_attention=True)`, as Keras.
        logit_soft_cap: the call's soft cap (None: none). Capped logits
            are formed by `reference` and `tf_cpu` only: a capped call goes
            to one of them (the setting "blocked" or "keras" runs
            `reference`; an explicit `chunk_size` pair with a cap is refused
            by `dot_product_attention`).
        implementation, backend, device: default to
            `config.get_attention_implementation()`, the Keras backend and
            `config.get_device_type()`.

    Returns:
        A `KernelPlan`; its `attention` is `"reference"`, `"tf_cpu"`,
        `"blocked"` or `"keras"`. The setting `"reference"` turns every
        optimisation off (the plain path that defines the numbers).
    """
    implementation = implementation or config.get_attention_implementation()
    backend = backend or keras.backend.backend()
    device = device or config.get_device_type()
    kernel = _attention_kernel(
        implementation, backend, device, query_length, key_length, chunk_size,
        dropout_active or return_attention_scores, flash_attention,
        soft_capped=logit_soft_cap is not None,
    )
    return KernelPlan(
        attention=kernel,
        cpu_kernels=_cpu_kernels(implementation, backend, device),
        fused_projections=implementation != "reference",
        flash=flash_attention if kernel == "keras" else None,
    )


def record(kernel):
    _last["kernel"] = kernel
    return kernel


def last_kernel():
    """The kernel that the most recent `dot_product_attention` call (eager
    call, or trace of a `tf.function` / `jit`) chose, or None."""
    return _last["kernel"]
