"""LoRA fine-tunes shipped as ONNX Runtime adapters beside one GenAI folder.

`export_onnx_genai(..., adapters=True)` writes the base weights with each
adapted projection's A and scaled B as graph inputs, and the model's own
adapter as `adapter.onnx_adapter`; `save_onnx_adapter` writes another
fine-tune of the same base. ONNX Runtime GenAI loads both
(`og.Adapters.load`) and activates one per generator: its logits and greedy
tokens are those of the Keras model with that adapter, and with none active
those of the base model (Keras, without LoRA). The references are the Keras
models (their LoRA path is checked against PEFT in
tests/generation/test_lora_peft.py); backend-agnostic (the direct writer
reads the Keras weights, the references are Keras forward passes).
"""

import numpy as np
import pytest

import keras

from tests import tolerance
from tests.export.decoder_variants import build_lm
from tests.llm_runtime_models import forward_greedy
from tests.reference import blockwise_dequantized

og = pytest.importorskip("onnxruntime_genai")

from keras_attn.runtimes import export_onnx_genai, save_onnx_adapter  # noqa: E402

# Llama-like: grouped-query heads (packed Q/K/V with K left unadapted), gated feed-forward.
OPTIONS = dict(num_heads=6, num_key_value_heads=2)
TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
CACHE = 32
PROMPT = [5, 17, 33, 2, 60, 41]
# (rank, lora_alpha, seed) of the two fine-tunes: other ranks and scales.
ADAPTERS = {"one": (4, 8, 1), "two": (2, 16, 2)}


def adapted(rank, alpha, seed):
    """The base model (`build_lm`, the same weights every call) with LoRA on
    `TARGETS`, A as initialized and B random (nonzero: the adapter acts)."""
    lm = build_lm(**OPTIONS)
    layers = lm.enable_lora(rank, target_names=TARGETS, lora_alpha=alpha)
    rng = np.random.default_rng(seed)
    for layer in layers:
        layer.lora_kernel_a.assign(rng.uniform(-0.3, 0.3, layer.lora_kernel_a.shape).astype("float32"))
        layer.lora_kernel_b.assign(rng.standard_normal(layer.lora_kernel_b.shape).astype("float32") * 0.3)
    return lm


def last_logits(lm, prompt):
    return keras.ops.convert_to_numpy(lm(np.array([prompt])))[0, -1]


