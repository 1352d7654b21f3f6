"""The LRU step of ess.core.policy.lru_update as one Triton kernel: one program per batch row, the same tables and outputs
(byte for byte, sink columns aside), plus each miss's host row read from the engine's token table.

A program works in four phases, with a block barrier between them (the phases exchange values through the tables):
1. Entries: each top-k entry reads its position's slot. Resident entries claim their slot, and misses their
   position, with an atomic minimum of (INT32_MIN + entry index): the first entry of a position wins, which removes
   duplicates without a sort. A claimed slot holds a value below -1, which marks it protected; a resident own token's
   slot is marked the same way.
2. Misses: the winners among the misses, compacted in entry order (a cumulative sum), give the miss list.
3. Victims: E empty slots; if the misses and the own tokens needing a slot (V) exceed E, the V - E oldest unprotected
   slots by (age descending, position ascending) are found by bisection on a 64-bit key (or, with
   SELECT = "histogram", by histograms narrowing the key range 11 bits a pass); the victims, in slot order, take the
   misses, then the own tokens. Evicted positions leave the position table.
4. Writes: misses into the position table, claimed slots restored with their stamps, then every entry's slot read back.
Loads of table words another thread may have written in this launch bypass L1 (".cg"): atomics act in L2, and L1 is
not coherent within a launch.

The kernel needs Triton (the GPU, or its CPU interpreter from Triton 3.8 on: how CI checks it against the torch path).
"""

from __future__ import annotations

import torch

from ess.core.kernels.flashtrans import compiled, triton
from ess.core.policy import STAMP_MOD, PolicyResult, check_capacity, check_step_tables

REGISTER_SLOTS = 8192  # up to this many slots a program keeps the victim keys in registers; beyond, it re-reads them
NUM_WARPS = 16  # per program (one batch row): within 5% of 8 on an H100, with half the registers (docs/gpu.md)
MAX_REGISTERS = None  # per thread (Triton's maxnreg; None: the compiler's choice); fewer fit more programs per SM
LAST_LAUNCH = None  # the last launch's compiled kernel (registers, spills: benchmark/bookkeeping.py --phases)
SELECT = "bisect"  # the victim search: "bisect" (measured, docs/gpu.md) or "histogram" (not yet timed on a GPU)
HIST_BINS = 2048  # with SELECT = "histogram": bins per pass

