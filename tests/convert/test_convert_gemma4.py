"""Gemma 4 text (`Gemma4ForCausalLM`) from `transformers`, converted with
`from_huggingface`: logits with padding within float32 rounding of
`attn_implementation="eager"`, greedy tokens equal to
`generate(do_sample=False)` (plain and left-padded batches), and what
keras_attn cannot represent refused by the config field and value.

The random-init model (nothing is downloaded) is shaped like the released
checkpoints and has every feature keras_attn represents turned on:
full-attention layers with twice the sliding layers' head size
(`global_head_dim`) and fewer key/value heads (`num_global_key_value_heads`),
twice as wide feed-forwards on the KV-shared layers
(`use_double_wide_mlp`), `use_bidirectional_attention="vision"` (causal
text), per-layer input embeddings (with their own
vocabulary size), the last two layers reusing the keys and values of the
last earlier layer of their type (a sliding and a full one), keys equal to
values on the full layers (`attention_k_eq_v`), the value norm, QK-norm with
unscaled logits, sandwich norms, `layer_scalar`s away from 1, sliding
windows (4) shorter than the prompts on 2 of 4 layers, a local rotary base
on them and "proportional" rotary (half the pairs) on the full ones, a
final soft cap, grouped query heads, `head_dim` unlike hidden / heads;
weights scaled so that attention is sharp. One head size and key/value
head count on every layer (`UNIFORM`) is checked too.
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
SLIDING, FULL = "sliding_attention", "full_attention"
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=36, intermediate_size=52, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=12, global_head_dim=24,
    num_global_key_value_heads=1, use_double_wide_mlp=True,
    sliding_window=4, layer_types=[SLIDING, FULL, SLIDING, FULL],
    num_kv_shared_layers=2, hidden_size_per_layer_input=6, vocab_size_per_layer_input=VOCAB + 5,
    attention_k_eq_v=True,
    rope_parameters={
        SLIDING: {"rope_type": "default", "rope_theta": 100.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1000.0},
    },
    final_logit_softcapping=4.0, tie_word_embeddings=False,
    # The larger released models' value: bidirectional over image tokens, causal text.
    use_bidirectional_attention="vision",
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


FAMILIES = {"gemma4": (transformers.Gemma4ForCausalLM, transformers.Gemma4TextConfig, CONFIG)}


def hf_gemma4(seed=0, **changes):
    model = hf_family("gemma4", FAMILIES, {}, seed, sharpen=True, attn_implementation="eager", **changes)
    with torch.no_grad():  # each layer's output scale, 1 at initialization
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand_like(b) + 0.5)
    return model


# One head size and key/value head count on every layer, one feed-forward width.
UNIFORM = dict(global_head_dim=12, num_global_key_value_heads=None, use_double_wide_mlp=False)


@pytest.fixture(scope="module")
def converted():
    hf = hf_gemma4()
    return hf, from_huggingface(hf)


@pytest.fixture(scope="module")
def converted_uniform():
    hf = hf_gemma4(**UNIFORM)
    return hf, from_huggingface(hf)


def hf_logits(hf, ids, mask):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(ids, dtype=torch.long),
                  attention_mask=torch.tensor(mask)).logits.numpy()


def test_the_test_model_has_what_it_claims(converted):
    """KV-shared layers 2 (sliding) and 3 (full) without key/value tensors,
    the full layer 1 without values (`attention_k_eq_v`), PLE tensors; heads
    of 24 features and one key/value head on the full layers, feed-forwards
    twice as wide on the shared ones; keras_attn's layers the same."""
    hf, lm = converted
    assert hf.config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    state = hf.state_dict()
    names = set(state)
    assert "model.layers.2.self_attn.k_proj.weight" not in names
    assert "model.layers.3.self_attn.k_proj.weight" not in names
    assert "model.layers.1.self_attn.v_proj.weight" not in names
    assert "model.layers.0.self_attn.v_proj.weight" in names
    assert "model.embed_tokens_per_layer.weight" in names
    assert tuple(state["model.layers.1.self_attn.k_proj.weight"].shape) == (1 * 24, 36)
    assert tuple(state["model.layers.3.self_attn.q_proj.weight"].shape) == (4 * 24, 36)
    assert tuple(state["model.layers.0.self_attn.k_proj.weight"].shape) == (2 * 12, 36)
    assert [tuple(state[f"model.layers.{i}.mlp.up_proj.weight"].shape)[0] for i in range(4)] == [
        52, 52, 104, 104]
    assert lm.key_value_sources == [None, None, 0, 1]
    assert (lm.head_dim, lm.num_key_value_heads, lm.intermediate_dim) == (
        [12, 24, 12, 24], [2, 1, 2, 1], [52, 52, 104, 104])
    assert [b.self_attention.query_dense.kernel.shape for b in lm.blocks] == [
        (36, 4, 12), (36, 4, 24), (36, 4, 12), (36, 4, 24)]


