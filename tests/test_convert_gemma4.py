"""Gemma 4 text (`Gemma4ForCausalLM`) from `transformers`, converted with
`from_huggingface`: logits with padding within float32 rounding of
`attn_implementation="eager"`, greedy tokens equal to
`generate(do_sample=False)` (plain and left-padded batches), and what
keras_attn cannot represent refused by the config field and value.

The random-init model (nothing is downloaded) has every feature keras_attn
represents turned on: per-layer input embeddings (with their own
vocabulary size), the last two layers reusing the keys and values of the
last earlier layer of their type (a sliding and a full one), keys equal to
values on the full layers (`attention_k_eq_v`), the value norm, QK-norm with
unscaled logits, sandwich norms, `layer_scalar`s away from 1, sliding
windows (4) shorter than the prompts on 3 of 5 layers, a local rotary base
on them and "proportional" rotary (half the pairs) on the full ones, a
final soft cap, grouped query heads, `head_dim` unlike hidden / heads;
weights scaled so that attention is sharp.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from keras_attn.convert import from_huggingface  # noqa: E402
from keras_attn.generation import greedy_search  # noqa: E402
from tests import model_zoo  # noqa: E402
from tests import tolerance  # noqa: E402

VOCAB = 71
SLIDING, FULL = "sliding_attention", "full_attention"
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=36, intermediate_size=52, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=2, head_dim=12, global_head_dim=12,
    sliding_window=4, layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL],
    num_kv_shared_layers=2, hidden_size_per_layer_input=6, vocab_size_per_layer_input=VOCAB + 5,
    attention_k_eq_v=True,
    rope_parameters={
        SLIDING: {"rope_type": "default", "rope_theta": 100.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1000.0},
    },
    final_logit_softcapping=4.0, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def hf_gemma4(seed=0, **changes):
    config = transformers.Gemma4TextConfig(**{**CONFIG, **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:  # sharp attention, spread logits
                p.mul_(8.0)
            elif name.endswith("norm.weight"):  # Gemma 4's norms multiply by the weight
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand_like(b) + 0.5)
    return model


@pytest.fixture(scope="module")
def converted():
    hf = hf_gemma4()
    return hf, from_huggingface(hf)


def hf_logits(hf, ids, mask):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(ids, dtype=torch.long),
                  attention_mask=torch.tensor(mask)).logits.numpy()


def test_the_test_model_has_what_it_claims(converted):
    """KV-shared layers 3 (sliding) and 4 (full) without key/value tensors,
    full layers without values (`attention_k_eq_v`), PLE tensors."""
    hf, lm = converted
    assert hf.config.kv_sharing_modes == [None, "store", "store", "reuse", "reuse"]
    names = set(hf.state_dict())
    assert "model.layers.3.self_attn.k_proj.weight" not in names
    assert "model.layers.1.self_attn.v_proj.weight" not in names
    assert "model.layers.2.self_attn.v_proj.weight" in names
    assert "model.embed_tokens_per_layer.weight" in names
    assert lm.key_value_sources == [None, None, None, 2, 1]


def test_logits_with_padding(converted):
    hf, lm = converted
    rng = np.random.default_rng(5)
    ids = rng.integers(3, VOCAB, size=(2, 13)).astype("int32")
    mask = np.ones_like(ids)
    mask[0, 9:] = 0
    ids[0, 9:] = 0
    want = hf_logits(hf, ids, mask)
    got = np.asarray(lm(ids, padding_mask=mask.astype(bool)))
    valid = mask.astype(bool)
    # A few blocks of sums over the hidden, head and key sizes (tests/tolerance.py).
    tolerance.assert_close(got[valid], want[valid], terms=hf.config.num_hidden_layers * 64)
    assert np.abs(want).max() > 1.0, "logits too flat to test anything"


def test_greedy_tokens_equal_hf_generate(converted):
    hf, lm = converted
    prompts = np.random.default_rng(4).integers(3, VOCAB, size=(3, 6)).astype("int32")
    with torch.no_grad():
        want = hf.generate(
            torch.tensor(prompts, dtype=torch.long),
            attention_mask=torch.ones(prompts.shape, dtype=torch.long),
            do_sample=False, max_length=18, pad_token_id=0, eos_token_id=None,
        ).numpy()
    got = np.asarray(greedy_search(lm, prompts, max_length=18, pad_token_id=0))
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got[:, 6:])) > 3, "degenerate generation tests nothing"


def test_left_padded_batch_equals_hf_generate(converted):
    hf, lm = converted
    ids, mask = model_zoo.left_padded_prompts(VOCAB)
    with torch.no_grad():
        want = hf.generate(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                           do_sample=False, max_length=18, pad_token_id=0,
                           eos_token_id=None).numpy()
    got = np.asarray(greedy_search(lm, ids, max_length=18, attention_mask=mask))
    np.testing.assert_array_equal(got, want)


def test_only_layers_with_their_own_keys_have_caches(converted):
    """Layers 0-2 cache (sliding ones a ring of the window), the two
    KV-shared layers none."""
    hf, lm = converted
    shapes = [tuple(layer["self_attention"][0].shape) for layer in lm.init_cache(2, 16)]
    assert shapes == [(2, 4, 2, 12), (2, 16, 2, 12), (2, 4, 2, 12)]


@pytest.mark.parametrize("changes, match", [
    (dict(global_head_dim=16), r"`global_head_dim`=16 \(of the full_attention layers\) differs from head_dim=12"),
    (dict(num_global_key_value_heads=1), r"`num_global_key_value_heads`=1 .*differs from num_key_value_heads=2"),
    (dict(use_double_wide_mlp=True), r"`use_double_wide_mlp`=True"),
    (dict(enable_moe_block=True, num_experts=2, top_k_experts=1, moe_intermediate_size=8),
     r"`enable_moe_block`=True"),
    (dict(rope_parameters={SLIDING: {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0},
                           FULL: {"rope_type": "default", "rope_theta": 1000.0}}),
     r"`rope_parameters.sliding_attention`"),
    (dict(rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                           FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}}),
     r"`rope_parameters.full_attention`.*rope_type"),
    (dict(use_bidirectional_attention="all"), r"`use_bidirectional_attention`"),
])
def test_refuses_what_it_cannot_represent_by_field(changes, match):
    with pytest.raises(ValueError, match=match):
        from_huggingface(hf_gemma4(**changes))
