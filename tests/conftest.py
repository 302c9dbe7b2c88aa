"""Shared test set-up: the Keras backend, quiet logs, seeds, fixtures.

The backend is `KERAS_BACKEND` (TensorFlow when unset). `.ci/run` runs the
whole suite on TensorFlow, then the backend-agnostic files below on JAX and
torch. On a backend other than TensorFlow the other files are not collected
(the run's summary lists them) and tests marked `tensorflow_only` (they use
`tf.function`, `tf.GradientTape`, SavedModel... on purpose) are deselected:
they run in the TensorFlow pass, so a skip in any pass means a test did not
run anywhere.
"""

import os
import pathlib

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Layers, blocks and ops: keras.ops only, so they must pass on every backend;
# so must the graph writers that read a model's description and the
# converters' streaming. Training, export, generation and data are TensorFlow
# by design (docs/architecture.md). Paths are relative to tests/.
BACKEND_AGNOSTIC_FILES = {
    "convert/test_convert_modernbert.py",
    "convert/test_convert_streaming.py",
    "export/test_decoder_writers.py",
    "export/test_description.py",
    "export/test_encoder_description.py",
    "export/test_onnx_decoder.py",
    "export/test_onnx_signatures.py",
    "generation/test_lm_memory.py",
    "generation/test_lora_peft.py",
    "layers/test_attention_layers.py",
    "layers/test_blocks.py",
    "layers/test_cache_masks.py",
    "layers/test_errors.py",
    "layers/test_family_options.py",
    "layers/test_gemma4_options.py",
    "layers/test_mha_keras_compat.py",
    "layers/test_peers.py",
    "layers/test_position_layers.py",
    "layers/test_sentence_pooling.py",
    "layers/test_serialization.py",
    "layers/test_upstream_suites.py",
    "ops/test_ops.py",
    "runtimes/test_genai_adapters.py",
}

TESTS = pathlib.Path(__file__).parent


def _relative(path):
    """A test file's path relative to tests/, as the lists here write it."""
    path = pathlib.Path(path)
    return path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else str(path)


def pytest_configure(config):
    # A file moved or renamed would silently leave the other backends' runs
    # (or the early slow files) otherwise.
    missing = sorted(p for p in (*BACKEND_AGNOSTIC_FILES, *RUN_FIRST) if not (TESTS / p).is_file())
    if missing:
        raise pytest.UsageError(f"tests/conftest.py names test files that do not exist: {missing}")
    config.addinivalue_line(
        "markers", "tensorflow_only: uses TensorFlow APIs directly; runs on the TensorFlow backend only"
    )


_NOT_COLLECTED = []


def pytest_ignore_collect(collection_path, config):
    # Other backends: TensorFlow-only files are not even imported (they
    # import TensorFlow, datasets, exporters); the summary lists them.
    if keras.backend.backend() == "tensorflow" or collection_path.is_dir():
        return None
    name, relative = collection_path.name, _relative(collection_path)
    if name.startswith("test_") and name.endswith(".py") and relative not in BACKEND_AGNOSTIC_FILES:
        _NOT_COLLECTED.append(relative)
        return True
    return None


def pytest_report_header(config):
    return f"keras backend: {keras.backend.backend()}, KERAS_ATTN_TEST_SEED={SEED}"