@pytest.mark.parametrize("variant", ["released", "uniform"])
def test_logits_with_padding(variant, converted, converted_uniform):
    hf, lm = converted if variant == "released" else converted_uniform
    assert_padded_logits_equal_hf(hf, lm, VOCAB, err_msg=variant)


def test_greedy_tokens_equal_hf_generate(converted):
    hf, lm = converted
    prompts = np.random.default_rng(4).integers(3, VOCAB, size=(3, 6)).astype("int32")
    assert_greedy_equals_hf(hf, lm, prompts, max_length=18)


def test_left_padded_batch_equals_hf_generate(converted):
    hf, lm = converted
    assert_left_padded_greedy_equals_hf(hf, lm, VOCAB, max_length=18)


def test_released_style_config_file_converts_from_a_folder(converted, tmp_path):
    """The released `config.json`s give `global_head_dim` and
    `num_global_key_value_heads` (transformers' `save_pretrained` writes
    `per_layer_config` instead): a folder with those fields converts
    (streaming the safetensors) to the same logits."""
    import json

    hf, _ = converted
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.pop("per_layer_config")
    config.update(global_head_dim=24, num_global_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    lm = from_huggingface(str(tmp_path))
    assert (lm.head_dim, lm.num_key_value_heads) == ([12, 24, 12, 24], [2, 1, 2, 1])
    ids = np.random.default_rng(6).integers(3, VOCAB, size=(1, 9)).astype("int32")
    want = hf_logits(hf, ids, np.ones_like(ids))
    tolerance.assert_close(np.asarray(lm(ids)), want, terms=hf.config.num_hidden_layers * 64)


def test_only_layers_with_their_own_keys_have_caches(converted):
    """Layers 0 and 1 cache (the sliding one a ring of the window), the two
    KV-shared layers none."""
    hf, lm = converted
    shapes = [tuple(layer["self_attention"][0].shape) for layer in lm.init_cache(2, 16)]
    assert shapes == [(2, 4, 2, 12), (2, 16, 1, 24)]


@pytest.mark.parametrize("changes, match", [
    (dict(num_global_key_value_heads=3),
     r"`num_global_key_value_heads`=3 \(of layer 1, full_attention\) does not divide num_attention_heads=4"),
    (dict(enable_moe_block=True, num_experts=2, top_k_experts=1, moe_intermediate_size=8),
     r"`enable_moe_block`=True"),
    (dict(rope_parameters={SLIDING: {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0},
                           FULL: {"rope_type": "default", "rope_theta": 1000.0}}),
     r"`rope_parameters.sliding_attention`"),
    (dict(rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                           FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}}),
     r"`rope_parameters.full_attention`.*rope_type"),
    (dict(use_bidirectional_attention="all"), r"`use_bidirectional_attention`='all'"),
])
def test_refuses_what_it_cannot_represent_by_field(changes, match):
    with pytest.raises(ValueError, match=match):
        from_huggingface(hf_gemma4(**changes))


@pytest.mark.parametrize("option, value", [
    ("key_value_sources", [None, None, 0]), ("per_layer_input_dim", 6),
    ("use_value_norm", True), ("use_output_scale", True),
    ("head_dim", [16, 32, 16]), ("num_key_value_heads", [2, 1, 2]),
    ("intermediate_dim", [32, 64, 64]),
])
def test_fused_onnx_writer_refuses_each_gemma4_option_by_name(option, value):
    """The fused GenAI writer (GroupQueryAttention projects and caches each
    layer's own keys, with one head size) names what it does not cover; the
    export then falls back to the tf2onnx graph
    (test_llm_runtimes_generate_hf_tokens)."""
    from keras_attn.export.onnx_decoder import check_fusable_decoder
    from keras_attn.export.onnx_fused import NotFusableError
    from keras_attn.generation.models import DecoderOnlyLM

    options = dict(num_layers=3, num_heads=2, intermediate_dim=32, head_dim=16,
                   position="rotary", normalization="rms_norm")
    lm = DecoderOnlyLM(40, 16, 32, **{**options, option: value})
    lm(np.zeros((1, 2), "int32"))
    with pytest.raises(NotFusableError, match=rf"^{option}="):
        check_fusable_decoder(lm, max_length=16)


def test_stack_cache_refuses_caches_of_other_shapes(converted):
    """`stack_cache` (one tensor for every layer's cache) says why the full
    layers' cache (1 head of 24) and the sliding ones' (2 of 12) do not
    stack; the prefill/decode exports pad them instead (below)."""
    from keras_attn.generation import cache as cache_lib

    hf, lm = converted
    with pytest.raises(ValueError, match=r"per layer: \[\(2, 12\), \(1, 24\)\]"):
        cache_lib.stack_cache(lm.init_cache(1, 16, ring_buffers=False))


