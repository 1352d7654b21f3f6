"""The decode Lightning Indexer over FP8 index-K rows in place, as one Triton kernel, and its top-k.

    indexer_scores_fp8(q, w, rows, pos, loc=None)     fp32 [N, T]: score[n, t] = sum_h w[n, h] * ReLU(q[n, h] . k[n, t])
    indexer_scores_pages(q, w, pages, pos, page_table)
                                                      the same over SGLang's own index-K pages, read in place
    indexer_scores_ragged(q, w, keys, starts, ends)   prefill's: each query row over its window of one key table
    indexer_topk_fp8(q, w, rows, pos, k, loc=None, select="keys")
                                                      int32 [N, k]: the best k positions, best first, -1 padded
    indexer_keys_fp8(q, w, rows, pos, loc=None)       int64 [N, T]: the score keys the top-k ranks (below)
equal to ess.core.dsa_math's `index_scores` then `select_topk` (docs/design.md, "Model facts"), up to fp32 summation
order in the scores, and exactly in the top-k (tie rule below).

What the kernel reads. Index-K rows (ess.core.layout: 128 FP8 e4m3 bytes, then one float32 scale; value = fp8 *
scale) are read as the uint8 bytes they are: the kernel bitcasts each byte to FP8 in registers and multiplies the dot
product by the row's scale, so no dequantised copy of the cache is ever made. Four layouts:
    rows [N, T, 132]                 each request's rows (benchmark/decode_gpu.py's index_k, any strides but the last)
    rows [S, 132] + loc [N, T]       a flat row table and each request's row locations (a serving system's token
                                     table, read in place); loc -1: no row there, the position scores -inf
    pages [S, 64 * 132] + page_table [N, P]
                                     SGLang's index-K pages (64 rows of 128 FP8 bytes, then their 64 scales; 128-byte
                                     aligned rows) and each request's pages (-1: none): the GPU rig's decode logits
                                     (python/ess_gpu_rig, in place of DeepGEMM's fp8_paged_mqa_logits)
    keys [S, 132] + starts, ends [M] prefill's ragged windows: query row m over keys[starts[m]:ends[m]] of one table
                                     (indexer_scores_ragged; the rig's prefill logits, for fp8_mqa_logits)
Positions t > pos[n] score -inf (the request's own token, at pos[n], is included); with starts, so do t < starts[n].

Tile. One program per (SPAN blocks of BLOCK_T = 128 positions, request n): it loads the request's queries [H, 128]
once (SPAN > 1 reads them less often: with one block they cost as many bytes as the block's rows), then for each
block the rows [128, 128] bytes and scales, computes q . k^T with tl.dot (H padded to a power of two >= 16, the dot's
minimum; padded heads have weight 0), scales, ReLU, weights and reduces over the heads in registers. A program whose
positions are all beyond pos[n] reads nothing and writes -inf. The dot runs in the queries' dtype: bf16 / fp16 queries on the
tensor cores (an FP8 value is exact in either), fp32 queries in full fp32 ("ieee", not TF32). The model's queries
have been through FP8 (ess.reference's index_query), so bf16 holds them exactly: pass bf16 for speed.

Tie rule: select_topk's. Ties go to the lower position, positions <= pos[n] only, -inf (and missing rows) never
chosen, -1 padding, int32. The kernel writes each score as a unique, order-preserving int64 key instead of a float:
    key = (monotone int32 of the float's bits) << 32 | (2^32 - 1 - t)
so a larger key is a larger score, or an equal score at a lower position (-0.0 is made +0.0 first: they tie in
select_topk). torch.topk over the keys then has no ties to break, and its sorted output is select_topk's, order
included; the position is read back from the low word. NaN scores are not ranked as select_topk ranks them (inputs
are finite).

Backends: "triton" (the compiled kernel, CUDA tensors; FP8 e4m3 needs compute capability 8.9 or later, e.g. an
H100), "interpret" (the same kernel in Triton's CPU interpreter, from Triton 3.8: how CI checks it; there bf16 queries
are multiplied in fp32, since the interpreter's tl.dot multiplies bf16 as raw integers: the products are the same),
"torch" (the reference math of ess.core.dsa_math, for machines without Triton; it dequantises, so it is a check, not
a fast path). "auto": "triton" for CUDA tensors, else "torch".

Timed on a GPU only inside the decode stack so far (docs/gpu.md: with the indexer's projections, 1.91 ms per layer at
32K, batch 204, on an H200, about 10x the byte floor); benchmark/indexer_kernels.py times the parts apart. BLOCK_T and
NUM_WARPS are untuned first choices; the top-k is torch.topk over int64 keys (a radix select over 64 instead of 32
bits), and the keys take 8 bytes a position ([N, T] int64; the rows read are 132); select="radix" writes fp32 scores
instead and picks the k with ess.core.kernels.topk_select's radix select over 32-bit keys, one program a request;
select="fused" writes fp32 scores and counts the first histogram of ess.core.kernels.topk_split's radix select as it does,
whose other passes then spread each request over many programs (same sets; neither timed on a GPU yet). A
132-byte row is 4-byte but not 16-byte aligned, so the FP8 values may be loaded byte by byte; LOADS = "words" reads
them as 32 aligned 4-byte words unpacked in registers instead (equal keys, tested; which is faster waits for
benchmark/indexer_kernels.py on a GPU).
"""

