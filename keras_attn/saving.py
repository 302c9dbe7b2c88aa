"""Serialization: the one registration of keras_attn's classes, and loading that
fails cleanly (validated `.keras` / `.weights.h5` files, safe mode by default).

`register` registers a class as `keras_attn>ClassName`: every layer (when
`keras_attn` is imported) and every generation model of keras_attn.

Plain `keras.saving.load_model` loads keras_attn models once `keras_attn` is
imported (the import registers the layers). Without the import Keras reports
that `Functional` "could not be deserialized properly": add `import keras_attn`.

`keras.saving.load_model` on a truncated file raises whatever the zip or HDF5
library hits first, and `Model.load_weights` can fail after it has assigned
some variables. These wrappers check the container before Keras reads it and
restore the previous weights when loading fails part-way, so a model is
either fully loaded or unchanged.
"""

import os
import zipfile

import keras

# The layers register themselves with `register` below when `keras_attn` is
# imported (keras_attn/__init__.py imports them before this module is usable),
# so this module imports no layer: the layers and the models import it.

PACKAGE = "keras_attn"
"""The package name of keras_attn's registered classes (`keras_attn>ClassName`)."""


def register(cls):
    """Registers `cls` for serialization as `keras_attn>ClassName` (a class decorator)."""
    return keras.saving.register_keras_serializable(package=PACKAGE)(cls)


class CorruptFileError(ValueError):
    """A saved model or weights file is truncated, corrupt or of the wrong kind."""


LOAD_HINT = (
    "A .keras file with keras_attn layers loads after `import keras_attn` (the import "
    "registers every layer as `keras_attn>ClassName`); layers of your own need "
    "`custom_objects={...}` or `@keras.saving.register_keras_serializable`."
)


def _unknown_class(error):
    text = str(error)
    return "Could not locate" in text or "could not be deserialized" in text


def _check_keras_archive(path):
    if not zipfile.is_zipfile(path):
        raise CorruptFileError(
            f"{path!s} is not a valid .keras file: it is not a zip archive (the file "
            "is truncated, corrupt, or not a Keras 3 model file)."
        )
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise CorruptFileError(f"{path!s} is not a readable .keras file: {error}") from error
    if bad is not None:
        raise CorruptFileError(f"{path!s} is corrupt: member {bad!r} fails its CRC check.")
    missing = {"config.json", "metadata.json"} - names
    if missing:
        raise CorruptFileError(
            f"{path!s} is not a complete .keras file: missing {sorted(missing)}."
        )


def _check_h5(path):
    with open(path, "rb") as handle:
        signature = handle.read(8)
    if signature != b"\x89HDF\r\n\x1a\n":
        raise CorruptFileError(
            f"{path!s} is not a valid .weights.h5 file (no HDF5 signature): the file is "
            "truncated, corrupt, or of another kind."
        )


def load_model(path, *, custom_objects=None, compile=True, safe_mode=True):
    """`keras.saving.load_model` with the file checked first and safe mode on.

    Args:
        path: a `.keras` file.
        custom_objects: as in Keras.
        compile: as in Keras.
        safe_mode: keep True unless you trust the file: False allows
            deserialising arbitrary Python code (Lambda layers).

    Raises:
        FileNotFoundError: `path` does not exist.
        CorruptFileError (a ValueError): truncated, corrupt or not a `.keras` file.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"No model file at {path!r}.")
    if not path.endswith(".keras"):
        raise ValueError(
            f"Expected a `.keras` file. Received: path={path!r}. (Load a SavedModel "
            "with tf.saved_model.load and weights with keras_attn.saving.load_weights.)"
        )
    _check_keras_archive(path)
    try:
        return keras.saving.load_model(
            path, custom_objects=custom_objects, compile=compile, safe_mode=safe_mode
        )
    except (OSError, EOFError, zipfile.BadZipFile) as error:
        raise CorruptFileError(f"{path!s} could not be loaded: {error}") from error
    except (TypeError, ValueError) as error:
        if not _unknown_class(error):
            raise
        raise type(error)(
            f"{path!s}: a class in the model's config is not registered. {LOAD_HINT}\n"
            f"Keras said: {str(error)[:1000]}"
        ) from error


def load_weights(model, path):
    """Loads `.weights.h5` into `model`; on any failure the model keeps its weights.

    Raises:
        FileNotFoundError: `path` does not exist.
        CorruptFileError: the file is truncated, corrupt or not HDF5.
        ValueError: (from Keras) the file was saved from a different
            architecture. In every case `model` is unchanged.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"No weights file at {path!r}.")
    if path.endswith(".h5"):
        _check_h5(path)
    backup = [v.numpy() for v in model.variables]
    try:
        model.load_weights(path)
    except Exception as error:
        for variable, value in zip(model.variables, backup):
            variable.assign(value)
        if isinstance(error, (OSError, EOFError, KeyError)):
            raise CorruptFileError(
                f"{path!s} could not be loaded ({type(error).__name__}: {error}); the "
                "model's weights were left unchanged."
            ) from error
        raise