@pytest.mark.slow
def test_tflite_prefill_decode_reproduce_hf_tokens(converted):
    """The TFLite prefill/decode export (builtin ops only) driven by a NumPy
    loop: one stacked cache of the two layers with their own keys (every
    position, the windows a band over them), the sliding layer's 2 heads of
    12 and the full layer's 1 head of 24 padded to (2, 24)."""
    hf, lm = converted
    prompts = np.random.default_rng(4).integers(3, VOCAB, size=(2, 6)).astype("int32")
    want = hf_greedy(hf, prompts, 16)
    interpreter = tflite_signatures(lm, max_length=16, batch_size=2, prompt_length=6)
    decode = interpreter.get_signature_runner("decode")
    assert list(decode.get_input_details()["cache"]["shape"]) == [2, 2, 2, 16, 2, 24]
    got = artifact_greedy(interpreter.get_signature_runner("prefill"), decode, prompts, 16)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got[:, 6:])) > 3, "degenerate generation tests nothing"


@pytest.mark.slow
def test_saved_model_signatures_of_per_layer_caches(converted, tmp_path):
    """The SavedModel prefill/decode export of the same padded stacked cache
    (the ONNX one converts these same functions): the export runs its
    artifact against Keras's forward pass (a ParityError past the float32
    bound)."""
    from keras_attn.runtimes import signatures

    hf, lm = converted
    saved = signatures.export_saved_model(lm, str(tmp_path / "sm"), max_length=16, include_generate=False)
    assert saved.max_abs_error <= saved.atol, saved
    # decode_step too: the caller's part of the padded stacked cache.
    assert [c["signature"] for c in saved.checks] == ["prefill", "decode", "decode_step"]


def _runtime_sized():
    """A Gemma 4 on the runtime tests' word vocabulary, shaped like the
    released ones: head size 32 (as onnxruntime's attention kernels take)
    on the sliding layers, 64 and one key/value head (of 2) on the full
    ones, twice as wide feed-forwards on the KV-shared layers 2 and 3, which
    reuse layers 0 (sliding, window 6 < the generation) and 1 (full); PLE,
    k = v, proportional rotary."""
    from tests.llm_runtime_models import EOS, VOCAB as WORDS

    config = transformers.Gemma4TextConfig(
        vocab_size=WORDS, hidden_size=64, num_hidden_layers=4, intermediate_size=96,
        initializer_range=0.2, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=0,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, global_head_dim=64,
        num_global_key_value_heads=1, use_double_wide_mlp=True, sliding_window=6, layer_types=[SLIDING, FULL, SLIDING, FULL], num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=WORDS, attention_k_eq_v=True,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                         FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                "rope_theta": 1000.0}},
        final_logit_softcapping=5.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.Gemma4ForCausalLM(config).eval()


@pytest.mark.slow
def test_llm_runtimes_generate_hf_tokens(tmp_path):
    """The `.litertlm` bundle in `litert_lm.Engine` and the ONNX Runtime
    GenAI folder (the tf2onnx graph: the fused writer refuses
    `key_value_sources` by name) give transformers' greedy text; each
    layer's cache has its own heads and head size (GenAI reads them from
    the graph's inputs)."""
    litert_lm = pytest.importorskip("litert_lm")
    og = pytest.importorskip("onnxruntime_genai")
    from keras_attn.runtimes import litertlm
    from keras_attn.runtimes.litertlm import export_litertlm
    from keras_attn.runtimes.onnx_genai import export_onnx_genai
    from tests.llm_runtime_models import EOS, MAX_LEN, hf_tokens, keras_tokens, word_tokenizer

    hf = _runtime_sized()
    lm = from_huggingface(hf)
    assert (lm.head_dim, lm.num_key_value_heads) == ([32, 64, 32, 64], [2, 1, 2, 1])
    text = "the red cat sat on the big mat then"
    prompt = [EOS] + word_tokenizer().encode(text).ids
    want = hf_tokens(hf, prompt, MAX_LEN)
    assert want == keras_tokens(lm, prompt, MAX_LEN) and len(want) >= 8

    path = tmp_path / "gemma4.litertlm"
    export_litertlm(lm, path, tokenizer=word_tokenizer(), max_length=MAX_LEN,
                    prefill_lengths=(8, 16), bos_token_id=EOS, stop_token_ids=[EOS])
    engine = litert_lm.Engine(str(path), backend=litert_lm.Backend.CPU())
    try:
        assert litertlm.generate(path, text, engine=engine) == engine.detokenize(want)
    finally:
        engine.close()

    folder = tmp_path / "genai"
    with pytest.warns(UserWarning, match=r"does not cover this model \(key_value_sources="):
        export_onnx_genai(lm, folder, max_length=MAX_LEN, tokenizer=word_tokenizer(), eos_token_id=EOS)
    import onnx

    graph = onnx.load(str(folder / "model.onnx")).graph
    dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim][1:] for i in graph.input}
    assert dims["past_key_values.0.value"] == [2, MAX_LEN, 32], dims
    assert dims["past_key_values.1.key"] == [1, MAX_LEN, 64], dims
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=MAX_LEN, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    got = []
    while not generator.is_done():
        generator.generate_next_token()
        got.append(int(generator.get_next_tokens()[0]))
    assert (got[:got.index(EOS)] if EOS in got else got) == want
