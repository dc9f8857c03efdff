"""Placeholder modules for GPU-only packages that SGLang imports at start-up.

SGLang 0.5.17 imports two packages that have no usable CPU build:
``sgl_kernel`` (its CUDA kernels; no CPU wheel is published) and
``torchvision`` (PyPI's wheel links libtorch_cuda, so it cannot load beside
the CPU torch). kvsieve's CPU set-up installs these shims in their place; GPU
hosts install the real packages and never these.

Contract of a shimmed package:
* the package and any dotted submodule import;
* every attribute resolves to a ``MissingKernel`` placeholder, so
  ``from pkg.sub import name`` works at import time;
* calling a placeholder raises ``NotImplementedError`` naming it, so a CPU
  code path that reaches a GPU-only function fails loudly, never silently.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class MissingKernel:
    """Stands in for any attribute of a shimmed package; fails when called."""

    __slots__ = ("_qualname",)

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._qualname} is GPU-only; kvsieve's CPU shim has no "
            "implementation of it (this code path needs a GPU host)"
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return MissingKernel(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<kvsieve CPU shim placeholder {self._qualname}>"

    def __bool__(self) -> bool:
        # `if pkg.some_feature:` must read as "absent".
        return False

    def __mro_entries__(self, bases):
        # A class defined at import time on top of a missing one gets `object`.
        return (object,)


class ShimModule(types.ModuleType):
    """A module whose unknown attributes are MissingKernel placeholders."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return MissingKernel(f"{self.__name__}.{name}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every ``<package>.*`` submodule importable as a ShimModule."""

    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = ShimModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        return None


def install(package_module: types.ModuleType) -> None:
    """Turn an imported package into a shim: placeholders for its attributes
    and for all of its submodules."""
    name = package_module.__name__
    package_module.__class__ = ShimModule
    if not any(
        isinstance(f, _SubmoduleFinder) and f.package == name for f in sys.meta_path
    ):
        sys.meta_path.append(_SubmoduleFinder(name))
