"""The GPU rig's stand-ins on the MoE / FP8 / MTP path (issue 57 item 2; benchmark/gpu/moe-fp8-kernel-map.md lists
what an FP8 MoE DeepSeek-V3.2 server with EAGLE reaches on CUDA): the sgl_kernel ops and JIT kernels there, each
replaced by SGLang's own Triton kernel where SGLang has one, else by the torch that computes the same. The MoE GEMMs
(fused_moe_kernel), the FP8 block GEMM, the router's top-k (moe_fused_gate) and EAGLE's bookkeeping are SGLang's
Triton kernels already and run as they are. Everything here runs inside the decode step's CUDA graphs except the
tree build and verify (once a step, outside them), so it reads no value on the host and sizes nothing from data: each
runs on meta tensors (test/plugin/test_gpu_rig.py). The torch stand-ins are a few small kernels each where
sgl_kernel's is one; stock and ESS run the same ones (docs/gpu-server.md).
sgl_kernel's moe_sum_reduce, which SGLang's MoE imports by name, is the stand-in package's own (sgl_kernel/__init__)."""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from sglang.srt.plugins.hook_registry import HookType
from sglang_ess.hooks.table import Hook, expected_params

FP8_QUANT = "sglang.kernels.ops.quantization.fp8_kernel"
SPEC_TREE = "sglang.kernels.ops.speculative.spec_tree"
TOPK = "sglang.srt.layers.moe.topk"


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_size: int, sorted_token_ids: torch.Tensor,
                         experts_ids: torch.Tensor, num_tokens_post_pad: torch.Tensor, cumsum_buffer: torch.Tensor,
                         pad_sorted_token_ids: bool = False, ignore_invalid_expert: bool = False) -> None:
    """sgl_kernel's moe_align_block_size under SGLang's "+1" convention (num_experts counts E + 1 buckets: an expert
    id of -1, filtered out, is bucket 0): the flattened (token, slot) indices grouped by bucket, stable within one,
    each bucket's segment padded to a multiple of block_size with the value numel; experts_ids[b] is the bucket of
    block b minus one (-1 for the filtered bucket and for blocks past the total); num_tokens_post_pad[0] the padded
    total; cumsum_buffer the buckets' padded offsets. The whole of sorted_token_ids is filled first (SGLang passes
    pad_sorted_token_ids=True); the fused MoE kernel reads nothing past the total."""
    if ignore_invalid_expert:
        raise ValueError("moe_align_block_size: the GPU rig aligns under the +1 convention only "
                         "(ignore_invalid_expert=True is SGLang's EP contract, not on the rig's path)")
    buckets = topk_ids.reshape(-1).long() + 1
    numel = buckets.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=buckets.device)
    counts.scatter_add_(0, buckets, torch.ones_like(buckets))
    padded = (counts + block_size - 1) // block_size * block_size
    ends = padded.cumsum(0)
    sorted_buckets, pair = torch.sort(buckets, stable=True)
    rank = torch.arange(numel, device=buckets.device) - (counts.cumsum(0) - counts)[sorted_buckets]
    sorted_token_ids.fill_(numel)
    sorted_token_ids.scatter_(0, (ends - padded)[sorted_buckets] + rank, pair.to(sorted_token_ids.dtype))
    total = ends[-1:]
    num_tokens_post_pad[:1].copy_(total)
    block_start = torch.arange(experts_ids.numel(), device=buckets.device) * block_size
    bucket = torch.searchsorted(ends, block_start, right=True)
    experts_ids.copy_(torch.where(block_start < total, bucket - 1, -1))
    cumsum_buffer[:1].zero_()
    cumsum_buffer[1 : num_experts + 1].copy_(ends)


# The FP8 quantiser this process serves with: SGLang's Triton kernel, or the torch one where the kernel failed its check
# on the device (before_load_model)
_served = {"quantiser": "triton"}


