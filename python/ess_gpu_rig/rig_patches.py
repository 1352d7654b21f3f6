"""The GPU rig's patch points: SGLang's JIT kernels (tvm-ffi modules compiled by nvcc at their first call) that a
dense bf16 DeepSeek-V3.2 server still reaches on SGLang's torch paths, each replaced by the torch it computes; the
rotary fix the CPU path also needs; and the indexer's logits, which SGLang's torch path computes by copying every
page it reads to bf16 (decode) and by multiplying every query row by every key, head by head (prefill), by ESS's
Triton kernel over the pages in place and over each query row's window (DeepGEMM's does not load here). A table of
sglang_ess.hooks.table rows, as sglang_ess.cpu.patches's; the tests resolve every target in the installed SGLang and
check the parameters each row names."""

from __future__ import annotations

import torch

from ess.core import layout
from ess.core.kernels.indexer import indexer_scores_pages, indexer_scores_ragged
from sglang.srt.plugins.hook_registry import HookType
from sglang_ess.cpu import kernels
from sglang_ess.cpu.patches import ROTARY, around_rotary_native
from sglang_ess.hooks.table import Hook, expected_params


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """sglang.kernels.ops.quantization.hadamard.hadamard_transform: the Walsh-Hadamard transform of the last
    dimension times scale (the indexer gives scale = d^-0.5: the normalised transform), in x's dtype."""
    d = x.shape[-1]
    return (kernels.hadamard(x.float()) * (scale * d**0.5)).to(x.dtype)


def no_fused_store(*args, **kwargs) -> bool:
    """can_use_dsa_fused_store: False takes SGLang's own unfused store (Triton act_quant, then SetKAndS)."""
    return False