def assert_far_apart(a, b, what):
    """Two models' logits, far apart next to the float32 bound of the comparisons."""
    bound = tolerance.bound(tolerance.magnitude(a, b), terms=tolerance.LAYER_TERMS * 2)
    assert np.abs(a - b).max() > 1000 * bound, what


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A float32 GenAI folder of adapter "one", adapter "two" saved beside it."""
    path = tmp_path_factory.mktemp("genai_lora")
    report = export_onnx_genai(adapted(*ADAPTERS["one"]), path, max_length=CACHE, eos_token_id=0,
                               adapters=True)
    assert "adapter.onnx_adapter" in report.files
    save_onnx_adapter(adapted(*ADAPTERS["two"]), path / "two.onnx_adapter", folder=path)
    return path


def generator(model, adapters, name, prompt=PROMPT):
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 10, do_sample=False)
    g = og.Generator(model, params)
    if name is not None:
        g.set_active_adapter(adapters, name)
    g.append_tokens(np.array([prompt], np.int32))
    return g


def test_each_generator_runs_its_own_adapter_or_the_base(folder):
    model = og.Model(str(folder))
    adapters = og.Adapters(model)
    adapters.load(str(folder / "adapter.onnx_adapter"), "one")
    adapters.load(str(folder / "two.onnx_adapter"), "two")
    references = {name: adapted(*ADAPTERS[name]) for name in ADAPTERS}
    references[None] = build_lm(**OPTIONS)  # no adapter: the base model

    # Three generators alive at once, stepped in turn: the adapter is per generator.
    generators = {name: generator(model, adapters, name) for name in references}
    logits = {}
    for name, g in generators.items():
        logits[name] = np.asarray(g.get_logits())[0, -1]
        want = last_logits(references[name], PROMPT)
        tolerance.assert_close(logits[name], want, terms=tolerance.LAYER_TERMS * 2, err_msg=f"adapter {name}")
    while not all(g.is_done() for g in generators.values()):
        for g in generators.values():
            if not g.is_done():
                g.generate_next_token()
    for name, g in generators.items():
        got = [int(t) for t in np.asarray(g.get_sequence(0))]
        assert got == forward_greedy(references[name], PROMPT, len(got)), f"adapter {name}"
    for a, b in (("one", None), ("two", None), ("one", "two")):
        assert_far_apart(logits[a], logits[b], (a, b))
    sequences = {name: tuple(np.asarray(g.get_sequence(0))) for name, g in generators.items()}
    assert len(set(sequences.values())) == 3, "the adapters do not change the tokens: nothing is tested"


def test_merged_export_is_the_adapted_model(tmp_path):
    """Without `adapters`, the adapter is merged into the weights: the folder
    runs the adapted model with no adapter to load, and has no LoRA input."""
    import onnx

    lm = adapted(*ADAPTERS["one"])
    export_onnx_genai(lm, tmp_path, max_length=CACHE, eos_token_id=0, writer="direct")
    assert not [i.name for i in onnx.load(str(tmp_path / "model.onnx")).graph.input if ".lora_" in i.name]
    assert not (tmp_path / "adapter.onnx_adapter").exists()
    model = og.Model(str(tmp_path))
    got = np.asarray(generator(model, None, None).get_logits())[0, -1]
    tolerance.assert_close(got, last_logits(lm, PROMPT), terms=tolerance.LAYER_TERMS * 2)
    assert_far_apart(got, last_logits(build_lm(**OPTIONS), PROMPT), "merged adapter against the base")


@pytest.mark.parametrize("quantization,bits", [("int4", 4), ("int8", 8)])
def test_quantized_base_with_float_adapters(tmp_path, quantization, bits):
    """int4/int8 base weights (MatMulNBits) with the adapters in float32
    beside them. With `accuracy_level=0` onnxruntime computes in float32 on
    the dequantized weights: with the adapter active the logits are those
    of the Keras model whose base kernels are their blockwise-quantized
    values (computed in the test) plus the same adapter; with none, of that
    base alone."""
    export_onnx_genai(adapted(*ADAPTERS["one"]), tmp_path, max_length=CACHE, eos_token_id=0,
                      adapters=True, quantization=quantization, accuracy_level=0)
    model = og.Model(str(tmp_path))
    adapters = og.Adapters(model)
    adapters.load(str(tmp_path / "adapter.onnx_adapter"), "one")
    for name, reference in (("one", adapted(*ADAPTERS["one"])), (None, build_lm(**OPTIONS))):
        for layer in reference._flatten_layers(include_self=False):
            variable = getattr(layer, "_kernel", None)
            if variable is None:  # not a projection
                continue
            value = keras.ops.convert_to_numpy(variable)
            # (in, out) as the writer packs it: the output projection's input is its first two axes.
            flat = (value.reshape(-1, value.shape[-1]) if layer.name == "attention_output"
                    else value.reshape(value.shape[0], -1))
            variable.assign(blockwise_dequantized(flat, bits).reshape(value.shape))
        got = np.asarray(generator(model, adapters, name).get_logits())[0, -1]
        tolerance.assert_close(got, last_logits(reference, PROMPT), terms=tolerance.LAYER_TERMS * 2,
                               err_msg=f"{quantization}, adapter {name}")


def test_adapter_of_fewer_projections_leaves_the_others_as_the_base(folder, tmp_path):
    """An adapter on some of the folder's adapted projections (q_proj only,
    another rank): the others keep their empty defaults, the base weights."""
    lm = build_lm(**OPTIONS)
    rng = np.random.default_rng(3)
    for query in lm.enable_lora(3, target_names=("q_proj",)):
        query.lora_kernel_b.assign(rng.standard_normal(query.lora_kernel_b.shape).astype("float32"))
    save_onnx_adapter(lm, tmp_path / "q.onnx_adapter", folder=folder)
    model = og.Model(str(folder))
    adapters = og.Adapters(model)
    adapters.load(str(tmp_path / "q.onnx_adapter"), "q")
    got = np.asarray(generator(model, adapters, "q").get_logits())[0, -1]
    want = last_logits(lm, PROMPT)
    tolerance.assert_close(got, want, terms=tolerance.LAYER_TERMS * 2)
    assert_far_apart(want, last_logits(build_lm(**OPTIONS), PROMPT), "q_proj adapter against the base")


def test_adapter_of_other_projections_is_refused(folder, tmp_path):
    lm = build_lm(**OPTIONS)
    lm.enable_lora(2, target_names=("k_proj",))
    with pytest.raises(ValueError, match="k_proj.lora_A.weight is not an input"):
        save_onnx_adapter(lm, tmp_path / "k.onnx_adapter", folder=folder)


def test_capability_table_keeps_adapters_apart_in_genai_and_litertlm_only():
    from keras_attn.export import capabilities

    described = adapted(*ADAPTERS["one"]).describe()
    for writer in ("onnx_genai", "litertlm"):  # litertlm: tests/runtimes/test_litertlm_lora.py
        assert capabilities.support(described, writer, adapters=True) is None
    for writer in capabilities.DECODERS - {"onnx_genai", "litertlm"}:
        assert capabilities.support(described, writer) is None  # merged
        reason = capabilities.support(described, writer, adapters=True)
        assert "a LoRA adapter on query" in reason and capabilities.WRITERS[writer] in reason


def test_refusals_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="no LoRA adapter to write apart"):
        export_onnx_genai(build_lm(**OPTIONS), tmp_path, max_length=CACHE, adapters=True)
    merged = adapted(*ADAPTERS["one"])
    merged.merge_lora()
    with pytest.raises(ValueError, match="no LoRA adapter to write apart"):
        save_onnx_adapter(merged, tmp_path / "merged.onnx_adapter")
    lm = adapted(*ADAPTERS["one"])
    with pytest.raises(ValueError, match="writer='traced'"):
        export_onnx_genai(lm, tmp_path, max_length=CACHE, adapters=True, writer="traced")
    with pytest.raises(ValueError, match="quantization='dynamic'"):
        export_onnx_genai(lm, tmp_path, max_length=CACHE, adapters=True, quantization="dynamic")
    with pytest.raises(TypeError, match="adapters="):
        export_onnx_genai(lm, tmp_path, max_length=CACHE, adapters="yes")
