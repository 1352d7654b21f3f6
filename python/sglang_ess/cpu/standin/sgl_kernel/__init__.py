"""sgl_kernel's stand-in for the CPU path (docs/plugin.md, "The CPU path").

SGLang's CPU engine imports sgl_kernel's CPU build by name in about a hundred modules (`from sgl_kernel import
..._cpu`); the build that sglang==0.5.23 installs is the CUDA one, which cannot load without a driver, so every such
import would fail before a model is built. This package answers every name and submodule of sgl_kernel with a kernel
that raises when called, naming itself: importing works, and a kernel the CPU path did not replace fails loudly
instead of computing anything. The DeepSeek-V3.2 path that the CPU path serves calls none of them (its torch
replacements are in sglang_ess.cpu.kernels).
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0+ess.cpu.standin"


class MissingKernel:
    """A kernel of sgl_kernel's CUDA or CPU build: any call raises. Attributes chain (`scalar_types.uint4b8`)."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name}: a kernel of sgl_kernel, which cannot load on this machine, and the ESS "
                                  "CPU path has no torch replacement for it (docs/plugin.md, 'The CPU path')")

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
    """Every `sgl_kernel.*` submodule is a StandInModule."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return StandInModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.insert(0, StandInFinder())
sys.modules[__name__].__class__ = StandInModule
