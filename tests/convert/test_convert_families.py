"""Qwen3, Gemma 2, Gemma 3 (text), SmolLM3 and Phi-3 / Phi-4-mini decoders
from `transformers`, converted with `from_huggingface`: logits with padding
within float32 rounding of `attn_implementation="eager"`, greedy tokens
equal to `generate(do_sample=False)` (plain and left-padded batches), and
the relatives that cannot be represented refused by name.

Random-init models (nothing is downloaded) at small sizes chosen so that
every feature is active: query heads in groups over the key/value heads,
`head_dim` unrelated to `hidden_size / num_attention_heads`, sliding windows
(on some layers) shorter than the prompts, soft caps below the logits'
size, rotary scaling that switches at the test lengths, partial rotary;
weights scaled so that attention is sharp (logits of order 10).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from keras_attn.convert import from_huggingface  # noqa: E402
from tests import tolerance  # noqa: E402
from tests.llm_runtime_models import artifact_greedy, assert_greedy_equals_hf, hf_family, hf_greedy  # noqa: E402
from tests.llm_runtime_models import assert_left_padded_greedy_equals_hf, assert_padded_logits_equal_hf  # noqa: E402
from tests.llm_runtime_models import tflite_signatures  # noqa: E402

VOCAB = 71
# The reference is transformers' `attn_implementation="eager"` (the docstring above).
COMMON = dict(vocab_size=VOCAB, hidden_size=36, intermediate_size=52, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, attn_implementation="eager")


def _phi_factors(n, seed):
    return [float(f) for f in np.random.default_rng(seed).uniform(1.0, 4.0, n)]


FAMILIES = {
    # QK-norm, head_dim 10 (not 36 / 6), 6 query heads over 2, windows on
    # the layers after `max_window_layers`, untied head.
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, dict(
        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=10,
        use_sliding_window=True, sliding_window=4, max_window_layers=1,
        tie_word_embeddings=False)),
    "qwen3_tied_bias": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=12,
        attention_bias=True, tie_word_embeddings=True)),
    # Soft caps below the logits' size, sliding and full layers, a
    # query_pre_attn_scalar unlike head_dim.
    "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config, dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
        sliding_window=4, query_pre_attn_scalar=4, attn_logit_softcapping=3.0,
        final_logit_softcapping=2.5, tie_word_embeddings=False)),
    # QK-norm, sandwich norms, local and global rotary bases (the global one
    # linearly scaled), sliding window 4 on 2 of 3 layers, a final soft cap
    # (an attention cap in the config, which Gemma 3's attention ignores).
    "gemma3": (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig, dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
        sliding_window=4, sliding_window_pattern=2, query_pre_attn_scalar=16,
        attn_logit_softcapping=1.0, final_logit_softcapping=4.0,
        rope_local_base_freq=100.0, rope_theta=1000.0,
        rope_scaling=dict(rope_type="linear", factor=2.0), tie_word_embeddings=False)),
    # Layers 0 and 2 rotary, 1 and 3 not.
    "smollm3": (transformers.SmolLM3ForCausalLM, transformers.SmolLM3Config, dict(
        num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
        no_rope_layers=[1, 0, 1, 0], tie_word_embeddings=False)),
    # Partial rotary 0.5 of head_dim 12, longrope with the long factors
    # once a call reaches position 2 (Hugging Face's generate recomputes the
    # cache when a generation crosses that point, and picks the factors by
    # the batch's longest row; keras_attn's loop does neither, so the
    # generations here run past it; both sets are checked on logits by
    # test_longrope_short_and_long_factors), 3 query heads over 1.
    "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config, dict(
        num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
        max_position_embeddings=32, original_max_position_embeddings=2,
        rope_scaling=dict(rope_type="longrope", short_factor=_phi_factors(3, 1),
                          long_factor=_phi_factors(3, 2)),
        partial_rotary_factor=0.5, tie_word_embeddings=False)),
    # Phi-4-mini-like: partial rotary 0.75 (12 of head_dim 16 rotated),
    # 4 query heads over 2, a window of 5 on every layer.
    "phi4_mini_window": (transformers.Phi3ForCausalLM, transformers.Phi3Config, dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, partial_rotary_factor=0.75, sliding_window=5,
        tie_word_embeddings=False)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    hf = hf_family(request.param, FAMILIES, COMMON, sharpen=True, random_biases=True)
    return request.param, hf, from_huggingface(hf)


def hf_logits(hf, ids, mask):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(ids, dtype=torch.long),
                  attention_mask=torch.tensor(mask)).logits.numpy()


def test_logits_with_padding(family):
    name, hf, lm = family
    assert_padded_logits_equal_hf(hf, lm, VOCAB, err_msg=name)


def _uncapped(hf, **changes):
    """`hf` with the same weights and `changes` to its config."""
    config = type(hf.config)(**{**hf.config.to_dict(), **changes})
    config._attn_implementation = "eager"
    model = type(hf)(config).eval()
    model.load_state_dict(hf.state_dict())
    return model


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_soft_caps_are_active(cap):
    """The Gemma 2 test model's logits change when a cap is removed: each
    cap is active at the test's sizes, so the logits test checks it."""
    hf = hf_family("gemma2", FAMILIES, COMMON, sharpen=True, random_biases=True)
    ids = np.random.default_rng(5).integers(3, VOCAB, size=(1, 13)).astype("int32")
    mask = np.ones_like(ids)
    capped, uncapped = hf_logits(hf, ids, mask), hf_logits(_uncapped(hf, **{cap: None}), ids, mask)
    assert np.abs(capped - uncapped).max() > 0.1 * np.abs(capped).max()


