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
