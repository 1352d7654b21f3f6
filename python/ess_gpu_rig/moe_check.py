"""The rig's MoE / FP8 stand-ins (ess_gpu_rig.rig_moe), checked on the device before the weights load, on values each
of which every path computes exactly, so any difference is a fault: the FP8 activation quantiser (SGLang's Triton
kernel; groups whose absmax is 448 times a power of two over values on the FP8 grid, so each scale is a power of two
and each quotient an FP8 value; on CUDA, Triton divides in float32 to 2 ulp (div.full.f32), so a scale may be 2 ulp
off its power of two, which rounds every quotient to the same FP8 value), row- and column-major scales; sgl_kernel's
MoE combine (small integers, sums exact in bf16); the MoE align against SGLang's own Triton align (exact by contract). Each scheduler runs it before its weights
load (rig_moe.before_load_model): a quantiser that fails gives way to the torch one, and each result is printed to the
server's log (docs/gpu-server.md); the tests run the same check on the CPU in Triton's interpreter, which computes
these values exactly too."""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def quant_case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [37, 512] bf16 of 4 groups of 128 a row, and what it quantises to exactly: q (FP8) and the scales [37, 4]."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid.abs() < FP8_MAX)]  # e4m3's finite values below its maximum
    q = grid[torch.randint(0, grid.numel(), (37, 4, 128), generator=g)]
    top = torch.randint(0, 128, (37, 4, 1), generator=g)
    q.scatter_(2, top, torch.where(torch.rand(37, 4, 1, generator=g) < 0.5, -FP8_MAX, FP8_MAX))  # each group's absmax
    scale = torch.exp2(torch.randint(-12, 4, (37, 4), generator=g).float())
    x = (q * scale.unsqueeze(-1)).reshape(37, 512)
    return x.bfloat16(), q.reshape(37, 512).to(torch.float8_e4m3fn), scale


def combine_case(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' outputs [T, k, H] (integers in [-8, 8]) and their combine at factor 2.5, exact in bf16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, (40, 3, 384), generator=g).float()
    return x.bfloat16(), (x.sum(1) * 2.5).bfloat16()


def _quant(quantiser, x: torch.Tensor, column_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(4, x.shape[0], device=x.device).t() if column_major else torch.empty(x.shape[0], 4, device=x.device)
    quantiser(x, q, s, 128, 1e-10, -FP8_MAX, FP8_MAX, scale_ue8m0=False, fuse_silu_and_mul=False, masked_m=None)
    return q, s


def check_quantiser(device, quantiser) -> str | None:
    """None where `quantiser` (rig_moe.per_token_group_quant's contract) writes the exact FP8 values and scales."""
    try:
        x, want_q, want_s = quant_case()
        for column_major in (False, True):
            q, s = _quant(quantiser, x.to(device), column_major)
            layout = "column-major" if column_major else "row-major"
            off = (s.cpu() - want_s).abs() > want_s * 2**-21  # more than 2 ulp (float32: 2^-23 a unit at 1)
            if bool(off.any()):
                return f"FP8 quantiser ({layout} scales): {int(off.sum())} of {s.numel()} scales differ"
            wrong = q.cpu().view(torch.uint8) != want_q.view(torch.uint8)
            if bool(wrong.any()):
                return f"FP8 quantiser ({layout} scales): {int(wrong.sum())} of {q.numel()} values differ"
        return None
    except Exception as e:  # a kernel that does not build or run here fails its check
        return f"FP8 quantiser: {type(e).__name__}: {str(e)[:300]}"


def check_combine(device, combine) -> str | None:
    """None where `combine` (sgl_kernel's moe_sum_reduce contract) gives the exact sums."""
    try:
        x, want = combine_case()
        out = torch.empty(want.shape, dtype=torch.bfloat16, device=device)
        combine(x.to(device), out, 2.5)
        got = out.cpu()
        return None if torch.equal(got, want) else f"MoE combine: {int((got != want).sum())} of {got.numel()} differ"
    except Exception as e:
        return f"MoE combine: {type(e).__name__}: {str(e)[:300]}"


def check_align(device, align, sglang_align) -> str | None:
    """None where `align` (rig_moe.moe_align_block_size) equals SGLang's Triton align (moe_align_small_numel) on top-8
    of 256 experts with padding rows: the padded total, every pair's place, each block's expert."""
    try:
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(0, 256, (7, 8), generator=g, dtype=torch.int32)
        ids[-2:] = -1
        ids = ids.to(device)
        size = (56 + 257 * 63 + 3) // 4 * 4
        out = []
        for fn in (align, sglang_align):
            sorted_ids = torch.empty(size, dtype=torch.int32, device=device)
            experts = torch.empty(-(-size // 64), dtype=torch.int32, device=device)
            total = torch.zeros(1, dtype=torch.int32, device=device)
            if fn is align:
                fn(ids, 257, 64, sorted_ids, experts, total, torch.empty(258, dtype=torch.int32, device=device), True)
            else:
                fn(ids, 257, 64, sorted_ids, experts, total)
            n = int(total)
            out.append((n, sorted_ids[:n].cpu(), experts[: n // 64].cpu()))
        (n, s, e), (wn, ws, we) = out
        if n != wn or not torch.equal(s, ws) or not torch.equal(e, we):
            return f"MoE align: padded total {n} (SGLang's {wn}), or a pair's place or a block's expert differs"
        return None
    except Exception as e:
        return f"MoE align: {type(e).__name__}: {str(e)[:300]}"
