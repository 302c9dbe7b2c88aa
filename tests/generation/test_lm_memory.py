"""Training memory savers of `DecoderOnlyLM`: the chunked `CausalLMLoss` and
per-block rematerialisation compute the plain path's loss and LoRA gradients.

Backend-agnostic: the loss and the remat are keras.ops and `keras.remat`, so
they run on TensorFlow, JAX and torch (tests/conftest.py).
"""

import contextlib

import keras
import numpy as np
import pytest

from keras_attn.data import causal_lm_dataset
from keras_attn.generation import CausalLMLoss, DecoderOnlyLM
from keras_attn.runtimes.tokenizers import character_tokenizer
from tests import tolerance

VOCAB, LENGTH = 11, 16


def _gradients():
    """On torch, gradients back on for `fit` (tests/conftest.py runs the
    backend-agnostic files under `torch.no_grad`)."""
    if keras.backend.backend() != "torch":
        return contextlib.nullcontext()
    import torch

    return torch.enable_grad()


def _dataset():
    # Pairs of unequal lengths, one per row: prompts and padding weighted out,
    # the targets shifted by one (the documented fine-tuning data).
    tokenizer = character_tokenizer("abcdefgh=")  # <pad> 0, <eos> 1, then the characters
    pairs = [("ab=", "ba"), ("abcd=", "dcba"), ("hg=", "gh"), ("efgh=", "hgfe")]
    return causal_lm_dataset(pairs, tokenizer, sequence_length=LENGTH, batch_size=4,
                             packing=False, eos_token_id=1)


def _model(tie, soft_cap=None, lora=True):
    keras.utils.set_random_seed(5)
    lm = DecoderOnlyLM(VOCAB, LENGTH, 16, num_layers=2, num_heads=4, intermediate_dim=32,
                       num_key_value_heads=2, position="rotary", normalization="rms_norm",
                       use_gated_feedforward=True, tie_embeddings=tie, lm_head_use_bias=not tie,
                       final_logit_soft_cap=soft_cap)
    lm(np.zeros((1, 4), "int32"))
    if not lora:
        return lm
    lm.enable_lora(4, target_names=("q_proj", "v_proj", "down_proj"))
    # B away from zero, so that A's gradients are not zero too.
    rng = np.random.default_rng(0)
    for v in lm.trainable_variables:
        if "lora_kernel_b" in v.path:
            v.assign(rng.normal(0, 0.3, v.shape).astype("float32"))
    return lm


def _one_step(lm, loss, remat=False):
    """Loss of one `fit` step with SGD(1.0), and each trainable variable's
    change (minus its gradient)."""
    lm.set_block_remat(remat)
    lm.compile(keras.optimizers.SGD(1.0), loss=loss)
    before = [keras.ops.convert_to_numpy(v) for v in lm.trainable_variables]
    with _gradients():
        history = lm.fit(_dataset(), epochs=1, verbose=0)
    after = [keras.ops.convert_to_numpy(v) for v in lm.trainable_variables]
    return history.history["loss"][0], [b - a for a, b in zip(after, before)]


@pytest.fixture(scope="module")
def plain_steps():
    """The documented path's step, `SparseCategoricalCrossentropy(from_logits=True)`,
    per head: computed once for the module."""
    plain = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return {(tie, cap): _one_step(_model(tie, cap), plain) for tie, cap in ((True, None), (False, 3.0))}


@pytest.mark.parametrize("tie,soft_cap,chunk_size,remat", [
    (True, None, 5, False),         # chunks that do not divide the length
    (True, None, None, True),       # block remat alone
    (False, 3.0, LENGTH, False),    # one chunk
    (False, 3.0, 3, True),          # both savers
    (True, None, 5, 1),             # the first of the two blocks rematerialised
], ids=["tied-chunk5", "tied-remat", "untied-capped-chunk16", "untied-capped-chunk3-remat",
        "tied-chunk5-remat-first-block"])