from __future__ import annotations

import math

import torch

from ess.core import dsa_math, layout
from ess.core.kernels import topk_select, topk_split
from ess.core.kernels.flashtrans import compiled, kernel_backend, triton

BLOCK_T = 128  # positions per block
SPAN = 1  # blocks per program, the queries loaded once for them (> 1: untimed on a GPU, benchmark/indexer_kernels.py sweeps)
NUM_WARPS = 4  # per program (GPU only)
LOADS = "bytes"  # how a program reads its rows' FP8 values: "bytes", or "words" (4-byte loads; untimed on a GPU)
# How indexer_topk_fp8 selects: "keys" (int64 keys, torch.topk: the path timed in the decode stack), "radix" (fp32
# scores, ess.core.kernels.topk_select's radix select: the same sets, 4 instead of 8 bytes a position written) or "fused" (fp32
# scores and the first histogram of ess.core.kernels.topk_split's split radix select in one kernel, then its passes); the two
# last untimed on a GPU until benchmark/indexer_kernels.py runs there
SELECT = "keys"
SELECTS = ("keys", "radix", "fused")
QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOW_WORD = 0xFFFFFFFF
NEG_INF_KEY = -2139095041  # the high word of -inf's key: int32 of 0xFF800000 ^ 0x7FFFFFFF

