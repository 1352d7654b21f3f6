"""DA's Attn1 over the misses only, and the misses' H2D fused with it (docs/design.md, "Overlap"; docs/gpu.md).

FlashMLA's V3.2 sparse decode takes no `topk_length`, and a call costs nearly as much with 0 valid entries as with
2048 (docs/gpu.md), so DA's second full-width call (Attn1 with the hits set to -1) costs a whole call. Here Attn1 is a
compact kernel over each query row's compacted miss list instead (the LRU step's `miss_slot` and device count
`n_miss`: a fixed width, so it captures in a CUDA graph, and a loop that stops at the count):

    miss_attention(q_nope, q_pe, pool, slots, counts, scale)
        per query row n: attention over pool[slots[n, i]] for i < counts[n] (slot -1: skipped)
    copy_attend(q_nope, q_pe, host, host_rows, gpu, gpu_slots, counts, scale)
        the same over the misses as they land: for i < counts[n], gpu[gpu_slots[n, i]] = host[host_rows[n, i]]
        (FlashTrans' H2D, ess.core.kernels.flashtrans.gather_lists) and the row is attended, in one kernel that reads each
        missing row from the pinned host pool once (UVA)
    merge(o0, lse0, o1, lse1)
        Attn0 (FlashMLA over the top-k with the misses set to -1) and Attn1 merged by log-sum-exp (a kernel of its
        own on a GPU)

Rows are V3.2's 656-byte latent rows (ess.core.layout: 512 FP8 e4m3 values in 4 tiles with 4 float32 scales, 64 bf16
RoPE values). Output and LSE follow FlashMLA's conventions: o [N, H, 512] (float32 here), lse [N, H] in natural log,
the softmax scale as given (the model's); a row without an entry gives o = 0 and lse = -inf (FlashMLA's kernel
returns +inf there: `merge` takes either as empty). Every entry of the list counts once: the indexer's top-k has
distinct positions, and the LRU step lists each missing position once.

The kernel. One program per (query row, block of BLOCK_H heads) for miss_attention; for copy_attend one program per
query row, looping over the head blocks, so each row crosses PCIe once: the first head block copies each chunk of
BLOCK_N rows into its GPU slots and attends from there after a block barrier, the later head blocks read the slots
(in L2 by then). So copy_attend runs on as many programs as query rows (32 at batch 32), beside Attn0 on the copy
stream, as FlashTrans' copies beside compute do. Within a program: flash-decoding's online softmax over chunks of
BLOCK_N entries, the rows decoded in registers (FP8 bytes bitcast, times their tile's scale; bf16 RoPE widened),
q . k and p . v with tl.dot in bf16 on a GPU (FlashMLA's precision: bf16 query, FP8 rows widened to bf16, float32
accumulation), in float32 ("ieee") in Triton's CPU interpreter.

Backends: "triton" (CUDA tensors; the host pool pinned, read through UVA), "interpret" (the same kernel in Triton's CPU
interpreter from Triton 3.8: how CI checks it), "torch" (ess.core.dsa_math over the gathered rows: the CPU path, the
same function). "auto": "triton" for CUDA tensors, else "torch".

Timed on an H200 and an H100 (docs/gpu.md): BLOCK_H, BLOCK_N and NUM_WARPS are the fastest of the seven launch
configurations benchmark/gpu/kit.py's DA split tried at 256 misses per request, batch 32, on both (83.1 and 83.2 us
against 106.7 and 120.9 for the first choice, 16 / 16 / 4); other miss counts were timed at the first choice only.
"""

from __future__ import annotations

import math

import torch

from ess.core import dsa_math, layout
from ess.core.kernels import flashtrans
from ess.core.kernels.flashtrans import compiled, kernel_backend, triton

BLOCK_H = 32  # heads per block (tl.dot's minimum is 16)
BLOCK_N = 32  # entries per chunk of the online softmax
NUM_WARPS = 8  # per program (GPU only)

