"""Candidate cache policies beside ESS's LRU, replayed offline (docs/policies.md):

    lru       ESS's policy, as ess.core.policy runs it (here as the reference point of the same engine);
    prefetch  LRU plus lookahead prefetch: after each step, the positions the indexer ranked just after the top-k
              (ranks K+1 .. K+d, a trace's `topk_ext`) that are not resident are fetched into the slots LRU would
              evict first (the step's own rows protected). They enter with the step's stamp. Lossless: the attention
              set is unchanged; a prefetched row is only a row fetched early, or in vain;
    score     score-aware eviction (LRFU): each resident position keeps a decayed use score,
              score <- score - (score >> decay_shift) + SCORE_UNIT if the step uses it; the victim is the lowest
              score, then the oldest stamp, then the lower position. decay_shift s is lambda = 1 - 2^-s.

A row is one (request, layer); the step semantics are ESS's (ess.core.policy): step t uses U_t, its top-k positions
without the own one (-1 ignored, each once) and its own position (none in a warm-up window); all of U_t must be
resident together; misses = U_t minus the own position minus the resident positions; room comes from resident
positions outside U_t, empty slots first. Integer arithmetic throughout, so the plain-Python oracles in the tests
match exactly.
"""

from __future__ import annotations

import dataclasses

import torch

from ess.analysis.belady import first_of_each, step_uses
from ess.core.settings import DEFAULT_DECAY_SHIFT

SCORE_UNIT = 256  # a use's score; fixed point, so that decay stays exact in integers

# victim keys (int64, smallest evicted first): protected | occupied | score | stamp | position
_POS_BITS, _STAMP_BITS, _SCORE_BITS = 20, 20, 21
_STAMP_OFFSET = 1 << (_STAMP_BITS - 1)
_OCCUPIED, _PROTECTED = 1 << 61, 1 << 62


@dataclasses.dataclass
class PolicyCounts:
    """Per step and row [T, N] int32: misses (rows the step needed and found absent), prefetched (rows fetched ahead),
    prefetch_hits (prefetched rows that a later step used before they left); wasted [N]: prefetched rows evicted
    unused, or still unused when the trace ends."""

    misses: torch.Tensor
    prefetched: torch.Tensor
    prefetch_hits: torch.Tensor
    wasted: torch.Tensor


