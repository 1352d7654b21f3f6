"""A disk tier under the reference's host pool (KVDrive's idea; docs/design.md, "Disk tier"): a budget of host frames
holds the latent pages in use, a file on local disk holds the others. Host plus disk hold every page at every step.

Page unit: one layer's 64-token page (64 x 656 = 41,984 bytes, 45,056 on disk for 4 KiB-aligned direct I/O). The
indexer picks each layer's top-k independently, so a step's misses on one layer share few pages with another layer's:
a page of all layers would read 61 layers' rows for one layer's miss.

Frames are shared by all layers (a layer's step may use most of them), recycled least recently used first; a page the
current step uses is pinned. A page enters a frame from disk (a read, waited for: exposed), or empty (never written);
a frame leaves with a write of its page if the page changed since its last write. After each layer's step the tier
writes changed pages in the background and prefetches, for the next layer, the disk pages its last step selected,
into frames that nothing pinned holds. The reads and writes are direct I/O (O_DIRECT, falling back to buffered
where the file system refuses it) from a thread pool.

The serving cache addresses host rows through per-layer tables (position -> frame row, the sink row while on disk);
`rows_table(layer)` is what ess.core.serving reads, and `data` views the frames once per layer (all layers alias
them), so ess.core's FlashTrans gathers and scatters work unchanged.
"""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import time

import numpy as np
import torch

from ess.core import layout
from ess.core.pinned import pinned_zeros
from ess.core.settings import DISK_PAGE_BYTES, PAGE_TOKENS

PAGE_BYTES = PAGE_TOKENS * layout.LATENT_ROW_BYTES
DISK_PAGE = DISK_PAGE_BYTES  # PAGE_BYTES, 4 KiB-aligned for direct I/O
IO_THREADS = 8


class DiskTierError(RuntimeError):
    """A disk-tier setting or an I/O fault; the message names the flag. Nothing was lost: every page is in a frame or
    in the file as before the call."""


class DiskFile:
    """The pages of the tier's file: page i at offset i x DISK_PAGE. Preallocated, so a full disk shows at start."""

    def __init__(self, directory: str, pages: int, budget_bytes: int | None, flags: dict):
        self.flags = flags
        need = pages * DISK_PAGE
        if budget_bytes is not None and need > budget_bytes:
            raise DiskTierError(f"{flags['disk_gib']} {budget_bytes / 2**30:.3g}: the batch needs {need / 2**30:.3g} GiB "
                                f"on disk ({pages} pages of {DISK_PAGE} bytes)")
        if not os.path.isdir(directory):
            raise DiskTierError(f"{flags['disk_dir']} {directory}: no such directory")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise DiskTierError(f"{flags['disk_dir']} {directory}: not writable")
        self.path = os.path.join(directory, f"ess_tier_{os.getpid()}_{id(self):x}.pages")
        self.direct = True
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise DiskTierError(f"{flags['disk_dir']} {directory}: cannot create the page file ({e.strerror})") from e
            self.direct = False  # the file system refuses direct I/O (tmpfs): buffered I/O
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(self.fd, 0, need)
        except OSError as e:
            self.close()
            raise DiskTierError(f"{flags['disk_dir']} {directory}: cannot hold {need / 2**30:.3g} GiB of pages "
                                f"({e.strerror}); free space or give another directory") from e
        self.pool = concurrent.futures.ThreadPoolExecutor(IO_THREADS)

    def _buffer(self) -> mmap.mmap:
        return mmap.mmap(-1, DISK_PAGE)  # page-aligned, as direct I/O needs

    def write(self, page: int, data: np.ndarray) -> None:
        buf = self._buffer()
        buf[:PAGE_BYTES] = data.tobytes()
        n = os.pwrite(self.fd, buf, page * DISK_PAGE)
        if n != DISK_PAGE:
            raise DiskTierError(f"{self.flags['disk_dir']}: short write of page {page} ({n} of {DISK_PAGE} bytes); "
                                "the page stays in host memory")

    def read(self, page: int, out: np.ndarray) -> None:
        buf = self._buffer()
        n = os.preadv(self.fd, [buf], page * DISK_PAGE)
        if n != DISK_PAGE:
            raise DiskTierError(f"{self.flags['disk_dir']}: short read of page {page} ({n} of {DISK_PAGE} bytes); "
                                "the page stays on disk")
        out[:] = np.frombuffer(buf, dtype=np.uint8, count=PAGE_BYTES).reshape(out.shape)

    def close(self) -> None:
        if getattr(self, "pool", None) is not None:
            self.pool.shutdown(wait=True)
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None
            os.unlink(self.path)