if triton is not None:
    import triton.language as tl

    # Reductions through tl.reduce with the standard library's combine functions: tl.sum / tl.max are jit functions,
    # which Triton's interpreter cannot call unless TRITON_INTERPRET was set at import (as in ess.core.kernels.flashtrans).
    _ADD, _MAX = tl.standard._sum_combine, tl.standard._elementwise_max

    def _miss_kernel(qn_ptr, qp_ptr, src, src_idx, dst, dst_idx, counts, o_ptr, lse_ptr, scale, W, H,
                     HEAD_BLOCKS: tl.constexpr, FUSED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                     DOT_BF16: tl.constexpr, PRECISION: tl.constexpr, CACHE: tl.constexpr):
        NOPE: tl.constexpr = 512
        ROPE: tl.constexpr = 64
        ROW: tl.constexpr = 656
        WORDS: tl.constexpr = 164
        n = tl.program_id(0).to(tl.int64)
        cnt = tl.load(counts + n).to(tl.int32)
        c = tl.arange(0, NOPE)
        r = tl.arange(0, ROPE)
        j = tl.arange(0, BLOCK_N)
        words = tl.arange(0, 256)
        hb0 = tl.program_id(1) * HEAD_BLOCKS
        for hb in range(hb0, hb0 + HEAD_BLOCKS):
            h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
            hm = (h < H)[:, None]
            qrow = (n * H + h.to(tl.int64))[:, None]
            qn = tl.load(qn_ptr + qrow * NOPE + c[None, :], mask=hm, other=0.0)
            qp = tl.load(qp_ptr + qrow * ROPE + r[None, :], mask=hm, other=0.0)
            if DOT_BF16:
                qn = qn.to(tl.bfloat16)
                qp = qp.to(tl.bfloat16)
            else:
                qn = qn.to(tl.float32)
                qp = qp.to(tl.float32)
            m = tl.full([BLOCK_H], float("-inf"), tl.float32)
            l = tl.full([BLOCK_H], 0.0, tl.float32)
            acc = tl.full([BLOCK_H, NOPE], 0.0, tl.float32)
            for start in range(0, cnt, BLOCK_N):
                i = start + j
                live = i < cnt
                d = tl.load(dst_idx + n * W + i, mask=live, other=-1).to(tl.int64)
                ok = d >= 0
                if FUSED:
                    s_row = tl.load(src_idx + n * W + i, mask=live, other=-1).to(tl.int64)
                    ok = ok & (s_row >= 0)
                    if hb == hb0:  # the first head block lands the chunk in its GPU slots (FlashTrans' copy)
                        wm = ok[:, None] & (words < WORDS)[None, :]
                        v = tl.load((src + s_row[:, None] * ROW).to(tl.pointer_type(tl.int32)) + words[None, :], mask=wm)
                        tl.store((dst + d[:, None] * ROW).to(tl.pointer_type(tl.int32)) + words[None, :], v, mask=wm)
                    tl.debug_barrier()  # the chunk's slots written by the block before any thread reads them
                base = dst + d[:, None] * ROW
                okc = ok[:, None]
                kb = tl.load(base + c[None, :], mask=okc, other=0, cache_modifier=CACHE)
                sc = tl.load((base + 512).to(tl.pointer_type(tl.float32)) + (c // 128)[None, :], mask=okc, other=0.0,
                             cache_modifier=CACHE)
                kv = kb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc  # [BLOCK_N, 512]
                pe16 = tl.load((base + 528).to(tl.pointer_type(tl.int16)) + r[None, :], mask=okc, other=0,
                               cache_modifier=CACHE)
                pe = (pe16.to(tl.int32) << 16).to(tl.float32, bitcast=True)  # bf16 -> float32, exact
                if DOT_BF16:
                    kv = kv.to(tl.bfloat16)
                    pe = pe.to(tl.bfloat16)
                s = tl.dot(qn, tl.trans(kv), input_precision=PRECISION)
                s = (s + tl.dot(qp, tl.trans(pe), input_precision=PRECISION)) * scale  # [BLOCK_H, BLOCK_N]
                s = tl.where(ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.reduce(s, 1, _MAX))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no entry yet: nothing to rescale
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m - m_safe)
                l = l * alpha + tl.reduce(p, 1, _ADD)
                acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PRECISION)
                m = m_new
            seen = l > 0.0
            lse = tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("-inf"))
            o = tl.where(seen[:, None], acc / tl.where(seen, l, 1.0)[:, None], 0.0)
            tl.store(o_ptr + qrow * NOPE + c[None, :], o, mask=hm)
            tl.store(lse_ptr + n * H + h, lse, mask=h < H)


    def _merge_kernel(o0_ptr, lse0_ptr, o1_ptr, lse1_ptr, o_ptr, lse_ptr, D: tl.constexpr):
        """One (query row, head) per program: merge's formula on one row of D values, float32."""
        r = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, D)
        l0 = tl.load(lse0_ptr + r).to(tl.float32)
        l1 = tl.load(lse1_ptr + r).to(tl.float32)
        l0 = tl.where(l0 == float("inf"), float("-inf"), l0)  # FlashMLA's empty row
        l1 = tl.where(l1 == float("inf"), float("-inf"), l1)
        m = tl.maximum(l0, l1)
        empty = m == float("-inf")  # both parts
        m_safe = tl.where(empty, 0.0, m)
        total = tl.exp(l0 - m_safe) + tl.exp(l1 - m_safe)
        lse = m_safe + tl.log(tl.where(empty, 1.0, total))  # logaddexp
        safe = tl.where(empty, 0.0, lse)
        w0 = tl.exp(l0 - safe)
        w1 = tl.exp(l1 - safe)
        o0 = tl.load(o0_ptr + r * D + d).to(tl.float32)
        o1 = tl.load(o1_ptr + r * D + d).to(tl.float32)
        o = tl.where(l0 > float("-inf"), o0 * w0, 0.0) + tl.where(l1 > float("-inf"), o1 * w1, 0.0)
        tl.store(o_ptr + r * D + d, o.to(o_ptr.dtype.element_ty))
        tl.store(lse_ptr + r, tl.where(empty, float("-inf"), lse))