def test_savers_give_the_plain_loss_and_lora_gradients(plain_steps, tie, soft_cap, chunk_size, remat):
    want_loss, want = plain_steps[(tie, soft_cap)]
    got_loss, got = _one_step(_model(tie, soft_cap), CausalLMLoss(chunk_size=chunk_size), remat)
    scale = tolerance.magnitude(want)
    assert scale > 1e-3  # the gradients are not all zero
    for g, w in zip(got, want):
        tolerance.assert_close(g, w, scale=scale, terms=tolerance.LAYER_TERMS)
    tolerance.assert_close(got_loss, want_loss, terms=LENGTH)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_trainable_head_gets_the_plain_gradients(tie):
    """Full fine-tuning: the head's own weights train too (the rematerialised
    chunks rather than the frozen head's forward-pass gradient)."""
    plain = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    want_loss, want = _one_step(_model(tie, lora=False), plain)
    got_loss, got = _one_step(_model(tie, lora=False), CausalLMLoss(chunk_size=5))
    scale = tolerance.magnitude(want)
    for g, w in zip(got, want):
        tolerance.assert_close(g, w, scale=scale, terms=tolerance.LAYER_TERMS)
    tolerance.assert_close(got_loss, want_loss, terms=LENGTH)


def test_loss_is_the_weighted_cross_entropy_over_every_token():
    """Against NumPy in float64: `sum(w * ce) / (B * T)`, SparseCategoricalCrossentropy's
    reduction, on logits and through the model's hidden states in chunks."""
    lm = _model(tie=False, soft_cap=3.0)
    ids, targets, weights = next(iter(_dataset()))
    ids, targets, weights = (np.asarray(t) for t in (ids, targets, weights))
    assert 0 < weights.sum() < weights.size  # prompts and padding weighted out
    logits = np.asarray(keras.ops.convert_to_numpy(lm(ids)), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    ce = -np.take_along_axis(log_probs, targets[..., None].astype(int), -1)[..., 0]
    want = (ce * weights).sum() / ce.size
    got = CausalLMLoss()(targets, logits.astype("float32"), sample_weight=weights)
    tolerance.assert_close(keras.ops.convert_to_numpy(got), want, scale=np.abs(ce).max(), terms=ce.size)
    lm.compile("sgd", loss=CausalLMLoss(chunk_size=6))
    hidden = lm(ids, training=True)
    assert tuple(hidden.shape) == (4, LENGTH, 16)  # no logits in training
    chunked = lm.compute_loss(ids, targets, hidden, weights, training=True)
    tolerance.assert_close(keras.ops.convert_to_numpy(chunked), want, scale=np.abs(ce).max(), terms=ce.size)


def test_inference_and_evaluate_give_logits_under_a_chunked_loss():
    lm = _model(tie=True)
    plain = keras.ops.convert_to_numpy(lm(np.array([[2, 3, 4]])))
    lm.compile("sgd", loss=CausalLMLoss(chunk_size=4))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(lm(np.array([[2, 3, 4]]))), plain)
    assert np.isfinite(lm.evaluate(_dataset(), verbose=0))


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="chunk_size"):
        CausalLMLoss(chunk_size=0)
    with pytest.raises(ValueError, match="reduction"):
        CausalLMLoss(reduction="sum")
    lm = _model(tie=True)
    with pytest.raises(ValueError, match="metrics"):
        lm.compile("sgd", loss=CausalLMLoss(chunk_size=4), metrics=["accuracy"])
    for bad in ("yes", 3, -1, 1.0):  # the model has two blocks
        with pytest.raises(TypeError, match="enabled"):
            lm.set_block_remat(bad)


def test_loss_config_round_trips():
    loss = CausalLMLoss(chunk_size=7)
    again = keras.losses.deserialize(keras.losses.serialize(loss))
    assert isinstance(again, CausalLMLoss) and again.chunk_size == 7