if triton is not None:
    import triton.language as tl

    # Reductions through tl.reduce with the standard library's combine function: tl.sum is a jit function, which
    # Triton's interpreter cannot call unless TRITON_INTERPRET was set at import.
    _ADD = tl.standard._sum_combine

    def _scores_kernel(q_ptr, w_ptr, rows, loc, pos_ptr, out, hist, T, H, row_n, row_t, loc_n, loc_t,
                       D: tl.constexpr, SCALE_OFFSET: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                       PAGED: tl.constexpr, KEYS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                       WORDS: tl.constexpr, HIST: tl.constexpr, HIST_STRIDE: tl.constexpr, PAGE: tl.constexpr,
                       STARTS: tl.constexpr, SPAN: tl.constexpr):
        n = tl.program_id(1).to(tl.int64)
        p0 = tl.program_id(0) * (BLOCK_T * SPAN)  # the program's SPAN blocks of BLOCK_T positions
        last = tl.minimum(tl.load(pos_ptr + n).to(tl.int64), T - 1)  # the request's last scored position
        first = tl.load(loc + n).to(tl.int64) if STARTS else 0  # STARTS: loc holds each row's first position
        bins = tl.arange(0, 256)
        counts = tl.full([256], 0, tl.int32)  # HIST: pass 0's counts over the program's positions
        if (p0 <= last) & (p0 + BLOCK_T * SPAN > first):
            h = tl.arange(0, BLOCK_H)
            d = tl.arange(0, D)
            q = tl.load(q_ptr + (n * H + h)[:, None] * D + d[None, :], mask=(h < H)[:, None], other=0.0)
            if UPCAST:  # the interpreter's tl.dot multiplies bf16 as raw integers; in fp32 the products are the same
                q = q.to(tl.float32)
            w = tl.load(w_ptr + n * H + h, mask=h < H, other=0.0).to(tl.float32)
            for i in range(SPAN):  # the queries stay in registers across the program's blocks
                t = p0 + i * BLOCK_T + tl.arange(0, BLOCK_T)
                valid = (t <= last) & (t >= first)
                if PAGE > 0:  # SGLang's pages (row_t bytes: PAGE rows of D bytes, then PAGE scales); loc: page table
                    page = tl.load(loc + n * loc_n + (t // PAGE).to(tl.int64) * loc_t, mask=valid,
                                   other=-1).to(tl.int64)
                    valid = valid & (page >= 0)
                    base = page * row_t + (t % PAGE).to(tl.int64) * D
                    scale_at = page * row_t + PAGE * D + (t % PAGE).to(tl.int64) * 4
                elif PAGED:  # row locations from the request's map; -1: no row
                    r = tl.load(loc + n * loc_n + t.to(tl.int64) * loc_t, mask=valid, other=-1).to(tl.int64)
                    valid = valid & (r >= 0)
                    base = r * row_t
                    scale_at = base + SCALE_OFFSET
                else:
                    base = n * row_n + t.to(tl.int64) * row_t
                    scale_at = base + SCALE_OFFSET
                if WORDS:  # the 128 FP8 bytes as 32 aligned 4-byte words (a 132-byte row is 4-, not 16-byte aligned)
                    wi = tl.arange(0, D // 4)
                    kw = tl.load((rows + base).to(tl.pointer_type(tl.int32))[:, None] + wi[None, :],
                                 mask=valid[:, None], other=0)
                    shift = tl.arange(0, 4) * 8  # little-endian: byte j of word i is value 4 i + j
                    kb = tl.reshape(((kw[:, :, None] >> shift[None, None, :]) & 0xFF).to(tl.uint8), (BLOCK_T, D))
                else:
                    kb = tl.load(rows + base[:, None] + d[None, :], mask=valid[:, None], other=0)
                k = kb.to(tl.float8e4nv, bitcast=True).to(q.dtype)  # exact: every e4m3 value is a bf16 / fp16 value
                scale = tl.load((rows + scale_at).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_H, BLOCK_T], fp32 accumulation
                s = tl.maximum(s * scale[None, :], 0.0) * w[:, None]
                score = tl.where(valid, tl.reduce(s, 0, _ADD), float("-inf"))
                bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)  # -0.0 ties with +0.0
                mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int order = float order
                if KEYS:
                    low = tl.full([BLOCK_T], 4294967295, tl.int64) - t  # an int64 literal (a bare 2^32 - 1 is uint32)
                    tl.store(out + n * T + t, (mono.to(tl.int64) << 32) | low, mask=t < T)
                else:
                    tl.store(out + n * T + t, score, mask=t < T)
                if HIST:  # pass 0 of ess.core.kernels.topk_split: the finite scores' top 8 key bits
                    cand = score > float("-inf")  # positions beyond pos[n] and missing rows score -inf
                    digit = tl.where(cand, ((mono.to(tl.int64) + 2147483648) >> 24).to(tl.int32), 0)
                    outside = BLOCK_T - tl.reduce(cand.to(tl.int32), 0, _ADD)  # counted in bin 0: taken out again
                    counts += tl.histogram(digit, 256) - tl.where(bins == 0, outside, 0)
        else:  # every position of the program is outside the row's: nothing to read, -inf written
            for i in range(SPAN):
                t = p0 + i * BLOCK_T + tl.arange(0, BLOCK_T)
                if KEYS:
                    low = tl.full([BLOCK_T], 4294967295, tl.int64) - t
                    mono = tl.full([BLOCK_T], -2139095041, tl.int64)  # -inf's (NEG_INF_KEY)
                    tl.store(out + n * T + t, (mono << 32) | low, mask=t < T)
                else:
                    tl.store(out + n * T + t, tl.full([BLOCK_T], float("-inf"), tl.float32), mask=t < T)
        if HIST:
            tl.atomic_add(hist + n * HIST_STRIDE + bins, counts, mask=counts > 0)
else:  # compiled() refuses these without triton, naming the caller
    _scores_kernel = None


def _got(x) -> str:
    return f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _is_int(x) -> bool:
    return isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool


def _check_queries(q, w, pos) -> tuple[int, int]:
    """Refuse bad queries, head weights and positions naming the argument; returns (N, H)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[2] != layout.INDEX_DIM or q.dtype not in QUERY_DTYPES:
        raise ValueError(f"indexer: q must be [N, H, {layout.INDEX_DIM}] bf16, fp16 or fp32, got {_got(q)}")
    N, H, _ = q.shape
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (N, H) or not w.is_floating_point():
        raise ValueError(f"indexer: w must be a float [N, H] = [{N}, {H}] tensor (q's), got {_got(w)}")
    if not _is_int(pos) or tuple(pos.shape) != (N,):
        raise ValueError(f"indexer: pos must be an integer [N] = [{N}] tensor, got {_got(pos)}")
    return N, H


def _check_table(table, name: str, N: int, entries: int, what: str) -> None:
    """A [N, *] int32 / int64 map whose entries are -1 or below `entries` (checked on the CPU only: on a GPU it would
    sync the stream)."""
    if not _is_int(table) or table.dim() != 2 or table.shape[0] != N or table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indexer: {name} must be an int32 or int64 [N, {'T' if name == 'loc' else 'P'}] tensor "
                         f"with N = {N}, got {_got(table)}")
    if not table.is_cuda and table.numel() and not bool(((table >= -1) & (table < entries)).all()):
        raise ValueError(f"indexer: {name} entries must be -1 or {what} numbers below {entries}")


def _same_device(q, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"indexer: {name} is on {t.device}, q on {q.device}")


def _check(q, w, rows, pos, loc) -> tuple[int, int, int]:
    """Refuse bad inputs naming the argument; returns (N, H, T)."""
    N, H = _check_queries(q, w, pos)
    paged = loc is not None
    want = f"[S, {layout.INDEX_ROW_BYTES}]" if paged else f"[N, T, {layout.INDEX_ROW_BYTES}] with N = {N}"
    if (not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or rows.dim() != (2 if paged else 3)
            or rows.shape[-1] != layout.INDEX_ROW_BYTES or (not paged and rows.shape[0] != N)):
        raise ValueError(f"indexer: rows must be uint8 {want}, got {_got(rows)}")
    if rows.stride(-1) != 1 or any(s % 4 for s in rows.stride()[:-1]) or rows.data_ptr() % 4:
        raise ValueError(f"indexer: rows {tuple(rows.shape)} must have contiguous, 4-byte aligned 132-byte rows "
                         f"(the scale is read as a float32), got strides {rows.stride()}")
    if not paged:
        T = rows.shape[1]
    else:
        _check_table(loc, "loc", N, rows.shape[0], "row")  # out-of-range locations would read outside rows
        T = loc.shape[1]
    _same_device(q, w=w, rows=rows, pos=pos, loc=loc)
    return N, H, T


def _check_pages(q, w, pages, pos, page_table) -> tuple[int, int, int]:
    """indexer_scores_pages's inputs; returns (N, H, P)."""
    N, H = _check_queries(q, w, pos)
    page_bytes = layout.INDEX_PAGE_TOKENS * layout.INDEX_ROW_BYTES
    if (not isinstance(pages, torch.Tensor) or pages.dtype != torch.uint8 or pages.dim() != 2
            or pages.shape[1] != page_bytes or pages.stride(1) != 1 or pages.stride(0) % 4 or pages.data_ptr() % 4):
        raise ValueError(f"indexer: pages must be uint8 [S, {page_bytes}] with contiguous, 4-byte aligned pages "
                         f"(SGLang's index-K pages), got {_got(pages)}")
    _check_table(page_table, "page_table", N, pages.shape[0], "page")
    _same_device(q, w=w, pages=pages, pos=pos, page_table=page_table)
    return N, H, page_table.shape[1]


def _torch_scores(q, w, rows, pos, loc) -> torch.Tensor:
    """The reference math (dequantises the rows the request reads)."""
    if loc is not None:
        picked = rows[loc.clamp(min=0).long()]  # [N, T, 132]
    else:
        picked = rows
    scores = dsa_math.index_scores(q.float(), w.float(), picked)
    t = torch.arange(scores.shape[1], device=scores.device)
    keep = t <= pos.unsqueeze(1)
    if loc is not None:
        keep = keep & (loc >= 0)
    return torch.where(keep, scores, torch.full_like(scores, -math.inf))


def _launch(q, w, rows, pos, loc, N, H, T, interpret: bool, keys: bool, block_t: int = BLOCK_T,
            num_warps: int = NUM_WARPS, loads: str = LOADS, hist: torch.Tensor | None = None,
            page: int = 0, starts: torch.Tensor | None = None, span: int | None = None) -> torch.Tensor:
    """The kernel over [N, T] (block_t, num_warps, loads, span: the launch configuration, for benchmark/indexer_kernels.py; hist:
    topk_split.new_work's state, whose pass-0 histograms the kernel counts as it writes fp32 scores; page: tokens a
    page of SGLang's layout, rows then [pages, page * 132] and loc the page table; starts: each row's first scored
    position)."""
    if loads not in ("bytes", "words"):
        raise ValueError(f"indexer: loads must be 'bytes' or 'words', got {loads!r}")
    out = torch.empty(N, T, dtype=torch.int64 if keys else torch.float32, device=q.device)
    if N * T == 0:
        return out
    paged = loc is not None and not page
    loc_arg = starts if starts is not None else pos if loc is None else loc  # unread without a map or starts
    span = SPAN if span is None else span  # the module's, read at the call
    if isinstance(span, bool) or not isinstance(span, int) or span < 1:
        raise ValueError(f"indexer: span must be a positive int (blocks a program scores), got {span!r}")
    grid = (triton.cdiv(T, block_t * span), N)
    upcast = interpret and q.dtype == torch.bfloat16  # see the kernel
    compiled(_scores_kernel, interpret, "indexer")[grid](
        q.contiguous(), w.contiguous(), rows, loc_arg, pos.contiguous(), out, out if hist is None else hist, T, H,
        0 if loc is not None else rows.stride(0), rows.stride(-2), 0 if loc is None else loc.stride(0),
        0 if loc is None else loc.stride(1),
        D=layout.INDEX_DIM, SCALE_OFFSET=layout.INDEX_SCALE_OFFSET, BLOCK_T=block_t,
        BLOCK_H=max(16, 1 << (H - 1).bit_length()), PAGED=paged, KEYS=keys,
        UPCAST=upcast, PRECISION="ieee" if q.dtype == torch.float32 or upcast else None, WORDS=loads == "words",
        HIST=hist is not None, HIST_STRIDE=topk_split.WORK, PAGE=page, STARTS=starts is not None, SPAN=span,
        **({} if interpret else {"num_warps": num_warps}),
    )
    return out


def score_keys(scores: torch.Tensor) -> torch.Tensor:
    """The kernel's int64 keys of fp32 scores [N, T], in torch: unique per row, and ordered as select_topk ranks
    (larger score first, then lower position)."""
    s = torch.where(scores == 0, torch.zeros_like(scores), scores.float())  # -0.0 ties with +0.0
    bits = s.view(torch.int32)
    mono = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()
    t = torch.arange(scores.shape[1], device=scores.device, dtype=torch.int64)
    return (mono << 32) | (LOW_WORD - t)


def topk_from_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The best k positions [N, k] int32 of score keys [N, T], best first; -inf scores and padding give -1."""
    N, T = keys.shape
    top = torch.topk(keys, min(k, T), dim=1).values  # sorted, largest first; the keys are unique, so no ties
    idx = torch.where((top >> 32) > NEG_INF_KEY, LOW_WORD - (top & LOW_WORD), -1).to(torch.int32)
    if T < k:
        idx = torch.nn.functional.pad(idx, (0, k - T), value=-1)
    return idx


def indexer_scores_fp8(q: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                       loc: torch.Tensor | None = None, backend: str = "auto",
                       work: torch.Tensor | None = None) -> torch.Tensor:
    """Indexer scores fp32 [N, T] of queries q [N, H, 128] (bf16 / fp16 / fp32) with head weights w [N, H] over FP8
    index-K rows: rows [N, T, 132] uint8, or a row table rows [S, 132] with locations loc [N, T] (-1: no row).
    Positions beyond pos [N], and missing rows, score -inf. work: topk_split.new_work(N)'s state, into which the
    kernel also counts the split select's pass 0 (select="fused"; not with the torch backend)."""
    N, H, T = _check(q, w, rows, pos, loc)
    backend = kernel_backend(backend, rows.device, "indexer")
    if work is not None and (not isinstance(work, torch.Tensor) or work.dtype != torch.int32
                             or tuple(work.shape) != (N, topk_split.WORK) or work.device != q.device
                             or not work.is_contiguous() or backend == "torch"):
        raise ValueError(f"indexer: work must be topk_split.new_work({N}) on {q.device}, with the triton or interpret "
                         f"backend, got {_got(work)} with {backend}")
    if backend == "torch":
        return _torch_scores(q, w, rows, pos, loc)
    return _launch(q, w, rows, pos, loc, N, H, T, backend == "interpret", keys=False, hist=work)


def indexer_scores_pages(q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor, pos: torch.Tensor,
                         page_table: torch.Tensor, width: int | None = None, backend: str = "auto") -> torch.Tensor:
    """indexer_scores_fp8 over SGLang's own index-K pages, read in place: pages [S, 64 * 132] uint8 (a page: 64 rows
    of 128 FP8 bytes, then their 64 float32 scales; layout.index_k_rows_to_pages), page_table [N, P] (-1: no page).
    fp32 [N, width] (default P * 64); positions beyond pos [N], beyond the table, or in a missing page score -inf."""
    N, H, P = _check_pages(q, w, pages, pos, page_table)
    width = P * layout.INDEX_PAGE_TOKENS if width is None else width
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"indexer: width must be a non-negative int, got {width!r}")
    pos = pos.clamp(max=P * layout.INDEX_PAGE_TOKENS - 1)  # the table's reach (a device op: no sync)
    backend = kernel_backend(backend, pages.device, "indexer")
    if backend == "torch":  # the pages as rows, and each position's row
        if P == 0 or pages.shape[0] == 0:  # no page to read
            return torch.full((N, width), -math.inf, device=q.device)
        t = torch.arange(width, device=q.device)
        page = page_table.long().gather(1, (t // layout.INDEX_PAGE_TOKENS).clamp(max=P - 1).expand(N, -1))
        loc = torch.where(page >= 0, page * layout.INDEX_PAGE_TOKENS + t % layout.INDEX_PAGE_TOKENS, -1)
        return _torch_scores(q, w, layout.index_k_pages_to_rows(pages), pos, loc)
    return _launch(q, w, pages, pos, page_table, N, H, width, backend == "interpret", keys=False,
                   page=layout.INDEX_PAGE_TOKENS)


def indexer_scores_ragged(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, starts: torch.Tensor,
                          ends: torch.Tensor, width: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Prefill's ragged scores: query row m over the rows keys[starts[m]:ends[m]] of one table keys [S, 132] (the
    batch's gathered index-K), fp32 [M, width] (default S) by absolute row; -inf outside each row's window."""
    if not _is_int(starts) or not _is_int(ends) or starts.dim() != 1 or tuple(ends.shape) != tuple(starts.shape):
        raise ValueError(f"indexer: starts and ends must be integer [M] tensors, got {_got(starts)} and {_got(ends)}")
    if not isinstance(keys, torch.Tensor) or keys.dim() != 2:
        raise ValueError(f"indexer: keys must be uint8 [S, {layout.INDEX_ROW_BYTES}], got {_got(keys)}")
    width = keys.shape[0] if width is None else width
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"indexer: width must be a non-negative int, got {width!r}")
    rows = keys.unsqueeze(0).expand(starts.shape[0], -1, -1)  # every query row reads the one table in place
    pos = ends.clamp(max=min(width, keys.shape[0])) - 1
    N, H, T = _check(q, w, rows, pos, None)
    _same_device(q, starts=starts)
    backend = kernel_backend(backend, keys.device, "indexer")
    if backend == "torch":
        scores = _torch_scores(q, w, rows, pos, None)
        scores = scores.masked_fill(torch.arange(T, device=q.device) < starts[:, None], -math.inf)
        return torch.nn.functional.pad(scores, (0, width - T), value=-math.inf) if width > T else scores[:, :width]
    return _launch(q, w, rows, pos, None, N, H, width, backend == "interpret", keys=False, starts=starts)


def indexer_topk_fp8(q: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, k: int,
                     loc: torch.Tensor | None = None, backend: str = "auto",
                     select: str | None = None) -> torch.Tensor:
    """The indexer's top-k: int32 [N, k] positions, best first, ties to the lower position, -1 padded; equal to
    select_topk(indexer_scores_fp8(...), pos, k). Arguments as indexer_scores_fp8; select: one of SELECTS (how the
    kernels pick the k, module docstring; the same sets either way), None: the module's SELECT at the call."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"indexer: k must be a positive int, got {k!r}")
    select = SELECT if select is None else select
    if select not in SELECTS:
        raise ValueError(f"indexer: select must be one of {SELECTS}, got {select!r}")
    N, H, T = _check(q, w, rows, pos, loc)
    backend = kernel_backend(backend, rows.device, "indexer")
    if backend == "torch":
        return dsa_math.select_topk(_torch_scores(q, w, rows, pos, loc), pos, k)
    interpret = backend == "interpret"
    if select == "radix":
        scores = _launch(q, w, rows, pos, loc, N, H, T, interpret, keys=False)
        return topk_select.radix_topk(scores, pos, k, backend=backend)
    if select == "fused":  # the scores kernel counts the split select's pass 0
        work = topk_split.new_work(N, q.device)
        scores = _launch(q, w, rows, pos, loc, N, H, T, interpret, keys=False, hist=work)
        keys = topk_split.split_keys(scores, pos, k, interpret, work, pass0_counted=True)
        return topk_select.positions_from_keys(keys)
    return topk_from_keys(_launch(q, w, rows, pos, loc, N, H, T, interpret, keys=True), k)


def indexer_keys_fp8(q: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                     loc: torch.Tensor | None = None, backend: str = "auto", block_t: int = BLOCK_T,
                     num_warps: int = NUM_WARPS, loads: str = LOADS, span: int | None = None) -> torch.Tensor:
    """The kernel's int64 score keys [N, T] (score_keys of indexer_scores_fp8's scores), under a given launch
    configuration: what indexer_topk_fp8 hands topk_from_keys (benchmark/indexer_kernels.py times the two apart)."""
    N, H, T = _check(q, w, rows, pos, loc)
    backend = kernel_backend(backend, rows.device, "indexer")
    if backend == "torch":
        return score_keys(_torch_scores(q, w, rows, pos, loc))
    return _launch(q, w, rows, pos, loc, N, H, T, backend == "interpret", keys=True, block_t=block_t,
                   num_warps=num_warps, loads=loads, span=span)
