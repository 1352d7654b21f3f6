"""sgl_kernel's stand-in for the CPU path (docs/plugin.md, "The CPU path").

SGLang's CPU engine imports sgl_kernel's CPU build by name in about a hundred modules (`from sgl_kernel import
..._cpu`); the build that sglang==0.5.23 installs is the CUDA one, which cannot load without a driver, so every such
import would fail before a model is built. This package answers every name and submodule of sgl_kernel with a kernel
that raises when called, naming itself: importing works, and a kernel the CPU path did not replace fails loudly
instead of computing anything. The DeepSeek-V3.2 path that the CPU path serves calls none of them (its torch
replacements are in sglang_ess.cpu.kernels).
"""

from sglang_ess.cpu.standin import stand_in

__version__ = "0+ess.cpu.standin"

stand_in(__name__)