@pytest.mark.parametrize("length", [2, 13])
def test_longrope_short_and_long_factors(length):
    """Phi-3's longrope: the short factors up to `original_max_position_embeddings`
    positions, the long ones past it (the family fixture's model is always long)."""
    hf = hf_family("phi3", FAMILIES, COMMON, sharpen=True, random_biases=True)
    lm = from_huggingface(hf)
    ids = np.random.default_rng(length).integers(3, VOCAB, size=(1, length)).astype("int32")
    want = hf_logits(hf, ids, np.ones_like(ids))
    tolerance.assert_close(np.asarray(lm(ids)), want, terms=2 * 64)


# Families whose random-init models generate more than a repeated token
# (a tied head with these weights repeats the last prompt token).
GREEDY = sorted(set(FAMILIES) - {"qwen3_tied_bias"})


@pytest.mark.parametrize("family", GREEDY, indirect=True)
def test_greedy_tokens_equal_hf_generate(family):
    name, hf, lm = family
    # The shapes of the left-padded test: one trace of the search serves both.
    prompts = np.random.default_rng(4).integers(3, VOCAB, size=(3, 6)).astype("int32")
    assert_greedy_equals_hf(hf, lm, prompts, max_length=18)


@pytest.mark.parametrize("family", GREEDY, indirect=True)
def test_left_padded_batch_equals_hf_generate(family):
    _, hf, lm = family
    assert_left_padded_greedy_equals_hf(hf, lm, VOCAB, max_length=18)


def test_windowed_layers_have_ring_caches(family):
    """Layers with a window shorter than `max_length` cache only the window;
    the others every position; all hold the key/value heads only."""
    name, hf, lm = family
    config = hf.config
    cache = lm.init_cache(2, 16)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    for i, layer in enumerate(cache):
        keys, values = layer["self_attention"]
        windowed = window is not None and (
            name.startswith("phi") or (layer_types[i] == "sliding_attention"
                               and getattr(config, "use_sliding_window", True)))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        assert tuple(keys.shape) == (2, window if windowed else 16, config.num_key_value_heads, head_dim)
        assert tuple(values.shape) == tuple(keys.shape)


@pytest.mark.parametrize("build, match", [
    # A scaled local rotary base: only the global one takes `rope_scaling`.
    (lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **{**COMMON, **FAMILIES["gemma3"][2], "rope_scaling": None},
        rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 100.0}})),
     r"rope_parameters.sliding_attention"),
    (lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **{**COMMON, **FAMILIES["qwen3"][2]}, rope_scaling=dict(rope_type="yarn", factor=2.0))),
     r"rope_scaling.*yarn"),
    (lambda: transformers.Gemma2Model(transformers.Gemma2Config(**{**COMMON, **FAMILIES["gemma2"][2]})),
     r"Received: architecture='Gemma2Model'"),
])
def test_refuses_what_it_cannot_represent(build, match):
    with pytest.raises(ValueError, match=match):
        from_huggingface(build())


@pytest.mark.slow
@pytest.mark.parametrize("name, changes", [
    # QK-norm with a window on some layers only (`max_window_layers`),
    # Gemma 3 as released (sandwich norms, two rotary bases, windows on 2 of
    # 3 layers), partial rotary with a window on every layer. Gemma 2,
    # SmolLM3 and the longrope Phi-3: their bundles' TFLite models run in a
    # NumPy loop in tests/runtimes/test_litertlm.py::test_families_generate_hf_tokens.
    ("qwen3", {}), ("gemma3", {}), ("phi4_mini_window", {}),
])
def test_tflite_prefill_decode_reproduce_hf_tokens(name, changes):
    """The TFLite prefill/decode export (builtin ops only) of the families.
    With windows on some layers only, every layer's cache holds
    `max_length` positions and the window is a band over them
    (`DecoderTrace`: one cache length for the stacked caches); with one
    window on every layer the caches are rings of that window."""
    hf = hf_family(name, FAMILIES, COMMON, sharpen=True, random_biases=True, **changes)
    lm = from_huggingface(hf)
    prompts = np.random.default_rng(4).integers(3, VOCAB, size=(2, 6)).astype("int32")
    want = hf_greedy(hf, prompts, 16)
    interpreter = tflite_signatures(lm, max_length=16, batch_size=2, prompt_length=6)
    got = artifact_greedy(interpreter.get_signature_runner("prefill"),
                           interpreter.get_signature_runner("decode"), prompts, 16)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got[:, 6:])) > 3, "degenerate generation tests nothing"
