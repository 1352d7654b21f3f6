"""Stand-ins that the CPU path puts first on the import path (sglang_ess.cpu.resolution.enable_cpu_engine), and the
machinery that makes one: `stand_in(name)` turns the package being imported as `name` (sgl_kernel) into a module
whose every attribute and submodule is a kernel that raises when called, naming itself, except the kernels given as
`provided` (weak_ref_tensor, for the GPU rig: python/ess_gpu_rig)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STANDIN_VERSION = "0+ess.standin"  # the stand-in's __version__: never a real sglang-kernel's


class MissingKernel:
    """A kernel of the stood-in package: any call raises. Attributes chain (`scalar_types.uint4b8`)."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name}: a kernel of sgl_kernel, which cannot load on this machine, and the ESS "
                                  "CPU path (or GPU rig) has no torch replacement for it (docs/cpu-path.md)")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return MissingKernel(f"{self._name}.{name}")

    def __repr__(self) -> str:
        return f"<missing kernel {self._name}>"


class StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return MissingKernel(f"{self.__name__}.{name}")


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every `<package>.*` submodule is a StandInModule."""

    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return StandInModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def stand_in(name: str, provided: dict | None = None) -> None:
    """sys.modules[name] (a package being imported) becomes a StandInModule holding `provided` as real attributes."""
    sys.meta_path.insert(0, StandInFinder(name))
    module = sys.modules[name]
    module.__class__ = StandInModule
    for attr, value in (provided or {}).items():
        setattr(module, attr, value)