else:  # compiled() refuses these without triton, naming the caller
    _miss_kernel = None
    _merge_kernel = None


def _got(x) -> str:
    return f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _is_int(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in (torch.int32, torch.int64)


def _pool(x, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.dim() != 2 or x.shape[1] != layout.LATENT_ROW_BYTES \
            or not x.is_contiguous():
        raise ValueError(f"miss attention: {name} must be contiguous uint8 [rows, {layout.LATENT_ROW_BYTES}] latent rows, "
                         f"got {_got(x)}")


def _check(q_nope, q_pe, counts, lists: dict) -> tuple[int, int, int]:
    """Refuse bad inputs naming the argument; returns (N, H, W)."""
    if not isinstance(q_nope, torch.Tensor) or q_nope.dim() != 3 or q_nope.shape[2] != layout.NOPE_DIM \
            or not q_nope.is_floating_point():
        raise ValueError(f"miss attention: q_nope must be a float [N, H, {layout.NOPE_DIM}] tensor, got {_got(q_nope)}")
    N, H, _ = q_nope.shape
    if not isinstance(q_pe, torch.Tensor) or tuple(q_pe.shape) != (N, H, layout.ROPE_DIM) or not q_pe.is_floating_point():
        raise ValueError(f"miss attention: q_pe must be a float [N, H, {layout.ROPE_DIM}] = [{N}, {H}, "
                         f"{layout.ROPE_DIM}] tensor, got {_got(q_pe)}")
    W = None
    for name, t in lists.items():
        if not _is_int(t) or t.dim() != 2 or t.shape[0] != N or (W is not None and t.shape[1] != W):
            raise ValueError(f"miss attention: {name} must be an int32 or int64 [N, W] tensor with N = {N}"
                             f"{'' if W is None else f', W = {W}'}, got {_got(t)}")
        W = t.shape[1]
    if not _is_int(counts) or tuple(counts.shape) != (N,):
        raise ValueError(f"miss attention: counts must be an int32 or int64 [N] = [{N}] tensor, got {_got(counts)}")
    for name, t in (("q_pe", q_pe), ("counts", counts), *lists.items()):
        if t.device != q_nope.device:
            raise ValueError(f"miss attention: {name} is on {t.device}, q_nope on {q_nope.device}")
    return N, H, W


def _listed(slots: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[N, W] bool: entry i of row n is one of its first counts[n] and names a slot."""
    return (torch.arange(slots.shape[1], device=slots.device).unsqueeze(0) < counts.unsqueeze(1)) & (slots >= 0)


def _torch_attend(q_nope, q_pe, pool, slots, valid, scale):
    """The CPU path: ess.core.dsa_math's sparse MLA over the listed rows, in float32."""
    return dsa_math.sparse_attention(q_nope.float(), q_pe.float(), pool[slots.long().clamp(min=0)], valid, scale)


def _launch(q_nope, q_pe, src, src_idx, dst, dst_idx, counts, scale, N, H, W, fused: bool, interpret: bool,
            block_h: int | None, block_n: int | None, num_warps: int | None):
    dev = q_nope.device
    o = torch.empty(N, H, layout.NOPE_DIM, dtype=torch.float32, device=dev)
    lse = torch.empty(N, H, dtype=torch.float32, device=dev)
    if N * H == 0:
        return o, lse
    bh, bn = block_h or BLOCK_H, block_n or BLOCK_N
    blocks = -(-H // bh)
    grid = (N, 1) if fused else (N, blocks)
    if not interpret and not dst.is_cuda:
        raise ValueError("miss attention: the GPU pool must be a CUDA tensor")
    if not interpret and not src.is_cuda:
        src = flashtrans._UvaPointer(src)  # pinned host memory, read in place over UVA
    compiled(_miss_kernel, interpret, "miss attention")[grid](
        q_nope.contiguous(), q_pe.contiguous(), src, src_idx.contiguous(), dst, dst_idx.contiguous(), counts.contiguous(),
        o, lse, float(scale), W, H,
        HEAD_BLOCKS=blocks if fused else 1, FUSED=fused, BLOCK_H=bh, BLOCK_N=bn,
        DOT_BF16=not interpret, PRECISION="ieee" if interpret else None, CACHE=".cg" if fused and not interpret else "",
        **({} if interpret else {"num_warps": num_warps or NUM_WARPS}),
    )
    return o, lse


def miss_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                   counts: torch.Tensor, scale: float, backend: str = "auto", block_h: int | None = None,
                   block_n: int | None = None, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attn1 over compacted lists: q_nope [N, H, 512], q_pe [N, H, 64] (the absorbed query), pool [R, 656] uint8 rows,
    slots [N, W] pool rows compacted left (the LRU step's miss_slot), counts [N] how many of each row's are listed
    (n_miss, on the device: nothing syncs). Returns (o [N, H, 512] float32, lse [N, H] float32, natural log; 0 and
    -inf for a row without entries)."""
    N, H, W = _check(q_nope, q_pe, counts, {"slots": slots})
    _pool(pool, "pool")
    backend = kernel_backend(backend, pool.device, "miss attention")
    if backend == "torch":
        return _torch_attend(q_nope, q_pe, pool, slots, _listed(slots, counts), scale)
    return _launch(q_nope, q_pe, pool, slots, pool, slots, counts, scale, N, H, W, False, backend == "interpret",
                   block_h, block_n, num_warps)


def copy_attend(q_nope: torch.Tensor, q_pe: torch.Tensor, host: torch.Tensor, host_rows: torch.Tensor,
                gpu: torch.Tensor, gpu_slots: torch.Tensor, counts: torch.Tensor, scale: float, backend: str = "auto",
                block_h: int | None = None, block_n: int | None = None,
                num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The misses' H2D and Attn1 in one kernel: for i < counts[n], gpu[gpu_slots[n, i]] = host[host_rows[n, i]]
    (pairs with a -1 skipped, as ess.core.kernels.flashtrans.gather_lists) and query row n attends to the rows it copied.
    host [rows, 656] the pinned host pool (on a GPU; a CPU tensor in the interpreter and the torch path), gpu [slots,
    656]; the lists and counts as miss_attention's. Returns miss_attention's (o, lse) over gpu[gpu_slots] after the
    copy."""
    N, H, W = _check(q_nope, q_pe, counts, {"host_rows": host_rows, "gpu_slots": gpu_slots})
    _pool(host, "host")
    _pool(gpu, "gpu")
    backend = kernel_backend(backend, gpu.device, "miss attention")
    if backend == "torch":
        flashtrans.gather_lists(host, host_rows, gpu, gpu_slots, counts, "torch")
        valid = _listed(gpu_slots, counts) & (host_rows >= 0)
        return _torch_attend(q_nope, q_pe, gpu, gpu_slots, valid, scale)
    return _launch(q_nope, q_pe, host, host_rows, gpu, gpu_slots, counts, scale, N, H, W, True,
                   backend == "interpret", block_h, block_n, num_warps)


def merge(o0: torch.Tensor, lse0: torch.Tensor, o1: torch.Tensor, lse1: torch.Tensor, backend: str = "auto",
          out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Attn0 and Attn1 over disjoint entries merged by log-sum-exp (ess.core.dsa_math.merge_attention): o [..., D]
    and lse [...] each; computed in float32, o written in out_dtype (the serving path's bf16: no extra pass), lse in
    float32. An lse of +inf (FlashMLA's for a row without a valid entry) counts as empty, like -inf, and an empty
    part's o is ignored. On a GPU one Triton kernel, one program per row of D values, reading each input once (the
    torch ops took 63-67 us at batch 32 on an H200, docs/gpu.md); "torch" is the reference, "interpret" the kernel in
    Triton's CPU interpreter; the two agree within float32 rounding."""
    if o0.shape != o1.shape or lse0.shape != lse1.shape or o0.shape[:-1] != lse0.shape:
        raise ValueError(f"merge: o0 {tuple(o0.shape)}, o1 {tuple(o1.shape)} must match and lse0 {tuple(lse0.shape)}, "
                         f"lse1 {tuple(lse1.shape)} must be their leading dimensions")
    backend = kernel_backend(backend, o0.device, "miss attention")
    if backend != "torch":
        D = o0.shape[-1]
        if D & (D - 1):
            raise ValueError(f"merge: the kernel takes a power-of-two last dimension (512 in V3.2), got {D}")
        o = torch.empty(o0.shape, dtype=out_dtype, device=o0.device)
        lse = torch.empty(lse0.shape, dtype=torch.float32, device=o0.device)
        R = lse.numel()
        if R:
            compiled(_merge_kernel, backend == "interpret", "merge")[(R,)](
                o0.reshape(R, D).contiguous(), lse0.reshape(R).contiguous(), o1.reshape(R, D).contiguous(),
                lse1.reshape(R).contiguous(), o, lse, D=D)
        return o, lse
    lse0 = torch.where(lse0 == math.inf, -math.inf, lse0.float())
    lse1 = torch.where(lse1 == math.inf, -math.inf, lse1.float())
    o0 = torch.where(torch.isfinite(lse0).unsqueeze(-1), o0.float(), 0.0)  # an empty part's o is whatever the kernel left
    o1 = torch.where(torch.isfinite(lse1).unsqueeze(-1), o1.float(), 0.0)
    o, lse = dsa_math.merge_attention(o0, lse0, o1, lse1)
    return o.to(out_dtype), lse
