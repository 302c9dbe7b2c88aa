"""The searches follow the model: a search traced before the model's structure
changed (LoRA enabled, quantized, a layer replaced, `trainable` flipped)
answers with the model as it is now, and training in place keeps the trace.

References: a step-by-step loop of full `model(...)` calls (argmax), and each
search run on a freshly built model given the same change and the same
weights, which has never been traced before.
"""

import keras
import numpy as np
import pytest

from keras_attn.generation import DecoderOnlyLM, beam_search, greedy_search, random_sampling
from keras_attn.generation import search as search_lib
from tests import tolerance

pytestmark = pytest.mark.tensorflow_only

VOCAB, PROMPT, NEW = 61, np.array([[5, 17, 9], [33, 2, 48]], np.int32), 5
MAX_LENGTH = PROMPT.shape[1] + NEW
CONFIG = dict(vocabulary_size=VOCAB, sequence_length=32, hidden_dim=32, num_layers=2, num_heads=4,
              intermediate_dim=48)


def build(seed=0):
    """A small decoder whose weights are spread enough that greedy tokens vary."""
    keras.utils.set_random_seed(seed)
    lm = DecoderOnlyLM(**CONFIG)
    lm(PROMPT)
    rng = np.random.default_rng(seed)
    for w in lm.weights:
        w.assign(keras.ops.convert_to_numpy(w) * 3 + rng.standard_normal(w.shape) * 0.05)
    return lm


def stepwise_argmax(lm, prompt, new):
    ids = np.asarray(prompt)
    for _ in range(new):
        logits = keras.ops.convert_to_numpy(lm(ids))
        ids = np.concatenate([ids, logits[:, -1].argmax(-1)[:, None].astype(np.int32)], axis=1)
    return ids


def _lora(lm):
    rng = np.random.default_rng(1)
    for layer in lm.enable_lora(4, target_names=("query", "value", "feedforward_output_dense")):
        layer.lora_kernel_b.assign(rng.standard_normal(layer.lora_kernel_b.shape) * 2)


def _quantize(mode):
    def change(lm):
        with pytest.warns(UserWarning):  # the layers without a quantized form say so
            lm.quantize(mode)

    return change


def _replace_last_block(lm):
    block = lm.blocks[-1]
    lm.blocks[-1] = block.__class__.from_config(block.get_config())
    lm(PROMPT)  # builds the new block, with new random weights
    rng = np.random.default_rng(2)
    for w in lm.blocks[-1].weights:
        w.assign(keras.ops.convert_to_numpy(w) * 3 + rng.standard_normal(w.shape) * 0.05)


CHANGES = {"enable_lora": _lora, "quantize_int4": _quantize("int4"), "quantize_int8": _quantize("int8"),
           "replace_a_block": _replace_last_block}


# int8 keeps this model's greedy tokens (the export test below uses it).
@pytest.mark.parametrize("change", ["enable_lora", "quantize_int4", "replace_a_block"])
def test_greedy_traced_before_a_change_gives_the_changed_models_tokens(change):
    lm = build()
    before = np.asarray(greedy_search(lm, PROMPT, MAX_LENGTH))
    CHANGES[change](lm)
    after = np.asarray(greedy_search(lm, PROMPT, MAX_LENGTH))
    np.testing.assert_array_equal(after, stepwise_argmax(lm, PROMPT, NEW))
    assert not np.array_equal(before, after), "the change did not change the tokens: no test"


SEARCHES = {
    "greedy_xla": lambda lm: greedy_search(lm, PROMPT, MAX_LENGTH, jit_compile=True),
    "sampling": lambda lm: random_sampling(lm, PROMPT, MAX_LENGTH, seed=3, top_k=8),
    "beam": lambda lm: beam_search(lm, PROMPT, MAX_LENGTH, num_beams=3),
}


