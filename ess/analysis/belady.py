"""Belady's MIN under ESS's step semantics: the fewest misses any policy can have with the same GPU slots, the bound
to hold LRU against (docs/profiling.md, "The offline optimum").

A row is one (request, layer). Step t uses U_t = S_t (its top-k positions without the own one, -1 ignored, each
once) and its own position p_t (none in a warm-up window); all of U_t must be resident together. misses = S_t
minus the resident positions (p_t is made on the GPU: never a miss, but it needs a slot). Room is made by evicting
resident positions outside U_t, the one whose next use is farthest first (never used again: farthest), ties by the
lower position. A use is membership in a later step's U.

`min_misses` replays rows as fixed-shape tensor steps: each slot keeps the step of its position's next use, found
beforehand by one backward pass over the steps (a position -> next use table per row).
"""

from __future__ import annotations

import torch

NEVER = torch.iinfo(torch.int32).max  # the next use of a position never used again


def step_uses(sets: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """U per (step and) row [..., K + 1] of sets [..., K] and own [...]: the set's positions without the own one (-1
    where not), duplicates kept (first_of_each drops them), and the own position last."""
    s = torch.where(sets == own.unsqueeze(-1), -1, sets.long())
    return torch.cat([s, own.long().unsqueeze(-1)], dim=-1)


def first_of_each(u: torch.Tensor, sink: int) -> torch.Tensor:
    """Mask of the first entry of each distinct position >= 0 in every row of u [N, E] (every position < sink)."""
    valid = u >= 0
    srt, order = torch.sort(torch.where(valid, u, sink), dim=1, stable=True)
    lead = torch.ones_like(valid)
    lead[:, 1:] = srt[:, 1:] != srt[:, :-1]
    return torch.zeros_like(valid).scatter_(1, order, lead & (srt < sink))


def next_uses(uses: torch.Tensor, positions: int) -> torch.Tensor:
    """For each entry of uses [T, N, E] (-1: none), the first later step that uses its position (NEVER if none)."""
    T, N, E = uses.shape
    later = torch.full((N, positions + 1), NEVER, dtype=torch.int32, device=uses.device)  # column positions: a sink
    out = torch.empty(T, N, E, dtype=torch.int32, device=uses.device)
    rows = torch.arange(N, device=uses.device).unsqueeze(1)
    for t in range(T - 1, -1, -1):
        u = torch.where(uses[t] >= 0, uses[t], positions)
        out[t] = later[rows, u]
        later[rows, u] = t
    return out


def min_misses(sets: torch.Tensor, own: torch.Tensor, capacity: int, positions: int) -> torch.Tensor:
    """Misses [T, N] of MIN with `capacity` slots per row. sets [T, N, K] positions (-1 padded), own [T, N] the own
    position of each step (-1: none, as in a warm-up window), every position < positions."""
    T, N, K = sets.shape
    if capacity < K + 1:
        raise ValueError(f"--buffer-tokens: {capacity} slots is below top-k + 1 = {K + 1}")
    dev = sets.device
    uses = step_uses(sets, own)
    nxt = next_uses(uses, positions)
    E, C, P = K + 1, capacity, positions
    slot_pos = torch.full((N, C + 1), -1, dtype=torch.int64, device=dev)  # column C: a sink
    slot_next = torch.zeros((N, C + 1), dtype=torch.int64, device=dev)
    pos_slot = torch.full((N, P + 1), -1, dtype=torch.int64, device=dev)  # column P: a sink
    rows = torch.arange(N, device=dev).unsqueeze(1)
    out = torch.empty(T, N, dtype=torch.int32, device=dev)
    for t in range(T):
        u, n = uses[t], nxt[t].long()
        valid = u >= 0
        first = first_of_each(u, P)  # each position once: its first entry
        pre = pos_slot[rows, torch.where(valid, u, P)]
        resident = first & (pre >= 0)
        need = first & (pre < 0)
        out[t] = need[:, : E - 1].sum(1).to(torch.int32)  # the last column is the own position: never a miss
        # victims: empty slots first, then the farthest next use, ties by the lower position; U's slots protected
        protected = torch.zeros(N, C + 1, dtype=torch.bool, device=dev)
        protected.scatter_(1, torch.where(resident, pre, C), True)
        sp, sn = slot_pos[:, :C], slot_next[:, :C]
        slot_ids = torch.arange(C, device=dev).expand(N, C)
        key = torch.where(sp >= 0, (1 << 61) | ((NEVER - sn) << 28) | sp, slot_ids)  # positions < 2^28
        key = key | (protected[:, :C].long() << 62)
        victims = torch.topk(key, E, dim=1, largest=False, sorted=True).indices
        rank = (torch.cumsum(need, 1) - 1).clamp(min=0)
        slot = torch.where(need, victims.gather(1, rank), torch.where(resident, pre, C))
        old = torch.where(need, slot_pos[rows, slot], -1)
        pos_slot[rows, torch.where(old >= 0, old, P)] = -1
        pos_slot[rows, torch.where(need, u, P)] = torch.where(need, slot, -1)
        slot_pos[rows, torch.where(need, slot, C)] = torch.where(need, u, -1)
        slot_next[rows, torch.where(first, slot, C)] = torch.where(first, n, 0)
    return out


def min_misses_oracle(steps: list[tuple[list[int], int]], capacity: int) -> list[int]:
    """Plain Python, one row: steps [(top-k positions, own position or -1)] -> misses per step."""
    uses = [{p for p in s if p >= 0 and p != o} | ({o} if o >= 0 else set()) for s, o in steps]
    resident: set[int] = set()
    out = []
    for t, (s, o) in enumerate(steps):
        u = uses[t]
        misses = {p for p in u if p != o} - resident
        out.append(len(misses))
        need = len(u - resident)
        free = capacity - len(resident)
        if need > free:
            def next_use(p):
                return next((t2 for t2 in range(t + 1, len(steps)) if p in uses[t2]), float("inf"))

            victims = sorted(resident - u, key=lambda p: (-next_use(p), p))[: need - free]
            resident -= set(victims)
        resident |= u
    return out
