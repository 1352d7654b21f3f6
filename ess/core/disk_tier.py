"""A disk tier under a host pool (KVDrive's idea; docs/design.md, "Disk tier"): a budget of pinned host frames holds
the latent pages in use, a file on local disk holds the others. Host plus disk hold every page at every step.

Addressing. The host pool a tier serves is a set of *virtual rows* per layer: SGLang's token locations on the
serving path (sglang_ess.pool), request x position in the reference (ess.reference.tiered_host_pool). Virtual row v of
layer l lies in page (l, v // 64); a page is one layer's 64 rows (64 x 656 = 41,984 bytes, 45,056 on disk for
4 KiB-aligned direct I/O). The indexer picks each layer's top-k independently, so a page of all layers would read 61
layers' rows for one layer's miss. `rows(layer, v)` translates virtual rows into rows of the frames (`data`), on the
device, through a page -> frame map: the sink row for a page out of the frames or a negative v, so ess.core's
FlashTrans gathers and scatters work unchanged on `data[layer]`.

Frames are shared by all layers; a page one call uses is pinned for the call. Which page a full tier gives up is its
placement: "frequency" (the default; KVDrive keeps hot pages in host memory by access frequency) gives up the page with
the lowest decayed count of the calls that used it (halved every TIER_HEAT_HALF_LIFE_STEPS steps; ties: the least
recently used), "lru" the least recently used. A step's top-k keeps returning to a few hot pages between long gaps
while its other reads scatter over cold pages once, so a count survives where recency alone lets a cold read push a
hot page out.
A page enters a frame from disk (a read, waited for: exposed) or empty (never written); a frame leaves with a write
of its page if the page changed since its last write. The decode path's reads (`ensure_rows`: a step's misses, the
warm-up's rows) read only the 4 KiB sectors that hold the rows they need: the page enters its frame with those rows
valid, and its other rows are read when a later call needs them, or all of them when a caller writes the page
(`ensure`); `report()` counts the bytes read against the bytes of the rows needed (read amplification). `clean` writes changed pages in the background and `prefetch`
starts reading pages a coming step is likely to need. Reads and writes go to the page file (ess.core.page_file: direct
I/O, every page and row checksummed) from its thread pool. Frames are host memory the device reads and writes
asynchronously: before a frame changes page or is written out, the device is synchronised (a tier therefore runs
outside CUDA graphs). A page or row read back changed, or from another place, is refused naming the file and the
page (it stays on disk; nothing is read into the frame). A serving tier (quarantine=True) goes on instead: the page (or the rows) enters its frame zeroed
and *lost* (`lost`, per row), each read of a lost row is charged to its reader (`check_read` -> `lost_reads`: the
serving path aborts that request), and a row stops being lost when it is written again (`rewritten`: a new token at
that location).
"""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import torch

from ess.core import layout
from ess.core.page_file import DISK_PAGE, PAGE_BYTES, DiskFile, DiskTierError, PageChecksumError, free_disk_bytes
from ess.core.pinned import pinned_zeros
from ess.core.settings import PAGE_TOKENS, TIER_HEAT_HALF_LIFE_STEPS, TIER_PLACEMENTS

# DISK_PAGE and free_disk_bytes are the page file's, named here too: the plugin imports them from this module
__all__ = ["DISK_PAGE", "FLAGS", "PAGE_BYTES", "DiskTierError", "PageChecksumError", "PagedHostTier", "free_disk_bytes"]
# the flags each message names, by role (the reference's demo flags here; the plugin passes its own)
FLAGS = {"host_budget": "--host-budget-mib", "disk_dir": "--disk-dir", "disk_gib": "--disk-gib"}