def replay_policy(sets: torch.Tensor, own: torch.Tensor, capacity: int, positions: int, policy: str = "lru",
                  ext: torch.Tensor | None = None, decay_shift: int = DEFAULT_DECAY_SHIFT) -> PolicyCounts:
    """sets [T, N, K] positions (-1 padded); own [T, N] (-1: a warm-up window); ext [T, N, d] the positions ranked
    after the top-k, best first (-1: none), for `prefetch`; every position < positions."""
    T, N, K = sets.shape
    if policy not in ("lru", "prefetch", "score"):
        raise ValueError(f"--policy: no vectorised replay for {policy!r}")
    if capacity < K + 1:
        raise ValueError(f"--buffer-tokens: {capacity} slots is below top-k + 1 = {K + 1}")
    if policy == "prefetch" and ext is None:
        raise ValueError("--policy prefetch needs a trace with 'topk_ext' (ranks past the top-k: ess trace record --lookahead)")
    if positions >= 1 << _POS_BITS or T >= _STAMP_OFFSET:
        raise ValueError(f"replay_policy: positions < {1 << _POS_BITS} and steps < {_STAMP_OFFSET} (keys are packed)")
    dev = sets.device
    C, P, E = capacity, positions, K + 1
    rows = torch.arange(N, device=dev).unsqueeze(1)
    slot_ids = torch.arange(C, device=dev).expand(N, C)
    slot_pos = torch.full((N, C + 1), -1, dtype=torch.int64, device=dev)  # column C: a sink
    slot_stamp = torch.zeros((N, C + 1), dtype=torch.int64, device=dev)
    slot_score = torch.zeros((N, C + 1), dtype=torch.int64, device=dev)
    slot_pref = torch.zeros((N, C + 1), dtype=torch.bool, device=dev)  # prefetched, not used yet
    pos_slot = torch.full((N, P + 1), -1, dtype=torch.int64, device=dev)  # column P: a sink
    out = PolicyCounts(*(torch.zeros(T, N, dtype=torch.int32, device=dev) for _ in range(3)),
                       wasted=torch.zeros(N, dtype=torch.int32, device=dev))

    def victim_order(protected: torch.Tensor, k: int) -> torch.Tensor:
        """The k first victims per row: empty slots (by index), then by (score, stamp, position); protected last."""
        sp = slot_pos[:, :C]
        key = torch.where(sp >= 0, _OCCUPIED | (slot_score[:, :C] << (_POS_BITS + _STAMP_BITS))
                          | ((slot_stamp[:, :C] + _STAMP_OFFSET) << _POS_BITS) | sp, slot_ids)
        key = key | (protected.long() << 62)
        return torch.topk(key, k, dim=1, largest=False, sorted=True).indices

    def place(slot: torch.Tensor, pos: torch.Tensor, take: torch.Tensor, t: int, prefetched: bool) -> None:
        """Positions pos [N, k] into slots slot [N, k] where take; the slots' old positions leave."""
        at = torch.where(take, slot, C)
        old = torch.where(take, slot_pos[rows, at], -1)
        out.wasted.add_((take & (old >= 0) & slot_pref[rows, at]).sum(1).to(torch.int32))
        pos_slot[rows, torch.where(old >= 0, old, P)] = -1
        pos_slot[rows, torch.where(take, pos, P)] = torch.where(take, slot, -1)
        slot_pos[rows, at] = torch.where(take, pos, -1)
        slot_stamp[rows, at] = t
        slot_score[rows, at] = 0
        slot_pref[rows, at] = prefetched

    for t in range(T):
        o = own[t].long()
        u = step_uses(sets[t], o)  # [N, E]
        first = first_of_each(u, P)
        pre = pos_slot[rows, torch.where(first, u, P)]
        resident, need = first & (pre >= 0), first & (pre < 0)
        out.misses[t] = need[:, : E - 1].sum(1).to(torch.int32)  # the last column is the own position: never a miss
        used = torch.where(resident, pre, C)
        out.prefetch_hits[t] = (slot_pref[rows, used] & resident).sum(1).to(torch.int32)
        slot_pref[rows, used] = False
        protected = torch.zeros(N, C + 1, dtype=torch.bool, device=dev)
        protected.scatter_(1, used, True)
        victims = victim_order(protected[:, :C], E)
        rank = (torch.cumsum(need, 1) - 1).clamp(min=0)
        slot = torch.where(need, victims.gather(1, rank), used)
        if policy == "score":  # decay every resident score, then credit this step's uses
            slot_score.sub_(slot_score >> decay_shift)
            slot_score[rows, torch.where(resident, pre, C)] += SCORE_UNIT
        place(slot, u, need, t, prefetched=False)
        slot_stamp[rows, torch.where(first, slot, C)] = t
        if policy == "score":
            slot_score[rows, torch.where(need, slot, C)] = SCORE_UNIT
        slot_score[:, C] = 0
        if policy == "prefetch":
            cand = ext[t].long()
            cand = torch.where((cand != o.unsqueeze(1)) & (cand >= 0), cand, -1)
            cand = torch.where(first_of_each(cand, P) & (pos_slot[rows, torch.where(cand >= 0, cand, P)] < 0), cand, -1)
            in_use = torch.zeros(N, C + 1, dtype=torch.bool, device=dev)
            in_use.scatter_(1, torch.where(first, slot, C), True)
            room = C - first.sum(1, keepdim=True)  # slots outside this step's set: empty or evictable
            ok = cand >= 0
            order = torch.cumsum(ok, 1) - 1
            take = ok & (order < room)
            victims = victim_order(in_use[:, :C], min(cand.shape[1], C))  # a taken rank < room <= C
            pslot = torch.where(take, victims.gather(1, order.clamp(min=0, max=victims.shape[1] - 1)), C)
            place(pslot, cand, take, t, prefetched=True)
            out.prefetched[t] = take.sum(1).to(torch.int32)
    out.wasted.add_(slot_pref[:, :C].sum(1).to(torch.int32))
    return out
