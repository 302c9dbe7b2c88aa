"""One table of decoder variants for every graph writer (tests/export/test_decoder_writers.py,
tests/export/test_description.py).

Each variant is a small `DecoderOnlyLM` with one family's features and the
set of direct writers that must cover it (`keras_attn.export.capabilities`:
"onnx_genai", "onnx_signatures", "litertlm", "tflite_signatures"); the
tests run each writer on each variant it covers and check every other
writer refuses it by name.
"""

import keras
import numpy as np

VOCAB, CACHE = 97, 32
WRITERS = ("onnx_genai", "onnx_signatures", "litertlm", "tflite_signatures")
ALL = frozenset(WRITERS)
NOT_GENAI = ALL - {"onnx_genai"}
NONE = frozenset()

# head_dim 16 by default: GroupQueryAttention's kernels take multiples of 16.
BASE = dict(vocabulary_size=VOCAB, sequence_length=64, hidden_dim=48, num_layers=2, head_dim=16,
            num_heads=4, intermediate_dim=80, position="rotary", normalization="rms_norm",
            use_gated_feedforward=True, activation="silu", attention_use_bias=False,
            attention_output_use_bias=False, feedforward_use_bias=False,
            lm_head_use_bias=False, mask_padded_queries=False)

LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0],
            "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0],
            "original_max_position_embeddings": 64, "attention_factor": 1.2}

# name -> (options over BASE, writers that cover it)
VARIANTS = {
    # Llama: grouped-query heads, SiLU-gated feed-forward, untied head.
    "llama": (dict(num_heads=6, num_key_value_heads=2), ALL),
    # One key/value head for every query head.
    "multi_query": (dict(num_key_value_heads=1), ALL),
    # Qwen2: biased q/k/v, tied head.
    "qwen2": (dict(num_heads=6, num_key_value_heads=2, attention_use_bias=True, tie_embeddings=True), ALL),
    # Gemma: multi-query, head_dim unlike hidden/heads, tanh-GELU gate, scaled embeddings.
    "gemma": (dict(num_key_value_heads=1, head_dim=32, activation="gelu_tanh",
                   embedding_scale=48 ** 0.5, tie_embeddings=True), ALL),
    # Mistral: one window shorter than the cache (a ring for the signature writers).
    "mistral": (dict(num_heads=6, num_key_value_heads=2, sliding_window=5), ALL),
    # Qwen3: QK-norm; a window on the first layer only.
    "qwen3": (dict(num_heads=6, num_key_value_heads=2, use_qk_norm=True, sliding_window=[5, None]), ALL),
    # Gemma 2: sandwich norms, attention and final soft caps, local layers
    # with their own rotary base.
    "gemma2": (dict(num_key_value_heads=2, head_dim=32, activation="gelu_tanh",
                    embedding_scale=48 ** 0.5, tie_embeddings=True, use_sandwich_norm=True,
                    attention_logit_soft_cap=4.0, final_logit_soft_cap=2.0,
                    sliding_window=[5, None], local_rope_max_wavelength=50.0), ALL),
    # Gemma 3: QK-norm and sandwich norms, global layer first.
    "gemma3": (dict(num_key_value_heads=1, head_dim=32, activation="gelu_tanh", use_qk_norm=True,
                    use_sandwich_norm=True, sliding_window=[None, 4], local_rope_max_wavelength=50.0), ALL),
    # SmolLM3: a layer without rotary positions.
    "smollm3": (dict(num_heads=6, num_key_value_heads=2, rotary_layers=[False, True]), ALL),
    # Llama 3.1 frequencies.
    "llama3_rope": (dict(num_heads=6, num_key_value_heads=3, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}), ALL),
    "linear_rope": (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), ALL),
    # Phi-3: rotary on half of each head, LongRoPE within its original length.
    "phi3": (dict(num_heads=6, num_key_value_heads=3, head_dim=32, partial_rotary_factor=0.5,
                  rope_scaling=LONGROPE), ALL),
    # Not gated, ReLU, biased everywhere (the head too).
    "plain_ffn": (dict(use_gated_feedforward=False, activation="relu", feedforward_use_bias=True,
                       attention_use_bias=True, attention_output_use_bias=True, lm_head_use_bias=True), ALL),
    # PEFT-style adapters (non-zero B) on attention and feed-forward
    # projections: every writer serves the merged kernels, so each runtime's
    # logits are the adapted model's.
    "lora": (dict(num_heads=6, num_key_value_heads=2, attention_use_bias=True,
                  lora_targets=("q_proj", "v_proj", "o_proj", "down_proj")), ALL),
    # Sizes GroupQueryAttention does not take.
    "head_dim_24": (dict(head_dim=24), NOT_GENAI),
    "rotary_8_of_16": (dict(partial_rotary_factor=0.5), NOT_GENAI),
    # Gemma 4's per-layer sizes.
    "widths_per_layer": (dict(intermediate_dim=[80, 112]), NOT_GENAI),
    "head_dims_per_layer": (dict(head_dim=[16, 32], num_key_value_heads=[2, 1]), frozenset({"litertlm"})),
    # GPT-2-like: LayerNorm, learned positions, biases, GELU.
    "gpt2": (dict(position="learned", normalization="layer_norm", use_gated_feedforward=False,
                  activation="gelu", attention_use_bias=True, attention_output_use_bias=True,
                  feedforward_use_bias=True), frozenset({"onnx_signatures"})),
    "sinusoidal": (dict(position="sinusoidal", normalization="layer_norm"), frozenset({"onnx_signatures"})),
    # Refused by every direct writer (each says why).
    "relative": (dict(position="relative"), NONE),
    "dynamic_rope": (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0,
                                        "original_max_position_embeddings": 8}), NONE),
    "gemma4": (dict(num_layers=3, num_key_value_heads=[2, 1, 1], head_dim=[16, 32, 32],
                    intermediate_dim=[80, 80, 112], sliding_window=[5, None, None],
                    key_value_sources=[None, None, 1], per_layer_input_dim=4,
                    per_layer_input_vocabulary_size=VOCAB, use_value_norm=True, use_output_scale=True,
                    use_qk_norm=True, use_sandwich_norm=True, local_rope_max_wavelength=50.0,
                    final_logit_soft_cap=5.0), NONE),
}


def make_lm(name):
    """The variant `name`, built (`build_lm`)."""
    return build_lm(**VARIANTS[name][0])


def build_lm(**options):
    """A `DecoderOnlyLM` of `BASE` with `options`, built, with weights spread
    so that attention is sharp (logits of order 10) and biases and norm
    scales are visible; `lora_targets`: rank-2 adapters with random B on
    those projections."""
    from keras_attn.generation import DecoderOnlyLM

    keras.utils.set_random_seed(0)
    options = {**BASE, **options}
    lora_targets = options.pop("lora_targets", None)
    if options["position"] == "rotary":
        options.setdefault("rope_max_wavelength", 500.0)
    lm = DecoderOnlyLM(**options)
    lm(np.zeros((1, 1), "int32"))
    rng = np.random.default_rng(0)
    for w in lm.weights:
        value = keras.ops.convert_to_numpy(w)
        if "query" in w.path or "key" in w.path:
            value = value * 3
        if "bias" in w.path or "scale" in w.path or "gamma" in w.path or "beta" in w.path:
            value = value + rng.standard_normal(value.shape).astype("float32") * 0.3
        w.assign(value)
    if lora_targets:
        for layer in lm.enable_lora(2, target_names=lora_targets, lora_alpha=4):
            layer.lora_kernel_b.assign(rng.standard_normal(layer.lora_kernel_b.shape).astype("float32"))
    return lm
