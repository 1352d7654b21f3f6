"""Residency first's step glue (docs/design.md, "Residency first"): resident requests' entries map to their regions'
rows (row = start + position), offloaded requests' LRU slots (req * C + j) to theirs (row = start + j). In torch that
is some sixty small kernels per layer on the general path (a CUDA graph's one path): on a GPU it is two Triton
kernels, `premask` before the LRU step and `map_result` after it. "torch" is the reference, "interpret" the kernels
in Triton's CPU interpreter; the two are equal (integers only)."""

import torch

from ess.core.kernels.flashtrans import compiled, triton
from ess.core.policy import PolicyResult

if triton is not None:
    import triton.language as tl

BACKENDS = ("auto", "triton", "interpret", "torch")
BLOCK = 1024  # entries of one row per program


def _backend(backend: str, device: torch.device) -> str:
    """FlashTrans' backend names (the serving cache passes its own): the kernels on a GPU, torch on a CPU unless
    "interpret" is asked for."""
    if backend not in BACKENDS:
        raise ValueError(f"region map: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "interpret":
        return "triton" if device.type == "cuda" else "interpret"
    if backend == "torch" or device.type != "cuda" or triton is None:
        return "torch"
    return "triton"


def _own_shape(own_pos: torch.Tensor) -> int:
    return 1 if own_pos.dim() == 1 else own_pos.shape[1]


# -- before the LRU step: resident requests' entries and own tokens masked out (-1), so their rows take no step --------
def premask(req: torch.Tensor, topk: torch.Tensor, own_pos: torch.Tensor, is_resident: torch.Tensor,
            backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """topk [B, KK] and own_pos [B] or [B, M] with the rows of resident request slots set to -1 (is_resident [R]
    bool, req [B] slots)."""
    be = _backend(backend, topk.device)
    if be == "torch":
        res = is_resident[req.long()]
        res_own = res.view(-1, *[1] * (own_pos.dim() - 1))
        return torch.where(res.unsqueeze(1), -1, topk), torch.where(res_own, -1, own_pos)
    B, KK = topk.shape
    M = _own_shape(own_pos)
    out_topk, out_own = torch.empty_like(topk), torch.empty_like(own_pos)
    if B:
        compiled(_premask_kernel, be == "interpret", "region map")[(B, triton.cdiv(KK, BLOCK))](
            req.contiguous(), topk.contiguous(), own_pos.contiguous(), is_resident.view(torch.uint8), out_topk, out_own,
            KK, M, BLOCK=BLOCK, MBLOCK=triton.next_power_of_2(M))
    return out_topk, out_own


# -- after it: every entry and own token to its region's row ----------------------------------------------------------
def map_result(r: PolicyResult | None, req: torch.Tensor, topk: torch.Tensor, own_pos: torch.Tensor,
               start32: torch.Tensor, is_resident: torch.Tensor | None, capacity: int, none: torch.Tensor,
               zero: torch.Tensor, backend: str = "auto") -> PolicyResult:
    """The step's result in the regions' rows. r: the LRU step over premask's sets (its slots req * C + j), or None
    when every request of the batch is resident (is_resident is then not read). Resident rows: every entry a hit at
    start + position, own slot start + position, nothing missed, no set; offloaded rows: r's slots moved into their
    regions (start + j), the rest of r as it is. none / zero: constant [B, KK] -1 and [B] 0 int32 outputs (never written
    by their readers)."""
    be = _backend(backend, topk.device)
    if be == "torch":
        return _map_torch(r, req, topk, own_pos, start32, is_resident, capacity, none, zero)
    B, KK = topk.shape
    M = _own_shape(own_pos)
    dev = topk.device
    attn = torch.empty(B, KK, dtype=torch.int32, device=dev)
    hit = torch.empty(B, KK, dtype=torch.bool, device=dev)
    own = torch.empty(own_pos.shape, dtype=torch.int32, device=dev)
    has_lru = r is not None
    miss = torch.empty(B, KK, dtype=torch.int32, device=dev) if has_lru else none
    n_set = torch.empty(B, dtype=torch.int32, device=dev) if has_lru else zero
    if B:
        lru = (r.attn_slot, r.hit.view(torch.uint8), r.miss_slot, r.own_slot.contiguous(), r.n_set, is_resident.view(torch.uint8)) \
            if has_lru else (attn,) * 6  # unread
        compiled(_map_kernel, be == "interpret", "region map")[(B, triton.cdiv(KK, BLOCK))](
            req.contiguous(), topk.contiguous(), own_pos.contiguous(), start32, *lru, attn, hit.view(torch.uint8), miss,
            own, n_set, capacity, KK, M, HAS_LRU=has_lru, BLOCK=BLOCK, MBLOCK=triton.next_power_of_2(M))
    if not has_lru:
        return PolicyResult(attn_slot=attn, hit=hit, miss_pos=none, miss_slot=none, own_slot=own, n_miss=zero, n_set=zero)
    return PolicyResult(attn_slot=attn, hit=hit, miss_pos=r.miss_pos, miss_slot=miss, own_slot=own, n_miss=r.n_miss,
                        n_set=n_set, miss_row=r.miss_row)


if triton is not None:  # the kernels (the torch path needs no Triton)

    def _premask_kernel(req, topk, own, is_res, out_topk, out_own, KK, M, BLOCK: tl.constexpr, MBLOCK: tl.constexpr):
        b = tl.program_id(0)
        blk = tl.program_id(1)
        res = tl.load(is_res + tl.load(req + b).to(tl.int64)) != 0
        k = blk * BLOCK + tl.arange(0, BLOCK)
        kin = k < KK
        t = tl.load(topk + b * KK + k, mask=kin)
        tl.store(out_topk + b * KK + k, tl.where(res, -1, t).to(t.dtype), mask=kin)
        if blk == 0:
            m = tl.arange(0, MBLOCK)
            o = tl.load(own + b * M + m, mask=m < M)
            tl.store(out_own + b * M + m, tl.where(res, -1, o).to(o.dtype), mask=m < M)

    def _map_kernel(req, topk, own, start, lru_attn, lru_hit, lru_miss, lru_own, lru_nset, is_res, out_attn, out_hit,
                    out_miss, out_own, out_nset, C, KK, M, HAS_LRU: tl.constexpr, BLOCK: tl.constexpr,
                    MBLOCK: tl.constexpr):
        b = tl.program_id(0)
        blk = tl.program_id(1)
        r = tl.load(req + b).to(tl.int64)
        s = tl.load(start + r)  # int32: the region's first row
        k = blk * BLOCK + tl.arange(0, BLOCK)
        kin = k < KK
        t = tl.load(topk + b * KK + k, mask=kin, other=-1).to(tl.int32)
        m = tl.arange(0, MBLOCK)
        o = tl.load(own + b * M + m, mask=m < M, other=-1).to(tl.int32)
        mine_attn = tl.where(t >= 0, s + t, -1)
        mine_own = tl.where(o >= 0, s + o, -1)
        if HAS_LRU:
            res = tl.load(is_res + r) != 0
            shift = s - (r * C).to(tl.int32)  # slot req * C + j -> row start + j
            v = tl.load(lru_attn + b * KK + k, mask=kin, other=-1)
            h = tl.load(lru_hit + b * KK + k, mask=kin, other=0)
            ms = tl.load(lru_miss + b * KK + k, mask=kin, other=-1)
            tl.store(out_attn + b * KK + k, tl.where(res, mine_attn, tl.where(v >= 0, v + shift, -1)), mask=kin)
            tl.store(out_hit + b * KK + k, tl.where(res, (t >= 0).to(tl.uint8), h), mask=kin)
            tl.store(out_miss + b * KK + k, tl.where(ms >= 0, ms + shift, -1), mask=kin)
            if blk == 0:
                vo = tl.load(lru_own + b * M + m, mask=m < M, other=-1)
                tl.store(out_own + b * M + m, tl.where(res, mine_own, tl.where(vo >= 0, vo + shift, -1)), mask=m < M)
                tl.store(out_nset + b, tl.where(res, 0, tl.load(lru_nset + b)))
        else:
            tl.store(out_attn + b * KK + k, mine_attn, mask=kin)
            tl.store(out_hit + b * KK + k, (t >= 0).to(tl.uint8), mask=kin)
            if blk == 0:
                tl.store(out_own + b * M + m, mine_own, mask=m < M)


def _map_torch(r, req, topk, own_pos, start32, is_resident, capacity, none, zero) -> PolicyResult:
    start = start32[req.long()]
    entry = topk >= 0
    attn = torch.where(entry, start.unsqueeze(1) + topk.to(torch.int32), -1)
    own = start.view(-1, *[1] * (own_pos.dim() - 1)) + own_pos.to(torch.int32)
    own_slot = torch.where(own_pos >= 0, own, -1)
    if r is None:
        return PolicyResult(attn_slot=attn, hit=entry, miss_pos=none, miss_slot=none, own_slot=own_slot, n_miss=zero,
                            n_set=zero)
    res = is_resident[req.long()]
    res_own = res.view(-1, *[1] * (own_pos.dim() - 1))
    return PolicyResult(
        attn_slot=torch.where(res.unsqueeze(1), attn, physical(r.attn_slot, req, start32, capacity)),
        hit=torch.where(res.unsqueeze(1), entry, r.hit), miss_pos=r.miss_pos,
        miss_slot=physical(r.miss_slot, req, start32, capacity),
        own_slot=torch.where(res_own, own_slot, physical(r.own_slot, req, start32, capacity)), n_miss=r.n_miss,
        n_set=torch.where(res, zero, r.n_set), miss_row=r.miss_row)


def physical(virt: torch.Tensor, req: torch.Tensor, start32: torch.Tensor, capacity: int) -> torch.Tensor:
    """The LRU policy's slot numbers [B, ...] (req * C + j; -1 none) -> rows of the regions' pool (start + j), int32."""
    shift = start32[req.long()] - (req.long() * capacity).to(torch.int32)
    return torch.where(virt >= 0, virt + shift.view(-1, *[1] * (virt.dim() - 1)), -1).to(torch.int32)
