"""Residency first (docs/design.md, "Residency first"; the plugin's policy in docs/plugin.md): at the start of a
forward, the request slots given since the last one get regions of the device rows, resident while the pool has room,
offloaded otherwise; residents are demoted to make room, offloaded ones promoted once room comes back."""

from __future__ import annotations

import torch

from ess.core.serving import ServingLatentCache

PADDING_SLOT = 0  # SGLang's request tables keep row 0 for CUDA-graph padding; requests get rows from 1


class ResidencyAdmission:
    def __init__(self, cache: ServingLatentCache, token_table: torch.Tensor):
        """token_table: SGLang's req_to_token; its width is the most positions a request can reach."""
        self.cache = cache
        self.token_table = token_table
        self.width = token_table.shape[1]
        self._positions: dict[int, int] = {}  # request slot -> the positions its request can reach, as given
        self._finished: set[int] = set()  # request slots let go since the last forward
        self._reach: dict[int, int] = {}  # request slot -> its resident region's rows (a multiple of C)
        self._reqs: dict[int, object] = {}  # request slot -> SGLang's Req: how far its rows reach, for a flush
        self.demoted = self.promoted = 0  # requests that crossed the wall, each way (host counts)

    def plan(self, req_slot: int, positions: int, req=None) -> None:
        """The scheduler gave request slot req_slot to a request (SGLang's Req; None: unknown) that can reach
        `positions` positions (its prompt, its most new tokens and the draft tokens): its region is sized for them at
        the next forward."""
        self._positions[req_slot] = min(positions, self.width)
        if req is None:
            self._reqs.pop(req_slot, None)
        else:
            self._reqs[req_slot] = req

    def tracks_all(self) -> bool:
        """Every resident request's Req is known, so a flush knows its rows (a row given by SGLang's alloc_rows alone,
        which the reach hook does not see, keeps its forwards on the general path, which backs every row up)."""
        return all(r in self._reqs for r in self.cache.resident_requests())

    def flush(self, req_slot: int, upto: int | None = None) -> int:
        """Host copies once: the rows of a resident request that only its region may hold go to the host pool
        (ServingLatentCache.flush). The prompt's rows are there already (a prefill writes every row it stages to the
        host pool; a PD decode node receives them there), so positions [prompt, upto) go: upto, SGLang's KV kept
        (radix cache, backup), or the positions allocated to the request (a demotion: rows in flight included, each
        of its own locations). Returns the rows copied per layer."""
        req = self._reqs.get(req_slot)
        if req is None:
            return 0
        hi = req.kv.kv_allocated_len if upto is None else upto
        return self.cache.flush(req_slot, self.token_table, len(req.origin_input_ids), hi)

    def release(self, req_slot: int) -> None:
        """The request of req_slot finished or was aborted: its region is freed with its row's reset."""
        self._finished.add(req_slot)
        self._positions.pop(req_slot, None)
        self._reach.pop(req_slot, None)
        self._reqs.pop(req_slot, None)

    def admit(self, resets: list[int]) -> None:
        """At the start of a forward, in stream order, after the rows in `resets` were reset: the rows given to new
        requests get regions (a finished request's row waits for its next one), first come, first resident, in the
        order the rows were given (plan notes each as it is given); rows given without a reach (by SGLang's alloc_rows
        alone, which the reach hook does not see) reach the table's width and come after those."""
        finished, self._finished = self._finished, set()
        given = dict.fromkeys(resets)
        new = [r for r in self._positions if r in given] + [r for r in given if r not in self._positions
                                                           and r not in finished]
        self._admit_regions(new, bool(resets))

    def _admit_regions(self, new: list[int], changed: bool) -> None:
        """The new request slots get regions, resident while the pool has room, offloaded otherwise (residents
        demoted, largest first, to make room for an offloaded one); once a request left, offloaded ones are promoted
        while room lasts. Regions are whole multiples of C, so a freed or demoted region always leaves whole C-slot
        regions free."""
        cache, C = self.cache, self.cache.capacity
        whole = lambda positions: -(-positions // C) * C  # noqa: E731 - rows in whole multiples of C
        for slot in new:
            if slot == PADDING_SLOT:
                continue
            want = whole(self._positions.pop(slot, self.width))
            self._reach[slot] = want
            while True:
                try:
                    cache.admit(slot, want)
                    break
                except ValueError:
                    residents = [r for r in cache.resident_requests() if r != slot]
                    if not residents:
                        raise
                    victim = max(residents, key=lambda r: cache.region[r][1])
                    self.flush(victim)  # its rows the region alone holds, to the host pool first
                    cache.demote(victim)
                    self.demoted += 1
        if changed and cache.offloaded:  # a request came or went: room for an offloaded one, perhaps
            for slot in sorted(cache.offloaded):
                want = self._reach.get(slot, whole(self.width))
                if cache.regions.largest_free() + C < want:
                    continue
                if cache.promote(slot, want, self.token_table, want):
                    self.promoted += 1
