"""sgl_kernel's stand-in, one package for the CPU path (docs/cpu-path.md) and the GPU rig
(python/ess_gpu_rig, docs/gpu-server.md).

SGLang imports sgl_kernel by name in about a hundred modules (its CPU engine: `from sgl_kernel import ..._cpu`); the
build sglang==0.5.23 installs is the CUDA one, which cannot load without a driver, and the GPU machine cannot install
it at all (torch 2.11). This package answers every name and submodule of sgl_kernel with a kernel that raises when
called, naming itself: importing works, and a kernel nobody replaced fails loudly instead of computing anything. The
one kernel it gives is weak_ref_tensor, which a dense DeepSeek-V3.2 server on SGLang's torch paths still calls at CUDA
graph capture. The DeepSeek-V3.2 path the CPU path serves calls no kernel of it (its torch replacements are in
sglang_ess.cpu.kernels).
"""

import torch

from sglang_ess.cpu.standin import STANDIN_VERSION as __version__  # how ess_gpu_rig.active() knows the stand-in
from sglang_ess.cpu.standin import stand_in


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """sgl_kernel's is a non-owning alias of t (same storage, shape and strides), so that CUDA graph outputs do not
    keep their memory pool's blocks alive. t itself computes the same; the graph's outputs then stay allocated
    until the runner drops them (more memory held, never a different value)."""
    return t


stand_in(__name__, {"weak_ref_tensor": weak_ref_tensor})