def pytest_terminal_summary(terminalreporter):
    # Per file and per worker, to keep CI under its time budget: which files
    # to make cheaper, and whether RUN_FIRST leaves a worker idle at the end.
    by_file, by_worker = {}, {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            duration = getattr(report, "duration", None)
            if duration is None or not hasattr(report, "nodeid"):
                continue
            path = report.nodeid.split("::")[0]
            by_file[path] = by_file.get(path, 0.0) + duration
            worker = getattr(getattr(report, "node", None), "gateway", None)
            worker = getattr(worker, "id", "main")
            by_worker[worker] = by_worker.get(worker, 0.0) + duration
    if by_file:
        top = sorted(by_file.items(), key=lambda item: -item[1])[:25]
        terminalreporter.write_line(
            "seconds per file (setup + call + teardown): "
            + ", ".join(f"{path} {seconds:.0f}" for path, seconds in top))
        terminalreporter.write_line(
            "seconds per worker: " + ", ".join(f"{w} {s:.0f}" for w, s in sorted(by_worker.items())))
    if _NOT_COLLECTED:
        terminalreporter.write_line(
            f"TensorFlow-only test files not run on backend {keras.backend.backend()} "
            f"(run them with KERAS_BACKEND=tensorflow): {', '.join(sorted(_NOT_COLLECTED))}"
        )


# Files whose tests take minutes (subprocess runs of the examples, pip
# resolutions, multi-worker training, peers' suites): run first, so that
# with `-n auto` (pytest-xdist hands out whole files, in collection order:
# `--dist loadfile --no-loadscope-reorder` in pyproject.toml) neither worker
# is left running one of them while the other has nothing to do.
RUN_FIRST = (
    "project/test_examples.py", "project/test_image_examples.py", "project/test_install.py",
    "training/test_training_distributed.py", "layers/test_upstream_suites.py",
    "project/test_benchmarks_smoke.py", "export/test_export.py", "export/test_tflite_encoder.py",
    "export/test_export_examples.py", "export/test_export_model_kinds.py",
    "project/test_mobile_example.py", "project/test_pretrained_example.py",
    "project/test_finetune_example.py", "training/test_lm_distributed.py",
    "training/test_lm_resume.py",
    # Minutes too (exports of quantized models and of while loops, the docs'
    # commands): early, so that the files a worker gets last are short ones
    # (test_traced_structure.py, alphabetically near the end, came last).
    "generation/test_traced_structure.py", "project/test_documented_commands.py",
    "project/test_docs.py", "ops/test_chunked.py", "layers/test_activations.py",
)

# Each worker holds TensorFlow and the models and exports of the file it
# runs (benchmarks/RESULTS.md, "The test suite's workers": peak RSS per
# worker): no more workers than cores, nor than memory allows.
GIB_PER_WORKER = 8


def pytest_xdist_auto_num_workers(config):
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):  # xdist's own override, kept
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else psutil.cpu_count()
    return max(1, min(cores, psutil.virtual_memory().total // (GIB_PER_WORKER * 2**30)))


def pytest_collection_finish(session):
    # Every test file is imported now, and with it TensorFlow, ONNX Runtime,
    # the peers...: ~600k objects that live as long as the process. Keras's
    # `quantize` and our exporters (`staging.release_memory`) call
    # `gc.collect()`, each a full collection walking all of them (~0.5 s on
    # CI's machine, more once a worker holds a few files' models), and so do
    # Python's own gen-2 collections. Freezing them (after collecting what
    # collection left as garbage) leaves those collections only the objects
    # the tests make. Frozen objects are never collected: what is frozen here
    # (modules, their globals, the collected items) lives for the session.
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(_relative(item.path), len(rank)))  # stable: file order kept
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return
    tensorflow_only = [item for item in items if item.get_closest_marker("tensorflow_only")]
    if tensorflow_only:
        config.hook.pytest_deselected(items=tensorflow_only)
        items[:] = [item for item in items if not item.get_closest_marker("tensorflow_only")]


# KERAS_ATTN_TEST_SEED shifts every random fixture (`rng`, Keras's seed), so
# that tolerances are checked on other draws than the usual ones (`.ci/run`
# runs the numeric files once with another seed).
SEED = int(os.environ.get("KERAS_ATTN_TEST_SEED", "0"))
KERAS_SEED = 1234 + SEED


@pytest.fixture(autouse=True)
def _seed_and_policy():
    keras.utils.set_random_seed(KERAS_SEED)
    if keras.backend.backend() == "torch":
        # Tests read outputs with `np.asarray`, which torch refuses for
        # tensors that track gradients. An agnostic test that trains turns
        # them back on itself (tests/generation/test_lora_peft.py).
        import torch

        with torch.no_grad():
            yield
    else:
        yield
    keras.mixed_precision.set_global_policy("float32")
    # Kernel settings made by a test end with it; the suite as a whole runs
    # with KERAS_ATTN_ATTENTION_IMPLEMENTATION (e.g. =reference) if set.
    import keras_attn.config

    keras_attn.config.set_attention_implementation(None)
    keras_attn.config.set_device_type(None)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    # A shared (module- or class-scoped) fixture is set up before the
    # per-test seeding above, after whatever tests ran before it in this
    # process: a parallel worker, `-k` or another file order would give it
    # other random weights. Seeding here makes it the same in every run.
    if fixturedef.scope != "function":
        keras.utils.set_random_seed(KERAS_SEED)
    return (yield)


@pytest.fixture
def rng():
    return np.random.default_rng(SEED)
