"""Sparse Memory Pool: the LRU tables of the GPU slots that hold a subset of the latent rows (the slots' bytes live
in ess.core.serving.ServingLatentCache; trace replay and profiling need the tables only).

Request r owns slots [r * C, (r + 1) * C) of every layer; slot max_requests * C is a sink. Per (request, layer):
    slot_pos   [C + 1] int32   position held by each slot, -1 if empty
    slot_stamp [C + 1] int32   last-use stamp of each slot
    pos_slot   [P + 1] int32   slot holding each position, -1 if not resident
The extra last column of each table is a sink that absorbs the padded entries of fixed-shape updates, so the
policy never branches on the host.
"""

from __future__ import annotations

import functools
import logging

import torch

from ess.core.policy import STAMP_MOD, PolicyResult, lru_update
from ess.core.settings import AUTO_GPU_KERNELS, KERNELS

logger = logging.getLogger(__name__)


def step_function(kernel: str, device: torch.device):
    """The LRU step for `kernel` on tables on `device`: auto is the torch ops on a CPU (where the kernels run in
    Triton's interpreter or the CUDA kernel's emulation: exact, but slow), and on a GPU the first kernel of
    settings.AUTO_GPU_KERNELS that builds and equals the torch path there."""
    if kernel not in KERNELS:
        raise ValueError(f"--kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "torch" or (kernel == "auto" and device.type != "cuda"):
        return lru_update
    if kernel == "auto":
        kernel = auto_kernel(device)
    if kernel == "cuda":
        from ess.core.kernels.lru_step_cuda import lru_update_cuda

        return lru_update_cuda
    from ess.core.kernels.lru_step import lru_update_fused

    return lru_update_fused


@functools.lru_cache(maxsize=None)
def auto_kernel(device: torch.device) -> str:
    """`auto` on a GPU (docs/gpu.md, "The CUDA LRU step"), decided once per device; a kernel that does not build or
    differs from the torch path there is passed over with a warning naming why."""
    for name in AUTO_GPU_KERNELS:
        if name != "cuda":
            return name
        try:
            from ess.core.kernels.lru_step_cuda import self_check

            self_check(device)
            return name
        except Exception as e:  # no nvcc, a build error, a difference: the next kernel
            logger.warning("ESS: the CUDA LRU step is not used on %s: %s", device, str(e).splitlines()[0])
    return "fused"


class SparseMemoryPool:
    def __init__(
        self,
        num_layers: int,
        max_requests: int,
        capacity: int,
        max_positions: int,
        device: torch.device | str,
        kernel: str = "auto",
    ):
        self.capacity = capacity
        self.kernel = kernel
        self._step = step_function(kernel, torch.device(device))
        self.max_positions = max_positions
        self.sink_slot = max_requests * capacity
        self.slot_pos = torch.full((num_layers, max_requests, capacity + 1), -1, dtype=torch.int32, device=device)
        self.slot_stamp = torch.zeros((num_layers, max_requests, capacity + 1), dtype=torch.int32, device=device)
        self.pos_slot = torch.full((num_layers, max_requests, max_positions + 1), -1, dtype=torch.int32, device=device)

    def reset(self, req: int | torch.Tensor) -> None:
        """Forget the resident rows of request req (an int, or a tensor of them): on release, abort, or a new prefill."""
        if isinstance(req, torch.Tensor):
            req = req.long()
        self.slot_pos[:, req] = -1
        self.slot_stamp[:, req] = 0
        self.pos_slot[:, req] = -1

    def layer_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.slot_pos[layer], self.slot_stamp[layer], self.pos_slot[layer]

    def step(self, layer: int, req: torch.Tensor, sets: torch.Tensor, own: torch.Tensor, stamp,
             token_table: torch.Tensor | None = None) -> PolicyResult:
        """One LRU step on a layer's tables (ess.core.policy.lru_update's contract). token_table: with the fused kernel,
        each miss's host row comes back in result.miss_row."""
        if self._step is lru_update:
            return lru_update(*self.layer_state(layer), req, sets, own, stamp)
        return self._step(*self.layer_state(layer), req, sets, own, stamp, token_table)

    def warm(self, layer: int, req: torch.Tensor, sets: torch.Tensor, first_stamp) -> torch.Tensor:
        """LRU-Warmup (docs/design.md, LRU-Warmup) of requests req [B] (distinct): their prefill top-k sets [B, W, K],
        oldest first, window w stamped first_stamp + w, on top of what the rows hold. Returns [B, C] bool: the slots
        that took a new position (their rows must be fetched).

        One compaction instead of W LRU steps, with the same result: inserting windows oldest first with C >= K + 1
        slots leaves resident exactly the C positions with the largest (last use, position), each stamped with its
        last use (an evicted position has C others above it at its eviction, and keys only grow). Positions that stay
        keep their slots; new ones take the freed slots in slot order."""
        B, W, K = sets.shape
        C, P = self.capacity, self.max_positions
        sp, st, ps = self.layer_state(layer)
        dev = sets.device
        r = req.long()
        r2 = r.unsqueeze(1)
        newest = torch.remainder(torch.as_tensor(first_stamp, device=dev).long() + W - 1, STAMP_MOD)
        # candidates: the rows' residents and every window's entries, with their age at the newest window
        held = sp[r, :C].long()
        held_age = torch.where(held >= 0, torch.remainder(newest - st[r, :C].long(), STAMP_MOD), STAMP_MOD)
        win_age = (W - 1 - torch.arange(W, device=dev)).view(1, W, 1).expand(B, W, K).reshape(B, W * K)
        pos = torch.cat([held, sets.long().reshape(B, W * K)], dim=1)
        age = torch.cat([held_age, win_age], dim=1)
        valid = pos >= 0
        # each position once, at its smallest age: sort by (position, age), keep the first of each position
        key = torch.where(valid, pos * (STAMP_MOD + 1) + age, -1)
        key, _ = torch.sort(key, dim=1)
        upos, uage = key // (STAMP_MOD + 1), key % (STAMP_MOD + 1)
        first = key >= 0
        first[:, 1:] &= upos[:, 1:] != upos[:, :-1]
        # the C most recent (age ascending, position descending: LRU evicts the lower position first)
        rank = torch.where(first, uage * (P + 1) + (P - upos), (STAMP_MOD + 1) * (P + 1))
        top = torch.topk(rank, min(C, rank.shape[1]), dim=1, largest=False).indices
        keep_pos = torch.where(first.gather(1, top), upos.gather(1, top), -1)  # [B, <=C]
        keep_age = uage.gather(1, top)
        kept = torch.zeros(B, P + 1, dtype=torch.bool, device=dev)  # by position; column P: a sink
        kept.scatter_(1, torch.where(keep_pos >= 0, keep_pos, P), True)
        stays = (held >= 0) & kept.gather(1, torch.where(held >= 0, held, P))  # residents kept in their slots
        pre = ps[r2, torch.where(keep_pos >= 0, keep_pos, P)].long()
        new = (keep_pos >= 0) & (pre < 0)
        free = ~stays  # slots whose position leaves (or that were empty), in slot order
        free_rank = torch.cumsum(free, 1) - 1
        slot_of_rank = torch.full((B, C + 1), C, dtype=torch.long, device=dev)
        slot_of_rank.scatter_(1, torch.where(free, free_rank, C), torch.arange(C, device=dev).expand(B, C))
        new_slot = torch.where(new, slot_of_rank.gather(1, (torch.cumsum(new, 1) - 1).clamp(min=0)), C)
        slot = torch.where(new, new_slot, torch.where(keep_pos >= 0, pre, C))
        # apply: leaving positions out, new ones in, every kept position stamped with its last use
        leaving = (held >= 0) & ~stays
        ps[r2, torch.where(leaving, held, P)] = torch.full((), -1, dtype=ps.dtype, device=dev)
        sp[r2, torch.where(leaving, torch.arange(C, device=dev).expand(B, C), C)] = torch.full((), -1, dtype=sp.dtype, device=dev)
        ps[r2, torch.where(new, keep_pos, P)] = slot.to(ps.dtype)
        sp[r2, torch.where(new, slot, C)] = keep_pos.to(sp.dtype)
        stamp = torch.remainder(newest - keep_age, STAMP_MOD)
        st[r2, torch.where(keep_pos >= 0, slot, C)] = stamp.to(st.dtype)
        took = torch.zeros(B, C + 1, dtype=torch.bool, device=dev).scatter_(1, torch.where(new, slot, C), True)
        return took[:, :C]

    def load(self, req: int, pos: torch.Tensor, stamps: torch.Tensor) -> None:
        """Set request req's LRU state on every layer at once: pos [layers, M] positions (-1: none; distinct per
        layer, M <= C) go to the request's first M slots with last-use stamps [layers, M]. This is how a PD decode node
        takes the state LRU-Warmup left on the prefill node (sglang_ess.pd.warmup): which slot holds a position is
        immaterial to the policy, which only compares stamps and positions."""
        L, M = pos.shape
        if M > self.capacity:
            raise ValueError(f"cannot load {M} rows into {self.capacity} slots")
        self.reset(req)
        pos = pos.to(self.slot_pos.device).long()
        held = pos >= 0
        self.slot_pos[:, req, :M] = torch.where(held, pos, -1).to(self.slot_pos.dtype)
        stamps = torch.remainder(stamps.to(pos.device).long(), STAMP_MOD)  # the policy's modular stamps
        self.slot_stamp[:, req, :M] = torch.where(held, stamps, 0).to(self.slot_stamp.dtype)
        layer = torch.arange(L, device=pos.device).unsqueeze(1).expand(L, M)
        slot = torch.arange(M, device=pos.device).expand(L, M)
        self.pos_slot[layer, req, torch.where(held, pos, self.max_positions)] = torch.where(held, slot, -1).to(self.pos_slot.dtype)

    def resident_slots(self, layer: int, req: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [B, C] held by requests req's slots (-1 empty), and those slots' pool indices (-1 where empty)."""
        C = self.capacity
        pos = self.slot_pos[layer, req.long(), :C].long()
        slots = req.long().unsqueeze(1) * C + torch.arange(C, device=pos.device)
        return pos, torch.where(pos >= 0, slots, torch.full_like(slots, -1))

    def resident(self, layer: int, req: int) -> set[int]:
        """Positions resident for (layer, request): a test and debugging helper (syncs with the host)."""
        p = self.slot_pos[layer, req, : self.capacity]
        return set(p[p >= 0].tolist())

    def table_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.slot_pos, self.slot_stamp, self.pos_slot))