def per_token_group_quant(x: torch.Tensor, x_q: torch.Tensor, x_s: torch.Tensor, group_size: int, eps: float,
                          fp8_min: float, fp8_max: float, *, scale_ue8m0: bool, fuse_silu_and_mul: bool,
                          masked_m) -> None:
    """The FP8 activation quantiser of every FP8 linear and both MoE GEMMs (SGLang's JIT per_token_group_quant) by
    SGLang's Triton kernel, the one it runs off CUDA: per group of group_size, s = max(absmax, eps) / 448,
    q = clamp(x / s) in FP8, into the caller's x_q / x_s (row- or column-major scales)."""
    if scale_ue8m0 or fuse_silu_and_mul or masked_m is not None:
        raise ValueError("per_token_group_quant: the GPU rig quantises plain groups only (scale_ue8m0, "
                         "fuse_silu_and_mul and masked_m are DeepGEMM's and DeepEP's paths, off on the rig)")
    if _served["quantiser"] == "torch":
        quantise_torch(x, x_q, x_s, group_size, eps, fp8_min, fp8_max)
        return
    raw = importlib.import_module(FP8_QUANT)._per_token_group_quant_8bit_raw
    if x_s.is_contiguous():
        raw(x, group_size, eps, x_q.dtype, output_q=x_q, output_s=x_s)
    elif x.dim() == 2 and x_s.stride(0) == 1:
        raw(x, group_size, eps, x_q.dtype, column_major_scales=True, output_q=x_q, output_s=x_s)
    else:
        raise ValueError(f"per_token_group_quant: scales of strides {x_s.stride()} for x of shape {tuple(x.shape)}")


def quantise_torch(x: torch.Tensor, x_q: torch.Tensor, x_s: torch.Tensor, group_size: int, eps: float,
                   fp8_min: float, fp8_max: float) -> None:
    """The same formula in torch (as the Triton kernel writes it: x times the reciprocal of its group's scale, here
    with IEEE division)."""
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    scale = groups.abs().amax(-1).clamp(min=eps) / fp8_max
    x_q.copy_((groups * (1.0 / scale).unsqueeze(-1)).clamp(fp8_min, fp8_max).reshape(x.shape))
    x_s.copy_(scale.reshape(x_s.shape))


def per_token_quant_fp8(input: torch.Tensor, output_q: torch.Tensor, output_s: torch.Tensor) -> None:
    """SGLang's JIT per-token FP8 quantiser (a group of the whole row, scales [T, 1]), by the group quantiser above."""
    per_token_group_quant(input, output_q, output_s.view(output_s.shape[0], 1), input.shape[-1], 1e-10, -448.0, 448.0,
                          scale_ue8m0=False, fuse_silu_and_mul=False, masked_m=None)


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None, expert_ids=None, expert_step: int = 1, *,
                 sorted_token_ids=None, num_tokens_post_padded=None, num_valid_tokens: int = 0) -> torch.Tensor:
    """The fused MoE's activation (SGLang's JIT silu_and_mul) as SGLang's own torch fallback in fused_moe computes
    it: silu(x[..., :d]) * x[..., d:]. Its row filter (expert_ids: EP or a TMA down GEMM) is not on the rig's path."""
    if expert_ids is not None or sorted_token_ids is not None:
        raise ValueError("silu_and_mul: the GPU rig's has no row filter (expert_ids / sorted_token_ids: EP or a "
                         "USE_TMA down config, neither on the rig's path)")
    d = input.shape[-1] // 2
    if out is None:
        out = input.new_empty(*input.shape[:-1], d)
    torch.mul(F.silu(input[..., :d]), input[..., d:], out=out)
    return out


def no_tiny_gemm(n: int, k: int, max_m: int = 16) -> bool:
    """can_use_tiny_gemm: False sends the router's few-token GEMM to cuBLAS (torch.mm, fp32 out), not the JIT kernel."""
    return False


