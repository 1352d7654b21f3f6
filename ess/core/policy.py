"""The ESS cache policy: exact LRU per (request, layer), vectorised on the device.

Semantics (docs/design.md, "Cache policy"): at a step with stamp t, S = the step's top-k positions without the step's
own position p, -1 ignored, duplicates once. misses = S minus the positions resident before the step. Room for the
misses and for p is made by evicting resident positions not in S, in the order (stamp ascending, position ascending),
after empty slots. Then every member of S, and p, gets stamp t. Warm-up windows are the same update with no own
position and stamps w - W.

Which slot takes which row is ESS's choice (the policy compares stamps and positions only), fixed so that a fused
kernel can produce it without sorting: the victims, taken in slot order, go first to the misses in the order of their
first top-k entry, then to the own token(s) needing a slot. The miss lists come out compacted that way.

`lru_update` runs with fixed shapes and no host synchronisation: batch rows without a set are -1 throughout, and
every write that a row does not need lands in the sink column of the tables (scratch: its contents are undefined).
It is the reference and the CPU path; ess.core.kernels.lru_step is the same step as one Triton kernel.

Stamps are kept modulo STAMP_MOD, and a step compares ages (its stamp minus a slot's, modulo STAMP_MOD): the counter
can run for the life of a server (it advances once per decode forward), and the order is exact while a row's entries
are younger than STAMP_MOD steps, which a request would need 2^28 decode forwards of its own lifetime to break.
"""

from __future__ import annotations

import dataclasses

import torch

STAMP_MOD = 1 << 28  # ages fit the sort key's 29 bits beside the flag bits 61 and 62 and a 32-bit position
_NONE = torch.iinfo(torch.int64).max


@dataclasses.dataclass
class PolicyResult:
    attn_slot: torch.Tensor  # [B, K] int32: pool slot of each top-k entry after the update, -1 for -1 entries
    hit: torch.Tensor  # [B, K] bool: entry's row is on the GPU before any fetch (resident, or the own token)
    miss_pos: torch.Tensor  # [B, K] int32: positions to fetch, each once, compacted left in entry order, -1 padded
    miss_slot: torch.Tensor  # [B, K] int32: pool slot each miss goes to, compacted like miss_pos, -1 padded
    own_slot: torch.Tensor  # [B] (or [B, M]) int32: pool slot of the own token(s), -1 if none
    n_miss: torch.Tensor  # [B] int32
    n_set: torch.Tensor  # [B] int32: |S|, the distinct positions asked for besides the own one
    miss_row: torch.Tensor | None = None  # [B, K] int32: host row of each miss, when the step was given the token table

    @classmethod
    def empty(cls, B: int, K: int, M: int, device) -> "PolicyResult":
        """Uninitialised outputs for a kernel to fill (own_slot [B, M], miss_row included)."""
        i32 = dict(dtype=torch.int32, device=device)
        return cls(attn_slot=torch.empty(B, K, **i32), hit=torch.empty(B, K, dtype=torch.bool, device=device),
                   miss_pos=torch.empty(B, K, **i32), miss_slot=torch.empty(B, K, **i32), own_slot=torch.empty(B, M, **i32),
                   n_miss=torch.empty(B, **i32), n_set=torch.empty(B, **i32), miss_row=torch.empty(B, K, **i32))


def check_capacity(capacity: int, set_size: int, own_tokens: int) -> None:
    if capacity < set_size + own_tokens:
        raise ValueError(
            f"ESS buffer of {capacity} slots is below the set size + own tokens (top-k + 1) = {set_size} + {own_tokens}"
        )