class PagedHostTier:
    """`virtual_rows` latent rows on each of `num_layers` layers in host frames of `host_budget_bytes` and a page file
    in `disk_dir` (at most `disk_bytes`)."""

    def __init__(self, num_layers: int, virtual_rows: int, host_budget_bytes: int, disk_dir: str,
                 disk_bytes: int | None = None, device: torch.device | str = "cpu", flags: dict = FLAGS,
                 quarantine: bool = False, placement: str = TIER_PLACEMENTS[0]):
        if placement not in TIER_PLACEMENTS:
            raise DiskTierError(f"placement {placement!r}: one of {', '.join(TIER_PLACEMENTS)}")
        self.L, self.V, self.flags, self.quarantine = num_layers, virtual_rows, flags, quarantine
        self.placement = placement
        self.P = -(-virtual_rows // PAGE_TOKENS)  # pages per layer
        self.frames = int(host_budget_bytes // PAGE_BYTES)
        if self.frames < 1:
            raise DiskTierError(f"{flags['host_budget']}: {host_budget_bytes} bytes hold no {PAGE_BYTES}-byte page")
        n = num_layers * self.P
        self.file = DiskFile(disk_dir, n, disk_bytes, flags)
        self.device = torch.device(device)
        rows = self.frames * PAGE_TOKENS
        self.frame_rows = pinned_zeros((rows + 1, layout.LATENT_ROW_BYTES), pin=self.device.type == "cuda")  # + sink
        self.sink = rows
        # the host pool as ess.core sees it: [layers, rows + 1, 656], every layer a view of the same frames
        self.data = self.frame_rows.as_strided((num_layers, rows + 1, layout.LATENT_ROW_BYTES),
                                               (0, layout.LATENT_ROW_BYTES, 1))
        self.frame_map = torch.full((num_layers, self.P), -1, dtype=torch.int64, device=self.device)  # page -> frame
        self.frame_of = np.full(n, -1, dtype=np.int64)  # the same map on the host
        self.page_in = np.full(self.frames, -1, dtype=np.int64)  # frame -> page
        self.last_use = np.zeros(self.frames, dtype=np.int64)
        self.valid = np.zeros((self.frames, PAGE_TOKENS), dtype=bool)  # the frame's rows that hold its page's rows
        # placement "frequency": each page's count of the calls that used it, decayed to `heat_at` (a clock);
        # a layer's call comes once a step, so the half-life in calls is the layers times the half-life in steps
        self.heat = np.zeros(n, dtype=np.float64)
        self.heat_at = np.zeros(n, dtype=np.int64)
        self.half_life = num_layers * TIER_HEAT_HALF_LIFE_STEPS
        self.written = np.zeros(n, dtype=bool)  # the file holds the page's rows
        self.dirty = np.zeros(n, dtype=bool)  # the frame's rows are newer than the file's
        self.pending: dict[int, concurrent.futures.Future] = {}  # frame -> its read or write in flight
        self.prefetched = np.zeros(n, dtype=bool)  # in a frame by prefetch, not used since
        self._remapped: dict[int, int] = {}  # page -> frame changes not yet in frame_map
        self.clock = 0
        self.lost: dict[int, np.ndarray] = {}  # page -> its rows lost to a failed checksum (quarantine)
        self.lost_note: dict[int, str] = {}  # page -> the failure's message
        self.lost_reads: dict[int, str] = {}  # reader -> the message of a lost row it read (check_read)
        # host_hits / disk_faults: pages a call needed that were in a frame / that it read from disk and waited for
        # (pages never written are neither); disk_reads: those reads and the prefetches
        # (whole pages); row_reads: pages read in part by ensure_rows, sector_bytes_read what those reads moved and
        # row_bytes_used the bytes of the rows they were for
        self.stats = {"disk_reads": 0, "disk_writes": 0, "prefetch_hits": 0, "host_hits": 0, "disk_faults": 0,
                      "exposed_disk_ms": 0.0, "checksum_failures": 0, "row_reads": 0, "sector_bytes_read": 0,
                      "row_bytes_used": 0}

    # -- addressing (device ops) ----------------------------------------------------------------------------------
    def rows(self, layer: int, v: torch.Tensor) -> torch.Tensor:
        """Frame rows (int64) of virtual rows v on `layer`: the sink row for v < 0 or a page out of the frames."""
        v = v.long()
        valid = (v >= 0) & (v < self.V)
        f = self.frame_map[layer, torch.div(v, PAGE_TOKENS, rounding_mode="floor").clamp(0, self.P - 1)]
        return torch.where(valid & (f >= 0), f * PAGE_TOKENS + v % PAGE_TOKENS, self.sink)

    def pages(self, layer: int, v: torch.Tensor) -> np.ndarray:
        """The pages (ids over all layers) of virtual rows v on `layer`, negative v ignored. Host values: syncs."""
        v = v.long().flatten()
        p = torch.where((v >= 0) & (v < self.V), layer * self.P + torch.div(v, PAGE_TOKENS, rounding_mode="floor"), -1)
        p = torch.unique(p)
        return p[p >= 0].cpu().numpy()

    def frame_view(self, f: int) -> np.ndarray:
        return self.frame_rows[f * PAGE_TOKENS : (f + 1) * PAGE_TOKENS].numpy()

    def _map(self, p: int, f: int) -> None:
        self.frame_of[p] = f
        self._remapped[p] = f

    def _publish(self) -> None:
        """The page -> frame changes of a call into the device map, in one write on the current stream."""
        if self._remapped:
            pages = torch.tensor(list(self._remapped), dtype=torch.int64)
            frames = torch.tensor(list(self._remapped.values()), dtype=torch.int64)
            self.frame_map.view(-1)[pages.to(self.device)] = frames.to(self.device)
            self._remapped.clear()

    def _quiesce(self) -> None:
        """Before a frame changes page or is written out: no copy in flight on the device reads or writes it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- frames ----------------------------------------------------------------------------------------------------
    def _settle(self, f: int) -> None:
        """Wait for frame f's I/O in flight. A fault raises here (DiskTierError) with nothing lost: a failed
        background write left its page changed in host memory; a failed read ahead leaves its page on disk only."""
        fut = self.pending.pop(f, None)
        if fut is None:
            return
        try:
            fut.result()
        except DiskTierError as e:
            p = int(self.page_in[f])
            if p >= 0 and self.prefetched[p]:  # the read ahead: the frame holds nothing of the page
                self.page_in[f], self.prefetched[p] = -1, False
                self._map(p, -1)
                if self.quarantine and isinstance(e, PageChecksumError):
                    return  # the call that needs the page reads it again, and quarantines it then
            raise

    def _settle_frames(self, frames: np.ndarray) -> None:
        """Wait for the I/O in flight on these frames (a fault raises, as in _settle)."""
        if self.pending:
            for f in np.intersect1d(frames, np.fromiter(self.pending, dtype=np.int64, count=len(self.pending))):
                self._settle(int(f))

    def _heat_now(self, pages: np.ndarray) -> np.ndarray:
        return self.heat[pages] * np.exp2((self.heat_at[pages] - self.clock) / self.half_life)

    def _touch(self, pages: np.ndarray) -> None:
        """The pages one call uses: their counts decayed to now, plus one."""
        self.heat[pages] = self._heat_now(pages) + 1.0
        self.heat_at[pages] = self.clock

    def _victims(self, n: int, keep: np.ndarray) -> np.ndarray:
        """Up to n frames for new pages, none of `keep` (a frame mask): free ones first, then by the placement (the
        lowest decayed count, ties the least recently used; or the least recently used)."""
        cand = np.flatnonzero(~keep)
        pages = self.page_in[cand]
        recency = np.where(pages < 0, -1, self.last_use[cand])
        if self.placement == "lru":
            return cand[np.argsort(recency, kind="stable")[:n]]
        heat = np.where(pages < 0, -1.0, self._heat_now(np.maximum(pages, 0)))
        return cand[np.lexsort((recency, heat))[:n]]

    def _evict(self, f: int) -> None:
        """Frame f's page out, written first if it changed (main thread: a failed write raises, the page stays)."""
        self._settle(f)
        p = int(self.page_in[f])
        if p < 0:
            return
        if self.dirty[p]:
            self.file.write(p, self.frame_view(f))
            self.stats["disk_writes"] += 1
            self.written[p], self.dirty[p] = True, False
        self.page_in[f], self.prefetched[p] = -1, False
        self._map(p, -1)

    def _swap(self, f: int, old: int, write_old: bool, new: int) -> str | None:
        """In a pool thread: frame f's page `old` written out (if write_old), then page `new` read in (or zeroed if
        never written). Returns the stage that failed with its message, or None; the caller updates the state."""
        view = self.frame_view(f)
        try:
            if write_old:
                self.file.write(old, view)
        except DiskTierError as e:
            return f"write:{e}"
        try:
            if self.written[new]:
                self.file.read(new, view)
            else:
                view[:] = 0
        except PageChecksumError as e:
            if not self.quarantine:
                return f"read:{e}; the page stays on disk, nothing was read from it"
            view[:] = 0
            return f"lost:{e}"
        except DiskTierError as e:
            return f"read:{e}"
        return None

    def _fill(self, frames: np.ndarray, pages: np.ndarray) -> None:
        """Pages into these frames, all at once from the thread pool (each frame's old page written out first if it
        changed), waited for. A failed write leaves its frame's page in host memory, a failed read its page on disk;
        the first failure is raised after every other page is in place."""
        self._settle_frames(frames)  # all before any job starts: a fault here leaves every frame as it was
        jobs = []
        for f, p in zip(frames.tolist(), pages.tolist()):
            old = int(self.page_in[f])
            write_old = old >= 0 and bool(self.dirty[old])
            if write_old or self.written[p]:
                jobs.append((f, old, write_old, p, self.file.pool.submit(self._swap, f, old, write_old, p)))
            else:  # no I/O: an unchanged page leaves, a page never written comes in empty
                self.frame_view(f)[:] = 0
                jobs.append((f, old, False, p, None))
        failed = None
        for f, old, write_old, p, fut in jobs:
            stage = None if fut is None else fut.result()
            if stage is not None and stage.startswith("write:"):
                failed = failed or stage[6:]
                continue
            if old >= 0:  # out: its rows are in the file (written now, or unchanged since)
                if write_old:
                    self.stats["disk_writes"] += 1
                    self.written[old], self.dirty[old] = True, False
                self.page_in[f], self.prefetched[old] = -1, False
                self._map(old, -1)
            if stage is not None and stage.startswith("read:"):
                failed = failed or stage[5:]
                continue
            if stage is not None:  # lost: in its frame, zeroed
                self._quarantine(p, stage[5:])
            self.stats["disk_reads"] += int(self.written[p])
            self.stats["disk_faults"] += int(self.written[p])
            self.page_in[f], self.last_use[f], self.valid[f] = p, self.clock, True
            self._map(p, f)
        if failed is not None:
            raise DiskTierError(failed)

    def _begin(self, need: np.ndarray) -> None:
        """A call's start: the clock ticks, its pages' counts grow; refused (nothing changed) if they exceed the frames."""
        self.clock += 1
        if need.size > self.frames:
            raise DiskTierError(f"{self.flags['host_budget']}: {self.frames} host pages cannot hold the {need.size} pages "
                                "one layer's step needs; raise it")
        self._touch(need)

    def _held(self, need: np.ndarray, frames: np.ndarray, held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The call's pages already in frames counted and used now; returns the missing pages and the frames they may
        not take (the held ones), the device quiesced if any is missing."""
        self.stats["host_hits"] += int(held.sum())
        self.stats["prefetch_hits"] += int(self.prefetched[need[held]].sum())
        self.prefetched[need[held]] = False
        self.last_use[frames[held]] = self.clock
        keep = np.zeros(self.frames, dtype=bool)
        keep[frames[held]] = True
        missing = need[~held]
        if missing.size:
            self._quiesce()
        return missing, keep

    def ensure(self, pages, dirty: bool = False) -> None:
        """Every page in `pages` in a frame before the caller reads or writes its rows (reads waited for, timed as
        exposed); dirty: the caller writes them. The pages are pinned for the call: the frames of those already in
        host memory are not taken for the others, which are read in parallel from the thread pool."""
        t0 = time.perf_counter()
        need = np.unique(np.asarray(pages, dtype=np.int64))
        self._begin(need)
        try:
            frames = self.frame_of[need]
            held = frames >= 0
            self._settle_frames(frames[held])
            part = held & ~self.valid[np.maximum(frames, 0)].all(1)
            for f, p in zip(frames[part].tolist(), need[part].tolist()):  # read in part (never changed): whole now
                self.page_in[f] = -1
                self._map(p, -1)
            held &= ~part
            missing, keep = self._held(need, frames, held)
            if missing.size:
                self._fill(self._victims(missing.size, keep), missing)
            if dirty:
                self.dirty[need] = True
        finally:
            self._publish()
            self.stats["exposed_disk_ms"] += (time.perf_counter() - t0) * 1e3

    def ensure_rows(self, layer: int, v: torch.Tensor) -> None:
        """Virtual rows v on `layer` (negative ones ignored) in frames before the caller reads them (a read-only use:
        a caller that writes rows takes whole pages with `ensure`). A page in a frame serves the rows it holds; a page
        out of the frames takes one (free, then by the placement; pages of this call pinned) and, like the rows a
        held page lacks, reads only the sectors that hold the rows (DiskFile.read_rows), in parallel from the thread
        pool, waited for (exposed). A page never written enters whole (zeros), without I/O."""
        t0 = time.perf_counter()
        v = v.long().flatten()
        v = torch.unique(v[(v >= 0) & (v < self.V)]).cpu().numpy()  # host values: syncs, as pages() does
        page_of, row_of = layer * self.P + v // PAGE_TOKENS, v % PAGE_TOKENS
        need = np.unique(page_of)
        self._begin(need)
        try:
            frames = self.frame_of[need]
            held = frames >= 0
            self._settle_frames(frames[held])
            missing, keep = self._held(need, frames, held)
            if missing.size:
                for f, p in zip(self._victims(missing.size, keep).tolist(), missing.tolist()):
                    self._evict(f)  # usually clean: `clean` wrote changed pages in the background
                    self.frame_view(f)[:] = 0
                    self.page_in[f], self.last_use[f] = p, self.clock
                    self.valid[f] = not self.written[p]  # a page never written is whole: zeros
                    self._map(p, f)
                frames = self.frame_of[need]
            jobs = []
            for f, p in zip(frames.tolist(), need.tolist()):
                rows = np.unique(row_of[page_of == p])
                rows = rows[~self.valid[f, rows]]
                if rows.size:
                    jobs.append((f, p, rows, self.file.pool.submit(self.file.read_rows, p, rows, self.frame_view(f))))
            self._finish_row_reads(jobs)
        finally:
            self._publish()
            self.stats["exposed_disk_ms"] += (time.perf_counter() - t0) * 1e3

    def _finish_row_reads(self, jobs: list) -> None:
        """Wait for ensure_rows' reads. A row whose CRC fails is refused (its page leaves the frame, as a failed page
        read leaves its page on disk), or, quarantining, enters zeroed and lost; the first failure raises after every
        other read is in place."""
        failed = None
        for f, p, rows, fut in jobs:
            try:
                nbytes, bad = fut.result()
            except DiskTierError as e:  # a short read: nothing of it copied
                failed = failed or e
                if not self.valid[f].any():  # the page leaves the frame it just took; rows read before stay
                    self.page_in[f] = -1
                    self._map(p, -1)
                continue
            self.stats["row_reads"] += 1
            self.stats["disk_faults"] += 1
            self.stats["sector_bytes_read"] += nbytes
            self.stats["row_bytes_used"] += rows.size * layout.LATENT_ROW_BYTES
            if bad.size:
                message = (f"{self.flags['disk_dir']}: page {p} of {self.file.path} fails its checksum (the file was "
                           f"changed under the tier; rows {bad.tolist()[:8]})")
                if not self.quarantine:
                    failed = failed or PageChecksumError(message, p)
                    self.valid[f, rows] = False
                    if not self.valid[f].any():
                        self.page_in[f] = -1
                        self._map(p, -1)
                    continue
                self.frame_view(f)[bad] = 0
                mark = self.lost.setdefault(p, np.zeros(PAGE_TOKENS, dtype=bool))
                mark[bad] = True
                self.lost_note[p] = message
                self.stats["checksum_failures"] += 1
            self.valid[f, rows] = True
        if failed is not None:
            raise failed

    def prefetch(self, pages) -> None:
        """Start reading disk pages into frames no call of this clock used (free ones, then by the placement),
        without waiting; as many as there are such frames."""
        pages = np.unique(np.asarray(pages, dtype=np.int64))
        todo = pages[(self.frame_of[pages] < 0) & self.written[pages]]
        if not todo.size:
            return
        victims = self._victims(todo.size, self.last_use >= self.clock)
        if not victims.size:
            return
        self._quiesce()
        try:
            for f, p in zip(victims.tolist(), todo.tolist()):
                self._evict(f)  # usually clean: `clean` wrote changed pages of earlier calls in the background
                view = self.frame_view(f)
                self.pending[f] = self.file.pool.submit(self.file.read, p, view)
                self.stats["disk_reads"] += 1
                self.page_in[f], self.last_use[f], self.prefetched[p] = p, self.clock, True
                self.valid[f] = True
                self._map(p, f)
        finally:
            self._publish()

    def clean(self) -> None:
        """Write changed pages that no call of this clock used, in the background."""
        frames = np.flatnonzero((self.page_in >= 0) & (self.last_use < self.clock))
        frames = frames[self.dirty[self.page_in[frames]]]
        if self.pending:
            frames = np.setdiff1d(frames, np.fromiter(self.pending, dtype=np.int64, count=len(self.pending)))
        if frames.size:
            self._quiesce()
        for f in frames.tolist():
            p = int(self.page_in[f])

            def write(page=p, view=self.frame_view(f)):
                try:
                    self.file.write(page, view)
                except DiskTierError:
                    self.dirty[page] = True  # written again before its frame is reused
                    raise
                self.written[page] = True

            self.dirty[p] = False
            self.pending[f] = self.file.pool.submit(write)
            self.stats["disk_writes"] += 1

    # -- lost rows (quarantine) -----------------------------------------------------------------------------------
    def _quarantine(self, p: int, message: str) -> None:
        """A whole page read back changed entered its frame zeroed: every row of it is lost."""
        self.lost[p] = np.ones(PAGE_TOKENS, dtype=bool)
        self.lost_note[p] = message
        self.stats["checksum_failures"] += 1

    def _lost_index(self, layer: int, v: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pages, rows within them, lost mask) of virtual rows v on `layer` (host values: syncs)."""
        v = v.long().flatten().cpu().numpy()
        ok = (v >= 0) & (v < self.V)
        p = np.where(ok, layer * self.P + v // PAGE_TOKENS, -1)
        r = np.where(ok, v % PAGE_TOKENS, 0)
        mask = np.zeros(p.shape, dtype=bool)
        if self.lost:
            pages = np.array(sorted(self.lost), dtype=np.int64)
            rows = np.stack([self.lost[q] for q in pages.tolist()])  # [lost pages, 64]
            at = np.minimum(np.searchsorted(pages, p), pages.size - 1)
            hit = pages[at] == p
            mask[hit] = rows[at[hit], r[hit]]
        return p, r, mask

    def lost_rows(self, layer: int, v: torch.Tensor) -> np.ndarray:
        """Which of virtual rows v (flattened) on `layer` are lost."""
        return self._lost_index(layer, v)[2]

    def lost_state(self, layer: int, v: torch.Tensor) -> tuple[np.ndarray | None, str]:
        """(lost mask, message) of virtual rows v on `layer`, for a copy of them (`rewritten(..., lost, note)`);
        (None, "") while no row is lost."""
        if not self.lost:
            return None, ""
        p, _, mask = self._lost_index(layer, v)
        return mask, (self.lost_note[int(p[mask][0])] if mask.any() else "")

    def check_read(self, layer: int, v: torch.Tensor, reader: torch.Tensor) -> None:
        """The caller reads virtual rows v on `layer` for readers `reader` (same shape): each reader of a lost row is
        charged in `lost_reads` with the failure's message. Nothing to do, and no sync, while no row is lost."""
        if not self.lost:
            return
        p, _, mask = self._lost_index(layer, v)
        readers = reader.expand_as(v).flatten().cpu().numpy()
        for who, page in zip(readers[mask].tolist(), p[mask].tolist()):
            self.lost_reads.setdefault(int(who), self.lost_note[page])

    def rewritten(self, layer: int, v: torch.Tensor, lost: np.ndarray | None = None, note: str = "") -> None:
        """Virtual rows v on `layer` were written: no longer lost, or lost again where `lost` (a copy of lost rows,
        `note` its message)."""
        if not self.lost and (lost is None or not lost.any()):
            return
        p, r, _ = self._lost_index(layer, v)
        again = (p >= 0) & (lost if lost is not None else False)  # rows copied lost
        touched = (np.isin(p, np.fromiter(self.lost, dtype=np.int64, count=len(self.lost))) & (p >= 0)) | again
        for page in np.unique(p[touched]).tolist():  # a loop over the few pages with lost rows, not over rows
            at = p == page
            mark = self.lost.get(page)
            if mark is None:
                mark = self.lost[page] = np.zeros(PAGE_TOKENS, dtype=bool)
            mark[r[at & ~again]] = False
            mark[r[at & again]] = True
            if again[at].any():
                self.lost_note[page] = note
            if not mark.any():
                del self.lost[page], self.lost_note[page]

    # -- accounting ------------------------------------------------------------------------------------------------
    def host_pages(self) -> int:
        return int((self.page_in >= 0).sum())

    def disk_pages(self) -> int:
        """Pages whose only copy is on disk."""
        return int((self.written & (self.frame_of < 0)).sum())

    def check(self) -> None:
        """Host plus disk hold every page ever written: none out of the frames has changes the file lacks, and the
        device map agrees with the host's."""
        lost = np.flatnonzero((self.frame_of < 0) & self.dirty)
        if lost.size:
            raise AssertionError(f"disk tier lost pages {lost[:8].tolist()}")
        if not np.array_equal(self.frame_map.flatten().cpu().numpy(), self.frame_of):
            raise AssertionError("disk tier: the device page map differs from the host's")

    def report(self) -> dict:
        try:
            for f in list(self.pending):
                self._settle(f)
        finally:
            self._publish()
        used = self.stats["row_bytes_used"]
        return {"host_pages": self.host_pages(), "disk_pages": self.disk_pages(), "frames": self.frames,
                "page_bytes": PAGE_BYTES, "direct_io": self.file.direct, "lost_pages": len(self.lost), **self.stats,
                "exposed_disk_ms": round(self.stats["exposed_disk_ms"], 3),
                "read_amplification": round(self.stats["sector_bytes_read"] / used, 3) if used else None}

    def close(self) -> None:
        for f in list(self.pending):
            try:
                self._settle(f)
            except DiskTierError:
                pass
        self.file.close()