def mask_topk_ids(topk_ids: torch.Tensor, num_token_non_padded: torch.Tensor) -> None:
    """The JIT mask of CUDA-graph padding rows: topk_ids[r, :] = -1 for r >= num_token_non_padded, as SGLang's CPU
    branch of _mask_topk_ids_padded_region does it (masked_fill)."""
    rows = torch.arange(topk_ids.shape[0], device=topk_ids.device)
    topk_ids.masked_fill_((rows >= num_token_non_padded.reshape(-1)[:1])[:, None], -1)


def biased_grouped_topk_postprocess(topk_ids, expert_location_dispatch_info, num_token_non_padded):
    """SGLang's _biased_grouped_topk_postprocess without its torch.compile: the same two calls, run eagerly (an
    inductor build of two element-wise ops would cost the lease's start-up minutes, under Triton 3.6)."""
    topk = importlib.import_module(TOPK)
    topk_ids = topk.topk_ids_logical_to_physical(topk_ids, expert_location_dispatch_info)
    topk._mask_topk_ids_padded_region(topk_ids, num_token_non_padded)
    return topk_ids


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """SGLang's RMSNorm.forward_native: in float32, x * rsqrt(mean(x^2) + eps) times the weight, cast back."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def fused_eh_norm(inputs_embeds: torch.Tensor, previous_hidden: torch.Tensor, enorm_weight: torch.Tensor,
                  hnorm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The MTP layer's input (SGLang's JIT fused_eh_norm): its off-CUDA branch, the RMS-normed embeddings beside the
    RMS-normed previous hidden state."""
    return torch.cat([rms_norm(inputs_embeds, enorm_weight, eps), rms_norm(previous_hidden, hnorm_weight, eps)], -1)


def before_load_model(model_runner, *a, **kw):
    """Each scheduler of a model with MoE layers or FP8 weights, before its weights load: the stand-ins checked on its
    device (ess_gpu_rig.moe_check); a quantiser that fails gives way to the torch one. Printed to the server's log."""
    import sys

    from ess_gpu_rig import moe_check

    config = model_runner.model_config
    hf = config.hf_config
    moe = getattr(hf, "n_routed_experts", None) and getattr(hf, "first_k_dense_replace", 0) < hf.num_hidden_layers
    if not (moe or getattr(config, "quantization", None)):
        return
    device = torch.device(model_runner.device)
    align = importlib.import_module("sglang.kernels.ops.moe.moe_align_small_numel").moe_align_small_numel
    faults = {"FP8 quantiser": moe_check.check_quantiser(device, per_token_group_quant),
              "combine": moe_check.check_combine(device, importlib.import_module("sgl_kernel").moe_sum_reduce),
              "align": moe_check.check_align(device, moe_align_block_size, align)}
    if faults["FP8 quantiser"]:
        _served["quantiser"] = "torch"
    said = "; ".join(f"{k} {'FAULT: ' + v if v else 'ok'}" for k, v in faults.items())
    print(f"ESS GPU rig: MoE stand-ins on {device}: {said}; FP8 quantiser served: {_served['quantiser']}",
          file=sys.stderr, flush=True)


def build_tree(*args, **kwargs) -> None:
    """EAGLE's verify tree (SGLang's JIT build_tree_kernel_efficient) by SGLang's Triton version, its XPU branch."""
    importlib.import_module(SPEC_TREE).sgl_build_tree_kernel_triton(*args, **kwargs)


def verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
                       retrieve_next_sibling, target_predict, topk: int = -1):
    """EAGLE's greedy verify (SGLang's JIT verify_tree_greedy) by SGLang's Triton version, its XPU branch."""
    importlib.import_module(SPEC_TREE).verify_tree_greedy_triton(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num, candidates=candidates,
        retrieve_index=retrieve_index, retrieve_next_token=retrieve_next_token,
        retrieve_next_sibling=retrieve_next_sibling, target_predict=target_predict)
    return predicts, accept_index, accept_token_num