def check_step_tables(kernel: str, slot_pos: torch.Tensor, slot_stamp: torch.Tensor, pos_slot: torch.Tensor,
                      token_table: torch.Tensor | None) -> None:
    """The LRU kernels' shared checks: contiguous int32 tables, and a token table as SGLang's req_to_token is (int32,
    contiguous rows; an int64 one failed every step of the CUDA kernel on an H200, docs/gpu.md)."""
    for name, t in (("slot_pos", slot_pos), ("slot_stamp", slot_stamp), ("pos_slot", pos_slot)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{kernel}: {name} must be a contiguous int32 table")
    if token_table is not None and (token_table.dtype != torch.int32 or token_table.stride(1) != 1):
        raise ValueError(f"{kernel}: token_table must be int32 with contiguous rows (SGLang's req_to_token), "
                         f"got {token_table.dtype} with strides {tuple(token_table.stride())}")


def lru_update(
    slot_pos: torch.Tensor,
    slot_stamp: torch.Tensor,
    pos_slot: torch.Tensor,
    req: torch.Tensor,
    sets: torch.Tensor,
    own_pos: torch.Tensor,
    stamp: torch.Tensor | int,
) -> PolicyResult:
    """One LRU step for a batch on one layer's tables (see sparse_pool.SparseMemoryPool), in place.

    req [B] request indices (distinct, except rows with no set and no own token), sets [B, K] top-k positions
    (-1 padded, each < the tables' positions), own_pos [B] the step's own position (-1: none, as in warm-up), stamp the
    step's stamp. Requires capacity C >= K + 1.
    own_pos may be [B, M] (distinct or -1): M tokens of one request produced in the same step, as in MTP
    target-verify, where `sets` is the union of the M query rows' top-k sets; then C >= K + M is required.
    """
    B, K = sets.shape
    one_own = own_pos.dim() == 1
    own = own_pos.long().reshape(B, -1)
    M = own.shape[1]
    C = slot_pos.shape[1] - 1
    P = pos_slot.shape[1] - 1
    check_capacity(C, K, M)
    dev = sets.device
    req = req.long()
    r2 = req.unsqueeze(1)
    s = sets.long()
    has_own = own >= 0
    stamp = torch.remainder(torch.as_tensor(stamp, dtype=torch.int64, device=dev), STAMP_MOD)  # warm-up's may be < 0

    # Per entry, in the caller's order, as things stand before the update.
    entry = s >= 0
    is_own = entry & (s.unsqueeze(2) == own.unsqueeze(1)).any(2)
    pre_slot = pos_slot[r2, torch.where(entry, s, P)].long()
    hit = entry & ((pre_slot >= 0) | is_own)

    # S: an entry stands for its position when it is the position's first entry (a stable sort finds them).
    srt, order = torch.sort(torch.where(entry & ~is_own, s, _NONE), dim=1, stable=True)
    lead = torch.ones_like(entry)
    lead[:, 1:] = srt[:, 1:] != srt[:, :-1]
    first = torch.zeros_like(entry).scatter_(1, order, lead & (srt != _NONE))
    uhit = first & (pre_slot >= 0)
    umiss = first & (pre_slot < 0)
    n_miss = umiss.sum(1)

    own_pre = pos_slot[r2, torch.where(has_own, own, P)].long()
    own_resident = has_own & (own_pre >= 0)  # only when a position is processed twice (e.g. a replayed step)
    need_own = has_own & ~own_resident
    n_need = need_own.sum(1)

    # Victims: empty slots first, then (stamp, position) ascending, i.e. oldest first; members of S and a resident own
    # are protected. The K + M smallest keys (keys are distinct) are enough, as misses + own <= K + M <= C.
    sp = slot_pos[req, :C].long()
    age = torch.remainder(stamp - slot_stamp[req, :C].long(), STAMP_MOD)
    protected = torch.zeros(B, C + 1, dtype=torch.bool, device=dev)
    protected.scatter_(1, torch.where(uhit, pre_slot, C), True)
    protected.scatter_(1, torch.where(own_resident, own_pre, C), True)
    slot_ids = torch.arange(C, device=dev).expand(B, C)
    key = torch.where(sp >= 0, (1 << 61) | ((STAMP_MOD - 1 - age) << 32) | sp, slot_ids)
    key = key | (protected[:, :C].long() << 62)
    victims = torch.topk(key, K + M, dim=1, largest=False, sorted=True).indices
    take = torch.arange(K + M, device=dev).unsqueeze(0) < (n_miss + n_need).unsqueeze(1)
    chosen = torch.sort(torch.where(take, victims, C), dim=1).values  # the victims in slot order, then C (none)
    old = torch.where(chosen < C, slot_pos[r2, chosen].long(), -1)  # the sink column holds scratch: not read
    evict = old >= 0

    miss_rank = (torch.cumsum(umiss, 1) - 1).clamp(min=0)
    miss_local = torch.where(umiss, chosen.gather(1, miss_rank), C)
    need_rank = (torch.cumsum(need_own, 1) - 1).clamp(min=0)
    own_local = torch.where(
        own_resident, own_pre, torch.where(need_own, chosen.gather(1, n_miss.unsqueeze(1) + need_rank), C)
    )

    # Apply: evict (those positions are neither in S nor own), insert, stamp. Values are device tensors: a Python
    # scalar in an indexed assignment is copied from the host, which CUDA graph capture refuses.
    pos_slot[r2, torch.where(evict, old, P)] = torch.full((), -1, dtype=pos_slot.dtype, device=dev)
    pos_slot[r2, torch.where(umiss, s, P)] = miss_local.to(pos_slot.dtype)
    pos_slot[r2, torch.where(has_own, own, P)] = own_local.to(pos_slot.dtype)
    slot_pos[r2, miss_local] = s.to(slot_pos.dtype)
    slot_pos[r2, own_local] = own.to(slot_pos.dtype)
    stored = stamp.to(slot_stamp.dtype)
    slot_stamp[r2, torch.where(uhit, pre_slot, miss_local)] = stored
    slot_stamp[r2, own_local] = stored

    base = req * C
    none = torch.full_like(s, -1)
    own_slot = torch.where(has_own, base.unsqueeze(1) + own_local, torch.full_like(own, -1))
    post = pos_slot[r2, torch.where(entry, s, P)].long()
    compact = torch.where(umiss, miss_rank, K)  # column K: a sink, cut off below
    miss_pos = torch.full((B, K + 1), -1, dtype=torch.int64, device=dev).scatter_(1, compact, torch.where(umiss, s, none))
    miss_slot = torch.full_like(miss_pos, -1).scatter_(1, compact, torch.where(umiss, base.unsqueeze(1) + miss_local, none))
    i32 = torch.int32
    return PolicyResult(
        attn_slot=torch.where(entry, base.unsqueeze(1) + post, none).to(i32),
        hit=hit,
        miss_pos=miss_pos[:, :K].to(i32),
        miss_slot=miss_slot[:, :K].to(i32),
        own_slot=(own_slot.squeeze(1) if one_own else own_slot).to(i32),
        n_miss=n_miss.to(i32),
        n_set=first.sum(1).to(i32),
    )