if triton is not None:
    import triton.language as tl

    # Reductions through tl.reduce / tl.associative_scan with the standard library's combine functions: tl.sum and
    # friends are jit functions, which Triton's interpreter cannot call unless TRITON_INTERPRET was set at import.
    _ADD, _MIN, _MAX = tl.standard._sum_combine, tl.standard._elementwise_min, tl.standard._elementwise_max

    def _victim_keys(sp_row, st_row, j, C, t, P, STAMP_MOD: tl.constexpr):
        """(The kernel's helper, handed to it as a constexpr: one function for the GPU and the interpreter.)
        Slots j: their position (-1 empty, < -1 protected), and their eviction key (smaller: evicted first)."""
        valid = j < C
        p = tl.load(sp_row + j, mask=valid, other=-2, cache_modifier=".cg").to(tl.int64)
        st = tl.load(st_row + j, mask=valid, other=0, cache_modifier=".cg").to(tl.int64)
        age = ((t - st) % STAMP_MOD + STAMP_MOD) % STAMP_MOD
        key = (STAMP_MOD - 1 - age) * P + p
        return p, key

    @triton.jit
    def _tick(prof, b, i: tl.constexpr):
        """The GPU's global timer (ns) at a phase boundary, for profiling the kernel (PROFILE, GPU only)."""
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(prof + b * 8 + i, t)

    def _lru_step_kernel(
        slot_pos, slot_stamp, pos_slot, req_ptr, sets, own_ptr, stamp_ptr, token_table, tt_stride,
        attn_out, hit_out, miss_pos_out, miss_slot_out, miss_row_out, own_out, n_miss_out, n_set_out,
        K, C, P,
        M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, IN_REGISTERS: tl.constexpr,
        STAMP_MOD: tl.constexpr, WITH_ROWS: tl.constexpr, KEYS: tl.constexpr, prof, PROFILE: tl.constexpr,
        HIST_BINS: tl.constexpr,
    ):
        CLAIM: tl.constexpr = -2147483648
        b = tl.program_id(0)
        if PROFILE:
            _tick(prof, b, 0)
        r = tl.load(req_ptr + b).to(tl.int64)
        t = tl.load(stamp_ptr).to(tl.int64)
        t = (t % STAMP_MOD + STAMP_MOD) % STAMP_MOD
        sp_row = slot_pos + r * (C + 1)
        st_row = slot_stamp + r * (C + 1)
        ps_row = pos_slot + r * (P + 1)
        base = r * C
        out_row = b.to(tl.int64) * K

        # -- 1. entries ----------------------------------------------------------------------------------------------
        k = tl.arange(0, BLOCK_K)
        s = tl.load(sets + out_row + k, mask=k < K, other=-1).to(tl.int64)
        entry = s >= 0
        is_own = k < 0
        for m in tl.static_range(M):
            o = tl.load(own_ptr + b * M + m).to(tl.int64)
            is_own = is_own | (entry & (s == o))
        pre = tl.load(ps_row + s, mask=entry, other=-1)
        in_s = entry & ~is_own
        res = in_s & (pre >= 0)
        miss = in_s & (pre < 0)
        tl.atomic_min(sp_row + pre, CLAIM + k, mask=res, sem="relaxed", scope="cta")
        tl.atomic_min(ps_row + s, CLAIM + k, mask=miss, sem="relaxed", scope="cta")
        for m in tl.static_range(M):  # a resident own token (a replayed step) is protected too
            o = tl.load(own_ptr + b * M + m).to(tl.int64)
            o_pre = tl.load(ps_row + tl.maximum(o, 0), mask=o >= 0, other=-1)
            tl.atomic_min(sp_row + o_pre, CLAIM + BLOCK_K + m, mask=(o >= 0) & (o_pre >= 0), sem="relaxed", scope="cta")
        tl.debug_barrier()
        if PROFILE:
            _tick(prof, b, 1)

        # -- 2. misses, compacted in entry order -------------------------------------------------------------------
        hit_win = res & (tl.load(sp_row + pre, mask=res, other=0, cache_modifier=".cg") == CLAIM + k)
        miss_win = miss & (tl.load(ps_row + s, mask=miss, other=0, cache_modifier=".cg") == CLAIM + k)
        n_miss = tl.reduce(miss_win.to(tl.int32), 0, _ADD)
        rank = tl.associative_scan(miss_win.to(tl.int32), 0, _ADD) - 1
        tl.store(miss_pos_out + out_row + rank, s.to(tl.int32), mask=miss_win)
        tail = (k >= n_miss) & (k < K)
        tl.store(miss_pos_out + out_row + k, -1, mask=tail)
        tl.store(miss_slot_out + out_row + k, -1, mask=tail)
        tl.store(miss_row_out + out_row + k, -1, mask=tail)
        # Each own token's state before the victims, kept in its output word until phase 4: -1 none, -2 needs a slot.
        n_need = n_miss * 0
        for m in tl.static_range(M):
            o = tl.load(own_ptr + b * M + m).to(tl.int64)
            o_pre = tl.load(ps_row + tl.maximum(o, 0), mask=o >= 0, other=-1, cache_modifier=".cg")
            needs = (o >= 0) & (o_pre == -1)
            tl.store(own_out + b * M + m, tl.where(needs, -2, -1))
            n_need += needs.to(tl.int32)
        V = n_miss + n_need
        tl.debug_barrier()
        if PROFILE:
            _tick(prof, b, 2)

        # -- 3. victims ------------------------------------------------------------------------------------------------
        jj = tl.arange(0, BLOCK_C)
        E = n_miss * 0
        lo = tl.full((), 9223372036854775807, tl.int64)
        hi = tl.full((), -1, tl.int64)
        if IN_REGISTERS:  # only the keys stay in registers (the maximum where a slot is no candidate)
            p_all, key_all = KEYS(sp_row, st_row, jj, C, t, P, STAMP_MOD)
            E = tl.reduce((p_all == -1).to(tl.int32), 0, _ADD)
            key_all = tl.where(p_all >= 0, key_all, lo)
            hi = tl.reduce(tl.where(p_all >= 0, key_all, hi), 0, _MAX)
            lo = tl.reduce(key_all, 0, _MIN)
        else:
            for c0 in range(0, C, BLOCK_C):
                p, key = KEYS(sp_row, st_row, c0 + jj, C, t, P, STAMP_MOD)
                E += tl.reduce((p == -1).to(tl.int32), 0, _ADD)
                lo = tl.minimum(lo, tl.reduce(tl.where(p >= 0, key, lo), 0, _MIN))
                hi = tl.maximum(hi, tl.reduce(tl.where(p >= 0, key, hi), 0, _MAX))
        need = V - E
        if HIST_BINS > 0:
            # The need-th smallest key among unprotected residents by histograms over the key range (relative to the
            # smallest), HIST_BINS - 1 bins a pass (the last collects keys outside): log2(range) / 11 passes, not ~21.
            one = tl.full((), 1, tl.int64)
            bins = tl.arange(0, HIST_BINS)
            lo_r = one * 0
            hi_r = tl.where(need > 0, hi - lo, 0)
            want = need.to(tl.int64)
            while hi_r > lo_r:
                d = hi_r - lo_r
                shift = one * 0
                while (d >> shift) >= HIST_BINS - 1:
                    shift += 1
                if IN_REGISTERS:
                    rel = key_all - lo - lo_r  # key_all holds INT64_MAX where no candidate: outside
                    h = tl.histogram(tl.where((rel >= 0) & (rel <= d), rel >> shift, HIST_BINS - 1).to(tl.int32), HIST_BINS)
                else:
                    h = tl.full([HIST_BINS], 0, tl.int32)
                    for c0 in range(0, C, BLOCK_C):
                        p, key = KEYS(sp_row, st_row, c0 + jj, C, t, P, STAMP_MOD)
                        rel = key - lo - lo_r
                        inside = (p >= 0) & (rel >= 0) & (rel <= d)
                        h += tl.histogram(tl.where(inside, rel >> shift, HIST_BINS - 1).to(tl.int32), HIST_BINS)
                h = tl.where(bins < HIST_BINS - 1, h, 0)
                sel = tl.reduce((tl.associative_scan(h, 0, _ADD) < want).to(tl.int32), 0, _ADD)  # the bin of the want-th
                want -= tl.reduce(tl.where(bins < sel, h, 0), 0, _ADD)
                lo_r += sel.to(tl.int64) << shift
                hi_r = tl.minimum(hi_r, lo_r + (one << shift) - 1)
            thr = tl.where(need > 0, lo + lo_r, -1)
        else:
            # Bisection for the need-th smallest key among unprotected residents: count(key <= hi) >= need > count(<= lo).
            lo = tl.where(need > 0, lo - 1, hi)
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                if IN_REGISTERS:
                    cnt = tl.reduce((key_all <= mid).to(tl.int32), 0, _ADD)
                else:
                    cnt = n_miss * 0
                    for c0 in range(0, C, BLOCK_C):
                        p, key = KEYS(sp_row, st_row, c0 + jj, C, t, P, STAMP_MOD)
                        cnt += tl.reduce(((p >= 0) & (key <= mid)).to(tl.int32), 0, _ADD)
                hi = tl.where(cnt >= need, mid, hi)
                lo = tl.where(cnt >= need, lo, mid)
            thr = tl.where(need > 0, hi, -1)
        if PROFILE:
            _tick(prof, b, 3)
        taken = n_miss * 0
        empties = n_miss * 0
        for c0 in range(0, C, BLOCK_C):
            j = c0 + jj
            p, key = KEYS(sp_row, st_row, j, C, t, P, STAMP_MOD)
            # Victims: the first V empty slots, and the residents at or below the threshold (none when V <= E). One
            # scan counts both (empties in the low 16 bits, residents above: a chunk has at most 8192 slots).
            empty = p == -1
            old = (p >= 0) & (key <= thr)
            both = tl.associative_scan(empty.to(tl.int32) + (old.to(tl.int32) << 16), 0, _ADD)
            victim = (empty & (empties + (both & 0xFFFF) - 1 < V)) | old
            v_rank = taken + (both & 0xFFFF) + (both >> 16) - 1
            total = tl.reduce(empty.to(tl.int32) + (old.to(tl.int32) << 16), 0, _ADD)
            taken += tl.minimum(total & 0xFFFF, tl.maximum(V - empties, 0)) + (total >> 16)
            empties += total & 0xFFFF
            tl.store(ps_row + p, -1, mask=victim & (p >= 0))  # evicted: neither in S nor own
            to_miss = victim & (v_rank < n_miss)
            new = tl.load(miss_pos_out + out_row + v_rank, mask=to_miss, other=-1, cache_modifier=".cg").to(tl.int64)
            tl.store(miss_slot_out + out_row + v_rank, (base + j).to(tl.int32), mask=to_miss)
            to_own = victim & (v_rank >= n_miss)  # the victims past the misses go to the own tokens needing a slot
            need_rank = n_miss * 0
            for m in tl.static_range(M):
                needs = tl.load(own_out + b * M + m, cache_modifier=".cg") == -2
                o = tl.load(own_ptr + b * M + m).to(tl.int64)
                new = tl.where(to_own & needs & (v_rank == n_miss + need_rank), o, new)
                need_rank += needs.to(tl.int32)
            tl.store(ps_row + new, j.to(tl.int32), mask=to_own)
            tl.store(sp_row + j, new.to(tl.int32), mask=victim)
            tl.store(st_row + j, t.to(tl.int32), mask=victim)
        tl.debug_barrier()
        if PROFILE:
            _tick(prof, b, 4)

        # -- 4. writes -----------------------------------------------------------------------------------------------
        slot = tl.load(miss_slot_out + out_row + rank, mask=miss_win, other=0, cache_modifier=".cg")
        tl.store(ps_row + s, (slot - base).to(tl.int32), mask=miss_win)
        if WITH_ROWS:
            row = tl.load(token_table + r * tt_stride + s, mask=miss_win, other=-1)
        else:
            row = s * 0 - 1
        tl.store(miss_row_out + out_row + rank, row.to(tl.int32), mask=miss_win)
        tl.store(sp_row + pre, s.to(tl.int32), mask=hit_win)
        tl.store(st_row + pre, t.to(tl.int32), mask=hit_win)
        for m in tl.static_range(M):
            o = tl.load(own_ptr + b * M + m).to(tl.int64)
            o_pre = tl.load(ps_row + tl.maximum(o, 0), mask=o >= 0, other=-1, cache_modifier=".cg")
            tl.store(sp_row + o_pre, o.to(tl.int32), mask=(o >= 0) & (o_pre >= 0))
            tl.store(st_row + o_pre, t.to(tl.int32), mask=(o >= 0) & (o_pre >= 0))
        n_set = n_miss + tl.reduce(hit_win.to(tl.int32), 0, _ADD)
        tl.debug_barrier()
        if PROFILE:
            _tick(prof, b, 5)
        post = tl.load(ps_row + s, mask=entry, other=0, cache_modifier=".cg").to(tl.int64)
        tl.store(attn_out + out_row + k, tl.where(entry, base + post, -1).to(tl.int32), mask=k < K)
        tl.store(hit_out + out_row + k, entry & ((pre >= 0) | is_own), mask=k < K)
        for m in tl.static_range(M):
            o = tl.load(own_ptr + b * M + m).to(tl.int64)
            o_slot = tl.load(ps_row + tl.maximum(o, 0), mask=o >= 0, other=-1, cache_modifier=".cg").to(tl.int64)
            tl.store(own_out + b * M + m, tl.where(o >= 0, base + o_slot, -1).to(tl.int32))
        tl.store(n_miss_out + b, n_miss)
        tl.store(n_set_out + b, n_set)
        if PROFILE:
            _tick(prof, b, 6)
