"""The GPU rig: stock SGLang 0.5.23 serving DeepSeek-V3.2 on the project's GPU machine, where sglang-kernel and
DeepGEMM cannot be installed (docs/gpu-server.md).

Not part of the product. A real deployment installs sglang-kernel (and DeepGEMM), and never loads this package: it
is registered as an SGLang plugin only by benchmark/gpu/server.sh's own entry point, and acts only where
`ESS_GPU_RIG=1` is set and sgl_kernel is this rig's stand-in. The GPU machine has torch 2.11 (SGLang pins 2.14.1),
no network and 64 MiB of carried packages, so sglang-kernel (356 MB, built for torch 2.14) cannot go there, and no
DeepGEMM build loads under torch 2.11. What stands in, with SGLang's own switches first:
    SETTINGS                 SGLang's environment switches to its torch / Triton paths (each named with the kernel
                             it avoids)
    sgl_kernel's stand-in    sglang_ess/cpu/standin/sgl_kernel, the CPU path's: weak_ref_tensor given, every other
                             kernel raises if called
    rig_patches.py           SGLang's JIT kernels (tvm-ffi + nvcc at first call) on the DeepSeek-V3.2 path, each
                             replaced by the torch it computes; the indexer's logits by ESS's Triton kernel,
                             decode and prefill (DeepGEMM's stand-in), checked on the device before they serve
                             (logits_check.py; SGLang's torch versions where they fail, or with
                             ESS_GPU_RIG_LOGITS=torch); and one torch-path fix shared with the CPU path
    rig_moe.py               the FP8 MoE and MTP path's (issue 57): sgl_kernel's MoE align, SGLang's JIT FP8
                             activation quantiser, MoE activation, padding mask, MTP norms and EAGLE tree kernels,
                             each by SGLang's own Triton kernel or the torch it computes
Both servers of a comparison, stock and --enable-ess, run on the same rig, so they compute with the same kernels.
"""

from __future__ import annotations

import os

ENV = "ESS_GPU_RIG"
# The indexer's logits: "ess" (ESS's Triton kernel: over SGLang's pages in decode, rig_patches.fp8_paged_mqa_logits, and
# over each query row's window in prefill, rig_patches.fp8_mqa_logits) or "torch" (SGLang's own torch versions, as
# SGLANG_FP8_PAGED_MQA_LOGITS_TORCH gives them)
LOGITS_ENV, LOGITS = "ESS_GPU_RIG_LOGITS", ("ess", "torch")


def logits() -> str:
    """The logits the rig runs, from ESS_GPU_RIG_LOGITS (default "ess"); anything else is refused, naming it."""
    value = os.environ.get(LOGITS_ENV, LOGITS[0])
    if value not in LOGITS:
        raise ValueError(f"{LOGITS_ENV} must be one of {LOGITS}, got {value!r}")
    return value

# SGLang 0.5.23's own switches that keep a dense bf16 DeepSeek-V3.2 server off sgl_kernel and DeepGEMM on CUDA
SETTINGS = {
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",  # the launcher refuses to start without sglang-kernel otherwise
    # the bundled Rust radix tree links libtorch 2.14.1; under 2.11 it misreads dtypes ("insert value must be an
    # int64 tensor, got Uint8" at the warm-up request)
    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",
    # RMSNorm, rotary, SiluAndMul, clamp_position, LayerNorm: torch (forward_native), not sgl_kernel or JIT kernels
    "SGLANG_FORCE_FUSED_OP_BACKEND": "torch",
    # the indexer's logits and their schedule: SGLang's torch path (fp8_paged_mqa_logits_torch, graph-safe) in place
    # of DeepGEMM's, and no deep_gemm.get_num_sms at model load; rig_patches.py gives that path ESS's Triton kernel
    # (LOGITS_ENV)
    "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",
    "SGLANG_DSA_FUSE_TOPK": "0",  # the un-fused torch top-k (with --dsa-topk-backend torch), not sgl_kernel's
    # short prefills attend through FlashMLA's sparse kernel as long ones do, not sgl_kernel's FA3 varlen
    "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0",
    # FP8 checkpoints: the block GEMMs are SGLang's Triton ones (with --fp8-gemm-backend triton), not DeepGEMM's,
    # which would compile at first call and does not load under torch 2.11
    "SGLANG_ENABLE_JIT_DEEPGEMM": "0",
    ENV: "1",
}


def active() -> bool:
    """The rig is asked for and sgl_kernel is its stand-in (a real sglang-kernel wins: the rig then does nothing)."""
    if os.environ.get(ENV) != "1":
        return False
    try:
        import sgl_kernel
    except ImportError:
        return False
    from sglang_ess.cpu.standin import STANDIN_VERSION

    return getattr(sgl_kernel, "__version__", "") == STANDIN_VERSION


def register() -> None:
    """SGLang's plugin entry point (benchmark/gpu/server.sh registers it): the rig's patches, where active on a GPU
    (on a CPU the CPU path, sglang_ess.cpu, serves: the CPU rehearsal of the GPU command runs the rig's stand-in
    and settings, not its patches)."""
    import torch

    if not active() or not torch.cuda.is_available():
        return
    from ess_gpu_rig import rig_moe, rig_patches
    from sglang_ess.hooks import table

    logits()  # a bad ESS_GPU_RIG_LOGITS is refused at start-up
    table.register(rig_patches.PATCHES + rig_moe.PATCHES)