PATCHES = [
    Hook("sglang.srt.model_executor.model_runner.ModelRunner.load_model", HookType.BEFORE, before_load_model,
         ("self",), "the MoE / FP8 stand-ins checked on the device before they serve; torch's quantiser where it fails"),
    Hook("sglang.kernels.ops.moe.moe_align_block_size", HookType.REPLACE, moe_align_block_size,
         ("topk_ids", "num_experts", "block_size", "sorted_token_ids", "experts_ids", "num_tokens_post_pad",
          "cumsum_buffer", "pad_sorted_token_ids", "ignore_invalid_expert"),
         "sgl_kernel's align (AOT) before every fused MoE; SGLang's Triton one covers only <= 64 pairs and > 64 experts"),
    Hook(f"{FP8_QUANT}._run_per_token_group_quant_8bit_kernel", HookType.REPLACE, per_token_group_quant,
         ("x", "x_q", "x_s", "group_size", "eps", "fp8_min", "fp8_max"),
         "every FP8 linear's and MoE GEMM's activation quantiser: a JIT kernel on CUDA; SGLang's Triton one elsewhere"),
    Hook("sglang.kernels.ops.quantization.sgl_per_token_quant_fp8", HookType.REPLACE, per_token_quant_fp8,
         ("input", "output_q", "output_s"),
         "the group quantiser's whole-row case (a group as wide as the row): a JIT kernel"),
    Hook("sglang.kernels.ops.activation.activation.silu_and_mul", HookType.REPLACE, silu_and_mul,
         ("input", "out", "expert_ids", "expert_step"),
         "the fused MoE's activation between its GEMMs: a JIT kernel on CUDA, SGLang's torch elsewhere"),
    Hook("sglang.kernels.ops.gemm.tiny_gemm.can_use_tiny_gemm", HookType.REPLACE, no_tiny_gemm, ("n", "k", "max_m"),
         "the router's GEMM of <= 16 tokens (every decode step): a JIT kernel; cuBLAS when it cannot serve"),
    Hook("sglang.kernels.ops.moe.dsv4.mask_topk_ids", HookType.REPLACE, mask_topk_ids,
         ("topk_ids", "num_token_non_padded"),
         "the top-k of CUDA-graph padding rows set to -1: a JIT kernel on CUDA with int32 ids"),
    Hook(f"{TOPK}._biased_grouped_topk_postprocess", HookType.REPLACE, biased_grouped_topk_postprocess,
         ("topk_ids", "expert_location_dispatch_info", "num_token_non_padded"),
         "torch.compile'd around the mask: an inductor build at start-up"),
    Hook("sglang.kernels.ops.layernorm.fused_eh_norm.fused_eh_norm", HookType.REPLACE, fused_eh_norm,
         ("inputs_embeds", "previous_hidden", "enorm_weight", "hnorm_weight", "eps"),
         "the MTP layer's input norms: a JIT kernel on CUDA, torch elsewhere"),
    Hook(f"{SPEC_TREE}.build_tree_kernel_efficient_func", HookType.REPLACE, build_tree,
         ("parent_list", "top_scores_index", "seq_lens", "tree_mask", "positions", "retrieve_index",
          "retrieve_next_token", "retrieve_next_sibling", "topk", "spec_steps", "num_verify_tokens", "tree_mask_mode"),
         "EAGLE's tree build: a JIT kernel on CUDA; SGLang's Triton one on XPU"),
    Hook(f"{SPEC_TREE}.verify_tree_greedy_func", HookType.REPLACE, verify_tree_greedy,
         ("predicts", "accept_index", "accept_token_num", "candidates", "retrieve_index", "retrieve_next_token",
          "retrieve_next_sibling", "target_predict", "topk"),
         "EAGLE's greedy verify: a JIT kernel on CUDA; SGLang's Triton one on XPU"),
]

EXPECTED_PARAMS = expected_params(PATCHES)
