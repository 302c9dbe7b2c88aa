"""`human_dates`: the dates task as a tensorflow-datasets builder.

Importing `keras_attn.data` registers it, after which

    tfds.load("human_dates", data_dir=...)            # default size
    tfds.load("human_dates/tiny", data_dir=...)       # 1 000 training pairs
    load_dates(num_train=5000, seed=7, data_dir=...)  # any size and seed

build it offline (nothing is downloaded) and read it back like any tfds set.
Each example is `{"text": tf.string, "iso": tf.string}`.
"""

import contextlib
import dataclasses
import io

import tensorflow_datasets as tfds
from etils import epath

from keras_attn.data import dates


@dataclasses.dataclass
class HumanDatesConfig(tfds.core.BuilderConfig):
    """Size and seed of the generated splits (the size knob)."""

    num_train: int = 20_000
    num_validation: int = 1_000
    num_test: int = 2_000
    seed: int = 0


class HumanDates(tfds.core.GeneratorBasedBuilder):
    """Human-written dates in many formats and four languages -> ISO 8601."""

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {
        "1.0.0": "First release.",
        "1.1.0": "French month abbreviations tell June (juin) from July (juil).",
    }
    BUILDER_CONFIGS = [
        HumanDatesConfig(name="default", description="20k/1k/2k pairs, seed 0"),
        HumanDatesConfig(
            name="tiny", description="1k/200/200 pairs, seed 0",
            num_train=1_000, num_validation=200, num_test=200,
        ),
    ]
    DEFAULT_CONFIG_NAME = "default"
    # tfds 4.9 finds a builder's source through `importlib_resources`, which it
    # only installs on Python < 3.9; giving the path directly avoids that.
    code_path = epath.Path(__file__)

    def _info(self):
        return self.dataset_info_from_configs(
            description=dates.__doc__,
            features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "iso": tfds.features.Text()}
            ),
            supervised_keys=("text", "iso"),
            homepage="https://example.invalid/keras_attn",  # generated locally
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        c = self.builder_config
        splits = dates.generate_splits(c.num_train, c.num_validation, c.num_test, c.seed)
        return {name: self._generate_examples(pairs) for name, pairs in splits.items()}

    def _generate_examples(self, pairs):
        for i, (text, iso) in enumerate(pairs):
            yield i, {"text": text, "iso": iso}


def load_dates(
    num_train=20_000,
    num_validation=1_000,
    num_test=2_000,
    seed=0,
    data_dir=None,
    split=("train", "validation", "test"),
    as_supervised=False,
):
    """Builds (once per size/seed/data_dir) and loads the dates splits through tfds."""
    for name, value in (
        ("num_train", num_train), ("num_validation", num_validation), ("num_test", num_test)
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(
                f"Received an invalid value for argument `{name}`, expected a "
                f"positive integer. Received: {name}={value!r}"
            )
    config = HumanDatesConfig(
        name=f"n{num_train}_{num_validation}_{num_test}_s{seed}",
        num_train=num_train, num_validation=num_validation, num_test=num_test, seed=seed,
    )
    builder = HumanDates(config=config, data_dir=data_dir)
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False)
    )
    return builder.as_dataset(split=list(split) if not isinstance(split, str) else split,
                              as_supervised=as_supervised, shuffle_files=False)


def quiet_tfds(verbose=False):
    """A context in which tfds prints nothing (no bars, no "Downloading and preparing").

    tfds writes its progress bars and messages to stdout itself; the caller
    prints its own progress line instead. `verbose` leaves them.
    """
    if verbose:
        return contextlib.nullcontext()
    tfds.disable_progress_bar()
    return contextlib.redirect_stdout(io.StringIO())