else:  # compiled() refuses these without triton, naming the caller
    _lru_step_kernel = None
    _victim_keys = None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def lru_update_fused(
    slot_pos: torch.Tensor,
    slot_stamp: torch.Tensor,
    pos_slot: torch.Tensor,
    req: torch.Tensor,
    sets: torch.Tensor,
    own_pos: torch.Tensor,
    stamp: torch.Tensor | int,
    token_table: torch.Tensor | None = None,
    num_warps: int | None = None,
    profile: torch.Tensor | None = None,
) -> PolicyResult:
    """ess.core.policy.lru_update's step as one kernel (same arguments and results; the tables must be int32 and
    contiguous). token_table [requests, positions] (SGLang's req_to_token): each miss's host row goes to
    result.miss_row. On a CPU tensor the kernel runs in Triton's interpreter. profile [B, 8] int64 (GPU only): each
    program's global timer at its phase boundaries (benchmark/bookkeeping.py --phases)."""
    B, K = sets.shape
    one_own = own_pos.dim() == 1
    own = own_pos.reshape(B, -1).contiguous()
    M = own.shape[1]
    C = slot_pos.shape[1] - 1
    P = pos_slot.shape[1] - 1
    check_capacity(C, K, M)
    check_step_tables("fused LRU step", slot_pos, slot_stamp, pos_slot, token_table)
    dev = sets.device
    if not isinstance(stamp, torch.Tensor):
        stamp = torch.tensor(stamp, dtype=torch.int64, device=dev)
    with_rows = token_table is not None
    if not with_rows:
        token_table, tt_stride = torch.full((1, 1), -1, dtype=torch.int32, device=dev), 0
    else:
        tt_stride = token_table.stride(0)
    out = PolicyResult.empty(B, K, M, dev)
    if B == 0:
        return out
    block_c = min(_pow2(C), REGISTER_SLOTS)
    kernel, keys = (compiled(fn, dev.type != "cuda", "the fused LRU step") for fn in (_lru_step_kernel, _victim_keys))
    global LAST_LAUNCH
    LAST_LAUNCH = kernel[(B,)](
        slot_pos, slot_stamp, pos_slot, req.contiguous(), sets.contiguous(), own, stamp, token_table, tt_stride,
        out.attn_slot, out.hit, out.miss_pos, out.miss_slot, out.miss_row, out.own_slot, out.n_miss, out.n_set,
        K, C, P,
        M=M, BLOCK_K=_pow2(K), BLOCK_C=block_c, IN_REGISTERS=C <= block_c, STAMP_MOD=STAMP_MOD, WITH_ROWS=with_rows, KEYS=keys, prof=profile if profile is not None else out.n_miss, PROFILE=profile is not None,
        HIST_BINS=HIST_BINS if SELECT == "histogram" else 0,
        num_warps=num_warps or NUM_WARPS, **({"maxnreg": MAX_REGISTERS} if MAX_REGISTERS and dev.type == "cuda" else {}),
    )
    if one_own:
        out.own_slot = out.own_slot.squeeze(1)
    if not with_rows:
        out.miss_row = None  # no token table, no host rows: the caller translates miss_pos itself
    return out
