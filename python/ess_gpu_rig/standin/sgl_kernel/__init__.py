"""sgl_kernel's stand-in for the GPU rig (ess_gpu_rig): importable, with the one kernel a dense DeepSeek-V3.2 server
on SGLang's torch paths still calls (weak_ref_tensor, CUDA graph capture); every other kernel raises when called,
naming itself (sglang_ess.cpu.standin)."""

import torch

from ess_gpu_rig import STANDIN_VERSION as __version__  # how ess_gpu_rig.active() knows its stand-in
from sglang_ess.cpu.standin import stand_in


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """sgl_kernel's is a non-owning alias of t (same storage, shape and strides), so that CUDA graph outputs do not
    keep their memory pool's blocks alive. t itself computes the same; the graph's outputs then stay allocated
    until the runner drops them (more memory held, never a different value)."""
    return t


stand_in(__name__, {"weak_ref_tensor": weak_ref_tensor})