@pytest.mark.parametrize("search", sorted(SEARCHES))
def test_every_search_traced_before_enable_lora_answers_with_the_adapters(search):
    """Against the same search on a model never traced, given LoRA and then
    the first model's weights."""
    lm, run = build(), SEARCHES[search]
    before = np.asarray(run(lm))
    _lora(lm)
    after = np.asarray(run(lm))
    fresh = build(seed=5)
    _lora(fresh)
    fresh.set_weights(lm.get_weights())
    np.testing.assert_array_equal(after, np.asarray(run(fresh)))
    assert not np.array_equal(before, after), "LoRA did not change the tokens: no test"


def _traced_functions(lm):
    return list(search_lib._FUNCTIONS[lm][1].values())


def test_training_in_place_keeps_the_trace_and_a_trainable_flip_retraces():
    lm = build()
    greedy_search(lm, PROMPT, MAX_LENGTH)
    (traced,) = _traced_functions(lm)
    assert traced.experimental_get_tracing_count() == 1
    # New values, as an optimizer step writes them: the same trace, the new tokens.
    for w in lm.trainable_weights:
        w.assign(keras.ops.convert_to_numpy(w)[..., ::-1].copy())
    got = np.asarray(greedy_search(lm, PROMPT, MAX_LENGTH))
    np.testing.assert_array_equal(got, stepwise_argmax(lm, PROMPT, NEW))
    assert _traced_functions(lm) == [traced] and traced.experimental_get_tracing_count() == 1
    lm.blocks[0].trainable = False
    greedy_search(lm, PROMPT, MAX_LENGTH)
    assert _traced_functions(lm) != [traced]


def test_enable_lora_resets_keras_traced_predict():
    """Keras's own `predict` keeps its traced step after a sublayer's
    `enable_lora`; the model's `enable_lora` lets it go."""
    lm = build()
    lm.predict(PROMPT, verbose=0)
    _lora(lm)
    # Graph against eager: the same float32 sums in another order.
    tolerance.assert_close(lm.predict(PROMPT, verbose=0), keras.ops.convert_to_numpy(lm(PROMPT)),
                           terms=CONFIG["intermediate_dim"])


@pytest.mark.parametrize("change", ["enable_lora", "quantize_int8"])
def test_an_export_made_after_a_change_runs_the_changed_model(change, tmp_path):
    """The prefill/decode export of a model searched before the change: its
    own verification is against the changed model, and so are its tokens."""
    pytest.importorskip("onnxruntime")
    import onnxruntime as ort

    from keras_attn.runtimes import greedy_loop, signatures

    lm = build()
    greedy_search(lm, PROMPT, MAX_LENGTH)
    CHANGES[change](lm)
    if change == "quantize_int8":  # the direct writer reads float kernels: tf2onnx, saying why
        with pytest.warns(UserWarning, match="falls back to tf2onnx.*quantized by Keras"):
            report = signatures.export_onnx(lm, str(tmp_path / "onnx"), max_length=MAX_LENGTH)
    else:
        report = signatures.export_onnx(lm, str(tmp_path / "onnx"), max_length=MAX_LENGTH)
    run = {}
    for name in ("prefill", "decode"):
        session = ort.InferenceSession(report[name], providers=["CPUExecutionProvider"])
        names = [o.name.removesuffix("_out") for o in session.get_outputs()]
        run[name] = (lambda s, n: lambda **kw: dict(zip(n, s.run(None, kw))))(session, names)
    got = greedy_loop(run["prefill"], run["decode"], PROMPT, MAX_LENGTH)
    np.testing.assert_array_equal(got, stepwise_argmax(lm, PROMPT, NEW))


def test_a_trainer_refuses_a_model_changed_after_it_was_made():
    """Its optimizer, checkpoint and traced step are for the model as it was:
    training on would update the weights LoRA froze, and not the adapters."""
    from keras_attn.training import Trainer

    lm = build()
    trainer = Trainer(lm, keras.optimizers.Adam(), "sparse_categorical_crossentropy",
                      global_batch_size=2)
    _lora(lm)
    with pytest.raises(ValueError, match="structure changed after this Trainer was made"):
        trainer.fit(lambda context: None, steps=1)
