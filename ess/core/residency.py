"""Residency first (docs/design.md, "Residency first"): the device latent pool as contiguous regions, one per request.

A request is RESIDENT while its region holds a row for every position it can reach (slot = region start + position:
no LRU step, no transfer, FlashMLA over its real rows), or OFFLOADED with a region of C slots that the LRU policy
manages (ess.core.sparse_pool). `RowRegions` is the host-side allocator of those regions (first fit over one pool
of rows, neighbours merged on free); `split` is the admission policy: as many requests resident as the pool holds
beside the others' C slots each.

Host-side only: admission and release run between forward passes, never inside a captured step.
"""

from __future__ import annotations

import bisect


class RowRegions:
    """First-fit allocator of contiguous row ranges in a pool of `rows` rows."""

    def __init__(self, rows: int):
        if rows < 0:
            raise ValueError(f"a row pool of {rows} rows")
        self.rows = rows
        self._free: list[tuple[int, int]] = [(0, rows)] if rows else []  # (start, length), sorted by start

    def alloc(self, n: int) -> int | None:
        """The start of n free contiguous rows (the lowest that fits), or None."""
        if n <= 0:
            raise ValueError(f"a region of {n} rows")
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, length - n)
                return start
        return None

    def take(self, start: int, n: int) -> None:
        """Claim the free rows [start, start + n) (a region given back and claimed again where it was)."""
        for i, (s, length) in enumerate(self._free):
            if s <= start and start + n <= s + length:
                pieces = [(s, start - s), (start + n, s + length - start - n)]
                self._free[i:i + 1] = [p for p in pieces if p[1] > 0]
                return
        raise ValueError(f"rows [{start}, {start + n}) are not free")

    def free(self, start: int, n: int) -> None:
        """Give rows [start, start + n) back, merged with free neighbours."""
        if n <= 0:
            return
        if start < 0 or start + n > self.rows:
            raise ValueError(f"rows [{start}, {start + n}) outside a pool of {self.rows}")
        i = bisect.bisect_left(self._free, (start, 0))
        if (i > 0 and self._free[i - 1][0] + self._free[i - 1][1] > start) or (
                i < len(self._free) and start + n > self._free[i][0]):
            raise ValueError(f"rows [{start}, {start + n}) are already free")
        if i < len(self._free) and start + n == self._free[i][0]:  # merge with the next
            n += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:  # and the previous
            start, n = self._free[i - 1][0], self._free[i - 1][1] + n
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (start, n))

    def free_rows(self) -> int:
        return sum(length for _, length in self._free)

    def largest_free(self) -> int:
        return max((length for _, length in self._free), default=0)


def split(rows: int, batch: int, full: int, capacity: int) -> int:
    """How many of `batch` requests are resident in a pool of `rows` rows when a resident request takes `full` rows
    and an offloaded one `capacity` (C) slots: the most R with R x full + (batch - R) x C <= rows. Raises when even
    all-offloaded does not fit."""
    if batch * capacity > rows:
        raise ValueError(f"{batch} requests x {capacity} slots need {batch * capacity} device rows, the pool has {rows}")
    if full <= capacity:
        return batch
    return min(batch, (rows - batch * capacity) // (full - capacity))
