"""Names a stand-in package does not implement: importable, and failing by name when called."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class Missing:
    """Any attribute of it is another Missing; calling it raises, naming the full dotted name.

    `lenient_decorator`: at import time, module-level decorators (`@cute.jit`, `@cute.kernel(...)`)
    must hand back what they decorate; a call with one function or class as its only argument does
    that, and a call with keyword arguments only returns a decorator of the same kind.
    """

    def __init__(self, name: str, lenient_decorator: bool = False):
        self._name = name
        self._lenient = lenient_decorator

    def __getattr__(self, attr: str) -> "Missing":
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}", self._lenient)

    def __call__(self, *args, **kwargs):
        if self._lenient:
            if len(args) == 1 and not kwargs and (isinstance(args[0], type) or callable(args[0])):
                return args[0]
            if not args:
                return Missing(f"{self._name}(...)", True)
        raise NotImplementedError(
            f"{self._name} is not implemented by the GPU stand-in (scripts/gpu_stubs); "
            "this path needs the real kernel package")

    def __mro_entries__(self, bases):
        # `class X(cutlass.SomeBase)` at import time: derive from object instead.
        return (object,)

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


def missing_module(name: str, lenient_decorator: bool = False) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so that deeper submodules import too
    module.__getattr__ = lambda attr: _module_attr(name, attr, lenient_decorator)
    return module


def _module_attr(module: str, attr: str, lenient: bool):
    if attr.startswith("__") and attr.endswith("__"):
        raise AttributeError(attr)
    return Missing(f"{module}.{attr}", lenient)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates any not-yet-existing submodule of `root` as a module of Missing names."""

    def __init__(self, root: str, lenient: bool):
        self.root, self.lenient = root, lenient

    def find_spec(self, fullname, path, target=None):
        # Appended last to sys.meta_path: reached only when no real file (e.g. sgl_kernel/utils.py)
        # was found for the name.
        if not fullname.startswith(self.root + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return missing_module(spec.name, self.lenient)

    def exec_module(self, module):
        pass


def install_submodule_finder(root: str, lenient_decorator: bool = False) -> None:
    if not any(isinstance(f, _Finder) and f.root == root for f in sys.meta_path):
        sys.meta_path.append(_Finder(root, lenient_decorator))