def concat_mla_absorb_q(q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
    """The absorbed query [..., 512 + 64]: what the JIT kernel (concat_mla_absorb_q) concatenates on CUDA."""
    return torch.cat([q_nope, q_rope], dim=-1)


def dsv3_fused_a_gemm(mat_a: torch.Tensor, mat_b: torch.Tensor, output: torch.Tensor | None = None,
                      backend=None) -> torch.Tensor:
    """The fused q_a / kv_a projection for 1-16 tokens: mat_a @ mat_b (mat_b is the weight transposed)."""
    if output is None:
        return torch.mm(mat_a, mat_b)
    return torch.mm(mat_a, mat_b, out=output)


def paged_mqa_logits_metadata(seq_lens: torch.Tensor, page_size: int, num_sm: int) -> torch.Tensor:
    """DeepGEMM's split schedule [num_sm + 1, 2] int32 for its paged logits kernel. The torch logits that the rig runs
    (SGLANG_FP8_PAGED_MQA_LOGITS_TORCH) ignore it: zeros of its shape."""
    return torch.zeros(num_sm + 1, 2, dtype=torch.int32, device=seq_lens.device)


def fp8_paged_mqa_logits(q_fp8: torch.Tensor, kv_cache_fp8: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor, schedule_metadata, max_seq_len: int,
                         clean_logits: bool = False, indices=None) -> torch.Tensor:
    """The indexer's decode logits (DeepGEMM's fp8_paged_mqa_logits contract) by ESS's Triton indexer kernel over
    SGLang's index-K pages in place (ess.core.kernels.indexer.indexer_scores_pages), in place of SGLang's torch
    version, which dequantises every page the batch reaches into a bf16 copy. q_fp8 [B, next_n, H, 128] FP8,
    weights [B * next_n, H], context_lens [B] or [B, next_n], block_table [B, P]: fp32 [B * next_n, max_seq_len],
    -inf past each row's context (SGLang's top-k masks by length there; the torch version writes 0)."""
    if indices is not None:
        raise ValueError("fp8_paged_mqa_logits: the rig's logits take no index tensor (indices)")
    B, next_n, H, D = q_fp8.shape
    lens = context_lens.reshape(B * next_n)  # [B] with next_n 1, or one length a query row
    table = block_table if next_n == 1 else block_table.repeat_interleave(next_n, dim=0)
    pages = kv_cache_fp8.reshape(kv_cache_fp8.shape[0], -1).view(torch.uint8)
    q = q_fp8.reshape(B * next_n, H, D).to(torch.bfloat16)  # every FP8 value is a bf16 value
    return indexer_scores_pages(q, weights.reshape(B * next_n, H).float(), pages, lens.long() - 1, table,
                                width=max_seq_len)


def fp8_mqa_logits(q_fp8: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], weights: torch.Tensor,
                   ks: torch.Tensor, ke: torch.Tensor, clean_logits: bool = False,
                   max_seqlen_k: int = 0) -> torch.Tensor:
    """The indexer's prefill logits (DeepGEMM's fp8_mqa_logits contract): query row m of q_fp8 [M, H, 128] FP8 over
    rows ks[m]:ke[m] of the batch's gathered index-K kv = (k_fp8 [N, 128], k_scale [N]), by ESS's Triton kernel
    (ess.core.kernels.indexer.indexer_scores_ragged), in place of SGLang's torch version, which multiplies every query
    row by every key, head by head. fp32 [M, N] in a row stride padded to 4 as SGLang's; -inf outside each window
    (SGLang's top-k masks by window; the torch version writes 0)."""
    if clean_logits:
        raise ValueError("fp8_mqa_logits: the rig's prefill logits, as SGLang's torch ones, leave the logits uncleaned "
                         "(clean_logits=False)")
    k_fp8, k_scale = kv
    N = k_fp8.shape[0]
    rows = torch.empty(N, layout.INDEX_ROW_BYTES, dtype=torch.uint8, device=k_fp8.device)  # ESS's 132-byte rows
    rows[:, : layout.INDEX_DIM] = k_fp8.reshape(N, layout.INDEX_DIM).view(torch.uint8)
    rows[:, layout.INDEX_SCALE_OFFSET :] = k_scale.float().reshape(N, 1).view(torch.uint8)
    return indexer_scores_ragged(q_fp8.to(torch.bfloat16), weights.float(), rows, ks, ke,
                                 width=(N + 3) // 4 * 4)[:, :N]


# The logits this process serves with, chosen once before its weights load (before_load_model): ESS_GPU_RIG_LOGITS
# ("ess" by default), or "torch" where ESS's kernels failed their check on the device
_served = {"logits": None}


def served_logits() -> str:
    from ess_gpu_rig import logits

    if _served["logits"] is None:  # (a process that loads no model: the setting as asked)
        _served["logits"] = logits()
    return _served["logits"]


def around_paged_logits(original, *a, **kw):
    """SGLang's torch decode logits, replaced by ESS's kernel unless this process serves torch logits."""
    return original(*a, **kw) if served_logits() == "torch" else fp8_paged_mqa_logits(*a, **kw)


def around_prefill_logits(original, *a, **kw):
    """SGLang's torch prefill logits, replaced by ESS's kernel unless this process serves torch logits."""
    return original(*a, **kw) if served_logits() == "torch" else fp8_mqa_logits(*a, **kw)


def before_load_model(model_runner, *a, **kw):
    """Each scheduler, before its weights load (and so before any forward or CUDA-graph capture): ESS's logits
    kernels checked on its device against SGLang's torch logits (ess_gpu_rig.logits_check); where they fail, this
    process serves with SGLang's torch logits. The choice is printed to the server's log either way."""
    import importlib
    import inspect
    import sys

    from ess_gpu_rig import LOGITS_ENV, logits_check

    device = torch.device(model_runner.device)
    if served_logits() == "torch":
        print(f"ESS GPU rig: indexer logits torch ({LOGITS_ENV}=torch)", file=sys.stderr, flush=True)
        return
    owner = importlib.import_module(DSA_UTILS)
    sglang = [inspect.unwrap(getattr(owner, t.rsplit(".", 1)[1])) for t in LOGITS_TARGETS]  # SGLang's own torch
    fault = logits_check.check(device, fp8_paged_mqa_logits, fp8_mqa_logits, *sglang)
    if fault is None:
        print(f"ESS GPU rig: indexer logits ess (ESS's kernels passed their check on {device})", file=sys.stderr,
              flush=True)
        return
    _served["logits"] = "torch"
    print(f"ESS GPU rig: indexer logits torch (ESS's kernels failed their check on {device}: {fault})",
          file=sys.stderr, flush=True)


INDEXER = "sglang.srt.layers.attention.dsa.dsa_indexer"
DSA_UTILS = "sglang.srt.layers.attention.dsa.utils"
LOGITS_TARGETS = (f"{DSA_UTILS}._fp8_paged_mqa_logits_torch", f"{DSA_UTILS}._fp8_mqa_logits_torch")
HADAMARD = "sglang.kernels.ops.quantization.hadamard.hadamard_transform"
DSA_BACKEND = "sglang.srt.layers.attention.dsa_backend"
FUSED_A = "sglang.kernels.ops.gemm.fused_a_gemm.dsv3_fused_a_gemm"
DSV4_OPS = "sglang.kernels.ops.attention.dsv4"
MODEL_RUNNER_LOAD = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"

PATCHES = [
    Hook(HADAMARD, HookType.REPLACE, hadamard_transform, ("x", "scale"),
         "the indexer's rotate_activation: a JIT kernel (hadamard_jit.cuh), no switch"),
    Hook(f"{INDEXER}.can_use_dsa_fused_store", HookType.REPLACE, no_fused_store,
         ("key_dtype", "indices_dtype", "page_size"),
         "the index-K store's JIT kernel (fused_store_index_k_cache); SGLang falls back to Triton only if its build fails"),
    Hook(f"{DSA_BACKEND}.concat_mla_absorb_q_general", HookType.REPLACE, concat_mla_absorb_q, ("q_nope", "q_rope"),
         "the DSA backend's absorbed query: a JIT kernel (concat_mla_absorb_q) on CUDA, no switch"),
    Hook(FUSED_A, HookType.REPLACE, dsv3_fused_a_gemm, ("mat_a", "mat_b", "output", "backend"),
         "the q_a / kv_a projection of 1-16 tokens (decode, graph capture): a JIT kernel, off only with deterministic inference"),
    Hook(f"{DSV4_OPS}.get_paged_mqa_logits_metadata", HookType.REPLACE, paged_mqa_logits_metadata,
         ("seq_lens", "page_size", "num_sm"),
         "the paged logits' schedule: a JIT kernel (paged_mqa_metadata.cuh) even on SGLang's torch logits path"),
    Hook(LOGITS_TARGETS[0], HookType.AROUND, around_paged_logits,
         ("q_fp8", "kv_cache_fp8", "weights", "context_lens", "block_table", "schedule_metadata", "max_seq_len",
          "clean_logits", "indices"),
         "the indexer's decode logits (SGLANG_FP8_PAGED_MQA_LOGITS_TORCH): ESS's Triton kernel over the pages in "
         "place of SGLang's torch, which copies them to bf16; DeepGEMM's does not load here"),
    Hook(LOGITS_TARGETS[1], HookType.AROUND, around_prefill_logits,
         ("q_fp8", "kv", "weights", "ks", "ke", "clean_logits", "max_seqlen_k"),
         "the indexer's prefill logits (the same switch): ESS's Triton kernel over each row's window in place of "
         "SGLang's torch, every query by every key head by head, quadratic in the context"),
    Hook(MODEL_RUNNER_LOAD, HookType.BEFORE, before_load_model, ("self",),
         "ESS's logits kernels checked on the device before they serve; SGLang's torch logits where they fail"),
    Hook(f"{ROTARY}.forward_native", HookType.AROUND, around_rotary_native, ("self", "positions", "query", "key"),
         "forward_native (SGLANG_FORCE_FUSED_OP_BACKEND=torch) broadcasts the indexer's 2-D key into [tokens, tokens, dim]"),
]

EXPECTED_PARAMS = expected_params(PATCHES)  # the tests' view: target -> the parameters its hook reads
