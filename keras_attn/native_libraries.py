"""Loads Triton's compiled module apart from TensorFlow's LLVM (Linux).

TensorFlow loads `_pywrap_tensorflow_internal.so` with RTLD_GLOBAL, which puts
`libtensorflow_framework.so.2` and `libtensorflow_cc.so.2`, and the LLVM and
MLIR they carry, in the process's global symbol scope. Triton's
`libtriton.so` (the `triton` wheel that PyTorch's CUDA builds install, imported
by `torch._dynamo`, hence by `transformers`) carries its own LLVM and MLIR
with default visibility; loaded after TensorFlow, its references bind to
TensorFlow's copies (some 15,000 symbols), its static initialisers register
LLVM options in TensorFlow's registry, and the process aborts ("LLVM ERROR:
inconsistency in registered CommandLine options") or dies with signal 11 in
`triton/knobs.py`. Loaded first, Triton is unaffected.

`install()` adds an import hook that loads `triton._C.libtriton` with
RTLD_DEEPBIND when TensorFlow is already loaded: the library then binds its
own symbols before the global ones. It costs nothing until Triton is
imported, does nothing if Triton was loaded before (it is then unaffected),
and stays out of the way under LD_PRELOAD, where RTLD_DEEPBIND would let the
library bypass a preloaded allocator (tcmalloc, jemalloc); there, import
torch before keras_attn (docs/guides/pretrained.md, "Troubleshooting").
"""

import importlib.machinery
import os
import re
import sys

MODULE = "triton._C.libtriton"


class _DeepBindLoader(importlib.machinery.ExtensionFileLoader):
    def create_module(self, spec):
        flags = sys.getdlopenflags()
        sys.setdlopenflags(flags | os.RTLD_DEEPBIND)
        try:
            return super().create_module(spec)
        finally:
            sys.setdlopenflags(flags)


class _TritonFinder:
    # A meta path finder needs only `find_spec` (importlib.abc costs ~30 ms to import).
    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE or not needed():
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            return None
        spec.loader = _DeepBindLoader(fullname, spec.origin)
        return spec


def needed():
    """Whether loading Triton now needs RTLD_DEEPBIND: TensorFlow is loaded, the
    platform has the flag, and no library is preloaded."""
    return (
        "tensorflow" in sys.modules
        and hasattr(os, "RTLD_DEEPBIND")
        and hasattr(sys, "setdlopenflags")
        and not os.environ.get("LD_PRELOAD")
    )


def install():
    """Adds the import hook once (first in `sys.meta_path`); returns it."""
    for finder in sys.meta_path:
        if isinstance(finder, _TritonFinder):
            return finder
    finder = _TritonFinder()
    sys.meta_path.insert(0, finder)
    return finder


# absl's lines written before TensorFlow initialises its logging: severity
# letter, then "0000 00:00:<time>". Info and warnings only; errors are kept.
_START_UP_NOTE = re.compile(r"^[IW]0000 00:00:")


def import_tensorflow_quietly():
    """Imports TensorFlow with its C++ start-up info and warning lines hidden
    (the oneDNN notice, CUDA probing on a machine without a GPU): they are
    written before TensorFlow's logging is initialised, so no environment
    variable hides them. Every other line it writes (errors included) is
    written back; on a failed import, all of them with the error."""
    import importlib
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        failed = True
        try:
            importlib.import_module("tensorflow")
            failed = False
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            kept = lines if failed else [line for line in lines if not _START_UP_NOTE.match(line)]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()