class TieredHostPool:
    """The latent rows of `batch` requests of up to `max_len` positions on `num_layers` layers, in `frames` host
    frames of one page and a disk file for the rest."""

    FLAGS = {"host_budget": "--host-budget-mib", "disk_dir": "--disk-dir", "disk_gib": "--disk-gib"}

    def __init__(self, num_layers: int, batch: int, max_len: int, host_budget_bytes: int, disk_dir: str,
                 disk_bytes: int | None = None, device: torch.device | str = "cpu", flags: dict = FLAGS):
        self.L, self.B, self.flags = num_layers, batch, flags
        self.J = -(-max_len // PAGE_TOKENS)  # pages per request and layer
        self.frames = int(host_budget_bytes // PAGE_BYTES)
        if self.frames < 1:
            raise DiskTierError(f"{flags['host_budget']}: {host_budget_bytes} bytes hold no {PAGE_BYTES}-byte page")
        self.file = DiskFile(disk_dir, num_layers * batch * self.J, disk_bytes, flags)
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        rows = self.frames * PAGE_TOKENS
        self.frame_rows = pinned_zeros((rows + 1, layout.LATENT_ROW_BYTES), pin=pin)  # + the sink row
        self.sink = rows
        # the host pool as ess.core sees it: [layers, rows + 1, 656], every layer a view of the same frames
        self.data = self.frame_rows.as_strided((num_layers, rows + 1, layout.LATENT_ROW_BYTES),
                                               (0, layout.LATENT_ROW_BYTES, 1))
        self.tables = torch.full((num_layers, batch, self.J * PAGE_TOKENS), self.sink, dtype=torch.int64, device=device)
        n = num_layers * batch * self.J
        self.frame_of = np.full(n, -1, dtype=np.int64)  # page -> frame
        self.page_in = np.full(self.frames, -1, dtype=np.int64)  # frame -> page
        self.last_use = np.zeros(self.frames, dtype=np.int64)
        self.written = np.zeros(n, dtype=bool)  # the file holds the page's rows
        self.dirty = np.zeros(n, dtype=bool)  # the frame's rows are newer than the file's
        self.pending: dict[int, concurrent.futures.Future] = {}  # frame -> its read or write in flight
        self.prefetched = np.zeros(n, dtype=bool)  # in a frame by prefetch, not used since
        self.clock = 0
        self.stats = {"disk_reads": 0, "disk_writes": 0, "prefetch_hits": 0, "exposed_disk_ms": 0.0}

    # -- addressing -------------------------------------------------------------------------------------------------
    def page(self, layer: int, b, j):
        return (layer * self.B + b) * self.J + j

    def rows_table(self, layer: int) -> torch.Tensor:
        """[B, positions] host row of each (request, position) on `layer`: its frame's row, or the sink row."""
        return self.tables[layer]

    def frame_view(self, f: int) -> np.ndarray:
        return self.frame_rows[f * PAGE_TOKENS : (f + 1) * PAGE_TOKENS].numpy()

    def _map(self, p: int, f: int | None) -> None:
        layer, rest = divmod(p, self.B * self.J)
        b, j = divmod(rest, self.J)
        cols = slice(j * PAGE_TOKENS, (j + 1) * PAGE_TOKENS)
        if f is None:
            self.tables[layer, b, cols] = self.sink
        else:
            self.tables[layer, b, cols] = torch.arange(f * PAGE_TOKENS, (f + 1) * PAGE_TOKENS, device=self.device)

    # -- frames ------------------------------------------------------------------------------------------------------
    def _settle(self, f: int) -> None:
        fut = self.pending.pop(f, None)
        if fut is not None:
            fut.result()  # a fault raises here (DiskTierError), the page's state unchanged by the failed I/O

    def _free_frame(self, pinned: set[int]) -> int:
        """A frame for a new page: a free one, else the least recently used unpinned one (its page written first if
        it changed)."""
        free = np.flatnonzero(self.page_in < 0)
        if free.size:
            return int(free[0])
        order = np.argsort(self.last_use, kind="stable")
        for f in order:
            f = int(f)
            if f not in pinned:
                self._evict(f)
                return f
        raise DiskTierError(f"{self.flags['host_budget']}: {self.frames} host pages cannot hold the {len(pinned)} "
                            "pages one layer's step needs; raise it")

    def _evict(self, f: int) -> None:
        self._settle(f)
        p = int(self.page_in[f])
        if self.dirty[p]:
            self.file.write(p, self.frame_view(f))
            self.stats["disk_writes"] += 1
            self.written[p], self.dirty[p] = True, False
        self.frame_of[p], self.page_in[f], self.prefetched[p] = -1, -1, False
        self._map(p, None)

    def _load(self, p: int, pinned: set[int], wait: bool) -> int:
        """Page p into a frame (read from disk if it was ever written). Returns the frame."""
        f = self._free_frame(pinned)
        self.page_in[f], self.frame_of[p] = p, f
        if self.written[p]:
            view = self.frame_view(f)

            def read(page=p, out=view):
                self.file.read(page, out)

            self.stats["disk_reads"] += 1
            if wait:
                try:
                    read()
                except DiskTierError:
                    self.page_in[f], self.frame_of[p] = -1, -1  # nothing lost: the page is still on disk
                    raise
            else:
                self.pending[f] = self.file.pool.submit(read)
        else:
            self.frame_view(f)[:] = 0  # a page never written: nothing to read
        self._map(p, f)
        return f

    def ensure(self, pages) -> None:
        """Every page in `pages` in a frame before the caller reads or writes its rows (reads waited for, timed as
        exposed). The pages are pinned for the call."""
        t0 = time.perf_counter()
        self.clock += 1
        need = sorted({int(p) for p in pages})
        pinned = {int(self.frame_of[p]) for p in need if self.frame_of[p] >= 0}
        for p in need:
            f = int(self.frame_of[p])
            if f < 0:
                f = self._load(p, pinned, wait=True)
            else:
                self._settle(f)
                if self.prefetched[p]:
                    self.stats["prefetch_hits"] += 1
                    self.prefetched[p] = False
            pinned.add(f)
            self.last_use[f] = self.clock
        self.stats["exposed_disk_ms"] += (time.perf_counter() - t0) * 1e3

    def prefetch(self, pages) -> None:
        """Start reading disk pages into frames no recent use holds (the least recently used), without waiting."""
        recent = {int(f) for f in np.flatnonzero(self.last_use >= self.clock)}
        for p in sorted({int(p) for p in pages}):
            if self.frame_of[p] < 0 and self.written[p]:
                try:
                    f = self._load(p, recent, wait=False)
                except DiskTierError:
                    return  # every frame is in recent use: no room to prefetch into
                self.prefetched[p] = True
                self.last_use[f] = self.clock  # recent, so that later prefetches keep it
                recent.add(f)

    def clean(self) -> None:
        """Write changed pages that no step of this clock used, in the background."""
        for f in np.flatnonzero((self.page_in >= 0) & (self.last_use < self.clock)):
            f = int(f)
            p = int(self.page_in[f])
            if self.dirty[p] and f not in self.pending:
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

    # -- the host pool's interface (ess.reference.ess_cache) -------------------------------------------------------------
    def pages_of(self, layer: int, b: torch.Tensor, pos: torch.Tensor) -> np.ndarray:
        """The pages of positions pos [N, ...] (-1 ignored) of requests b [N] on `layer` (host values)."""
        pos = pos.reshape(pos.shape[0], -1).cpu()
        b = b.reshape(-1, 1).cpu().expand_as(pos)
        keep = pos >= 0
        return np.unique(self.page(layer, b[keep].numpy(), (pos[keep] // PAGE_TOKENS).numpy()))

    def mark_written(self, layer: int, b: torch.Tensor, pos: torch.Tensor) -> None:
        """Rows at these positions were written into their frames: their pages changed."""
        self.dirty[self.pages_of(layer, b, pos)] = True

    def write(self, layer: int, b: int, pos: torch.Tensor, rows: torch.Tensor) -> None:
        """Bulk write (prefill): rows [N, 656] at positions pos [N] of request b, a page at a time (so a prompt larger
        than the frames passes through them to disk)."""
        for j in range(int(pos.min()) // PAGE_TOKENS, int(pos.max()) // PAGE_TOKENS + 1):
            sel = (pos // PAGE_TOKENS) == j
            p = self.page(layer, b, j)
            self.ensure([p])
            f = int(self.frame_of[p])
            self.frame_rows[f * PAGE_TOKENS + pos[sel].cpu() % PAGE_TOKENS] = rows[sel].cpu()
            self.dirty[p] = True

    def host_pages(self) -> int:
        return int((self.page_in >= 0).sum())

    def disk_pages(self) -> int:
        """Pages whose only copy is on disk."""
        return int((self.written & (self.frame_of < 0)).sum())

    def check(self) -> None:
        """Host plus disk hold every page ever written: none out of the frames has changes the file lacks."""
        lost = np.flatnonzero((self.frame_of < 0) & self.dirty)
        if lost.size:
            raise AssertionError(f"disk tier lost pages {lost[:8].tolist()}")

    def report(self) -> dict:
        for f in list(self.pending):
            self._settle(f)
        return {"host_pages": self.host_pages(), "disk_pages": self.disk_pages(), "frames": self.frames,
                "page_bytes": PAGE_BYTES, "direct_io": self.file.direct, **self.stats,
                "exposed_disk_ms": round(self.stats["exposed_disk_ms"], 3)}

    def close(self) -> None:
        for f in list(self.pending):
            try:
                self._settle(f)
            except DiskTierError:
                pass
        self.file.close()
