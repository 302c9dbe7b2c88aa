"""Writing an artifact without leaving a half-written one behind.

`staged(path)` yields a temporary path beside `path`; the exporter writes
and verifies the artifact there, and only on success is it moved into place.
On any error the temporary artifact (and any parent directory `staged`
created) is removed and `path` is left as it was. `release_memory` returns
what one phase of an export freed before the next one starts.
"""

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import os
import shutil
import tempfile

from keras_attn.export.report import ExportError


def size_of(path):
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(root, f))
                   for root, _, files in os.walk(path) for f in files)
    return os.path.getsize(path)


def _check_target(path, arg_name, overwrite):
    """`(absolute path, the parent directories made for it, deepest first)`."""
    path = os.fspath(path)
    if not path:
        raise ValueError(f"Received an empty `{arg_name}`.")
    path = os.path.abspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(
            f"Received `{arg_name}`={path!r}, which already exists. Pass "
            "overwrite=True to replace it."
        )
    parent = os.path.dirname(path)
    created = []
    head = parent
    while head and not os.path.exists(head):
        created.append(head)
        head = os.path.dirname(head)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"Received an unwritable `{arg_name}`={path!r}: cannot create its "
            f"parent directory ({error})"
        ) from error
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(
            f"Received an unwritable `{arg_name}`={path!r}: no write permission "
            f"on {parent!r}"
        )
    return path, created


@contextlib.contextmanager
def staged(path, arg_name, overwrite=True):
    """Yields a temporary path beside `path`; moves it into place on success.

    On any exception the temporary artifact is removed and `path` is left as
    it was.
    """
    path, created = _check_target(path, arg_name, overwrite)
    parent, base = os.path.split(path)
    tmp_root = tempfile.mkdtemp(prefix=f".{base}.partial-", dir=parent)
    tmp = os.path.join(tmp_root, base)
    try:
        yield tmp
        if not os.path.exists(tmp):
            raise ExportError(f"The exporter wrote nothing at {tmp}")
        if os.path.exists(path):
            os.replace(path, os.path.join(tmp_root, base + ".old"))
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp_root, ignore_errors=True)
        for directory in created:
            try:
                os.rmdir(directory)
            except OSError:
                break
        raise
    shutil.rmtree(tmp_root, ignore_errors=True)


def release_memory():
    """Collects Python's garbage and hands the C heap's free pages back to the
    system (glibc `malloc_trim`; elsewhere only the collection).

    Between the phases of an export (tracing, converting, verifying) the freed
    buffers of one phase otherwise stay in the process's heap, and the next
    phase's peak adds to them.
    """
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None
