"""The SavedModel as TF Serving sees it: no keras_attn, saved_model_cli, requests, CLI."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_attn import export as kx
from tests import model_zoo
from tests import tolerance

SAVED_MODEL_CLI = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")


def feeds(model, batch, length, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for i, inp in enumerate(model.inputs):
        x = rng.integers(1, model_zoo.VOCAB, size=(batch, length + i)).astype("int32")
        x[0, -2:] = 0
        out[inp.name] = x
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    keras.utils.set_random_seed(5)
    model = model_zoo.encoder_decoder()  # two int inputs, masks, causal + cross attention
    base = tmp_path_factory.mktemp("serving")
    report = kx.export_saved_model(model, base, model_name="seq2seq", version=2)
    return model, report


def keras_out(model, feed):
    return np.asarray(model([feed[i.name] for i in model.inputs]))


def test_layout_for_tf_serving(served):
    _, report = served
    assert report.path.endswith(os.path.join("seq2seq", "2"))
    assert {"saved_model.pb", "variables"} <= set(os.listdir(report.path))


def test_loads_without_keras_attn(served, tmp_path):
    model, report = served
    feed = feeds(model, 3, 6)
    np.savez(tmp_path / "feed.npz", **feed)
    np.save(tmp_path / "want.npy", keras_out(model, feed))
    script = textwrap.dedent(
        f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "keras_attn" or name.startswith("keras_attn."):
                    raise ImportError("keras_attn is blocked")
        sys.meta_path.insert(0, Block())
        try:
            import keras_attn
            raise SystemExit("keras_attn was importable")
        except ImportError:
            pass
        import numpy as np, tensorflow as tf
        fn = tf.saved_model.load({report.path!r}).signatures["serving_default"]
        feed = dict(np.load("feed.npz"))
        got = fn(**{{k: tf.constant(v) for k, v in feed.items()}})["logits"].numpy()
        err = float(np.abs(got - np.load("want.npy")).max())
        assert not any(m.startswith("keras_attn") for m in sys.modules)
        print("ERR", err)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-I", "-c", script], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    err = float(result.stdout.split("ERR")[-1])
    assert err <= 1e-4


def test_saved_model_cli_show_and_run(served, tmp_path):
    model, report = served
    show = subprocess.run(
        [SAVED_MODEL_CLI, "show", "--dir", report.path, "--all"],
        capture_output=True, text=True, timeout=300,
    )
    assert show.returncode == 0, show.stderr[-2000:]
    assert "signature_def['serving_default']" in show.stdout
    for name in ("encoder_tokens", "decoder_tokens", "logits"):
        assert f"['{name}']" in show.stdout
    assert "shape: (-1, -1)" in show.stdout and "args_0" not in show.stdout
    feed = feeds(model, 2, 5)
    paths = []
    for name, value in feed.items():
        np.save(tmp_path / f"{name}.npy", value)
        paths.append(f"{name}={tmp_path / name}.npy")
    run = subprocess.run(
        [SAVED_MODEL_CLI, "run", "--dir", report.path, "--tag_set", "serve",
         "--signature_def", "serving_default", "--inputs", ";".join(paths),
         "--outdir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    got = np.load(tmp_path / "out" / "logits.npy")
    tolerance.assert_close(got, keras_out(model, feed), terms=tolerance.LAYER_TERMS)


def test_rest_and_grpc_requests_from_signature(served):
    model, report = served
    fn = tf.saved_model.load(report.path).signatures["serving_default"]
    spec = fn.structured_input_signature[1]
    feed = feeds(model, 2, 4, seed=9)
    want = keras_out(model, feed)

    body = json.loads(json.dumps(kx.rest_predict_body(feed)))
    assert body["signature_name"] == "serving_default" and set(body["inputs"]) == set(spec)
    rest_feed = {k: tf.constant(v, dtype=spec[k].dtype) for k, v in body["inputs"].items()}
    tolerance.assert_close(fn(**rest_feed)["logits"].numpy(), want, terms=tolerance.LAYER_TERMS)
    rows = kx.rest_predict_body(feed, layout="row")["instances"]
    assert len(rows) == 2 and set(rows[0]) == set(spec)

    request = kx.predict_request("seq2seq", feed, version=2)
    wire = type(request).FromString(request.SerializeToString())
    assert wire.model_spec.name == "seq2seq" and wire.model_spec.version.value == 2
    assert wire.model_spec.signature_name == "serving_default"
    grpc_feed = {}
    for name, proto in wire.inputs.items():
        tensor = tf.make_tensor_proto(0)
        tensor.ParseFromString(proto.SerializeToString())
        grpc_feed[name] = tf.constant(tf.make_ndarray(tensor), dtype=spec[name].dtype)
    assert set(grpc_feed) == set(spec)
    tolerance.assert_close(fn(**grpc_feed)["logits"].numpy(), want, terms=tolerance.LAYER_TERMS)


def test_cli_export(tmp_path, capsys):
    from keras_attn import cli

    keras.utils.set_random_seed(2)
    model = model_zoo.encoder_classifier()
    path = tmp_path / "clf.keras"
    model.save(path)
    code = cli.main(["export", str(path), "--format", "all", "--out", str(tmp_path / "out"),
                     "--quantize", "none", "dynamic"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert os.path.isfile(tmp_path / "out" / "saved_model" / "clf" / "1" / "saved_model.pb")
    for name in ("clf.tflite", "clf_dynamic.tflite", "clf.onnx"):
        assert os.path.isfile(tmp_path / "out" / name)
    assert "safe_mode=True" in printed and printed.count("max |export - keras|") == 4


def test_cli_refuses_unsafe_files_unless_opted_in(tmp_path, capsys):
    from keras_attn import cli

    inp = keras.Input((None, 4), name="x")
    model = keras.Model(inp, keras.layers.Lambda(lambda t: t * 2.0)(inp))
    path = tmp_path / "lambda.keras"
    model.save(path)
    out = tmp_path / "out"
    assert cli.main(["export", str(path), "--format", "saved_model", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert "--unsafe-deserialization" in captured.err
    assert not out.exists()
    code = cli.main(["export", str(path), "--format", "saved_model", "--out", str(out),
                     "--unsafe-deserialization"])
    assert code == 0, capsys.readouterr()
    assert os.path.isfile(out / "saved_model" / "lambda" / "1" / "saved_model.pb")


def test_cli_rejects_a_truncated_model_file(tmp_path, capsys):
    from keras_attn import cli

    model = model_zoo.multi_head_attention()
    good = tmp_path / "good.keras"
    model.save(good)
    bad = tmp_path / "bad.keras"
    bad.write_bytes(good.read_bytes()[:500])
    assert cli.main(["export", str(bad), "--format", "onnx", "--out", str(tmp_path / "o")]) == 2
    assert "not a valid .keras file" in capsys.readouterr().err
