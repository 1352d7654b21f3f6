"""sgl_kernel's stand-in, one package for the CPU path (docs/cpu-path.md) and the GPU rig
(python/ess_gpu_rig, docs/gpu-server.md).

SGLang imports sgl_kernel by name in about a hundred modules (its CPU engine: `from sgl_kernel import ..._cpu`); the
build sglang==0.5.23 installs is the CUDA one, which cannot load without a driver, and the GPU machine cannot install
it at all (torch 2.11). This package answers every name and submodule of sgl_kernel with a kernel that raises when
called, naming itself: importing works, and a kernel nobody replaced fails loudly instead of computing anything. The
kernels it gives are weak_ref_tensor, which a dense DeepSeek-V3.2 server on SGLang's torch paths still calls at CUDA
graph capture, and moe_sum_reduce, which SGLang's fused MoE imports by name on CUDA and calls above 32 tokens (the GPU
rig's MoE layers; its other MoE stand-ins are in ess_gpu_rig.rig_moe). The DeepSeek-V3.2 path the CPU path serves
calls no kernel of it (its torch replacements are in sglang_ess.cpu.kernels).
"""

import torch

from sglang_ess.cpu.standin import STANDIN_VERSION as __version__  # how ess_gpu_rig.active() knows the stand-in
from sglang_ess.cpu.standin import stand_in


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """sgl_kernel's is a non-owning alias of t (same storage, shape and strides), so that CUDA graph outputs do not
    keep their memory pool's blocks alive. t itself computes the same; the graph's outputs then stay allocated
    until the runner drops them (more memory held, never a different value)."""
    return t


def moe_sum_reduce(input: torch.Tensor, output: torch.Tensor, routed_scaling_factor: float) -> None:
    """sgl_kernel's combine of the routed experts' outputs: output[t] = routed_scaling_factor * sum_k input[t, k],
    accumulated in float32. On CUDA, SGLang's Triton kernel, the one it calls itself up to 32 tokens
    (moe_sum_reduce_triton); elsewhere its torch arithmetic (moe_sum_reduce_torch_compile's, in float32)."""
    if input.is_cuda:
        from sglang.kernels.ops.moe.fused_moe_triton_kernels import moe_sum_reduce_triton

        moe_sum_reduce_triton(input, output, routed_scaling_factor)
        return
    output.copy_(input.sum(dim=1, dtype=torch.float32) * routed_scaling_factor)


stand_in(__name__, {"weak_ref_tensor": weak_ref_tensor, "moe_sum_reduce": moe_sum_reduce})
