"""Old module paths of `keras_attn.generation` that moved to `keras_attn.runtimes`.

Each old module is a small alias kept for one release: importing it warns
(DeprecationWarning, naming the new path) and every name it had is read from
the module(s) it moved to.
"""

import types
import warnings


def alias(namespace, *modules):
    """Makes the module whose `globals()` are `namespace` a deprecated alias of `modules`.

    Warns at import and installs a module `__getattr__` (PEP 562) that reads
    each name from the first of `modules` that has it.
    """
    old = namespace["__name__"]
    new = ", ".join(f"`{module.__name__}`" for module in modules)
    # stacklevel 3: the line that imports the old module (importlib's frames skipped).
    warnings.warn(
        f"`{old}` moved to {new}; the old path is deprecated and will be removed in the "
        "next release. Import from the new path.", DeprecationWarning, stacklevel=3)

    def __getattr__(name):
        for module in modules:
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    names = sorted({name for module in modules for name, value in vars(module).items()
                    if not name.startswith("_") and not isinstance(value, types.ModuleType)})
    namespace.update(__getattr__=__getattr__, __dir__=lambda: names, __all__=names)
