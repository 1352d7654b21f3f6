"""The disk tier's page file (ess.core.disk_tier; docs/design.md, "Disk tier"): page i at offset i x DISK_PAGE, a page
being one layer's 64 latent rows (64 x 656 = 41,984 bytes) in 45,056 bytes, 4 KiB-aligned for direct I/O. The file is
preallocated, so a full disk shows at start, and unlinked once open, so it goes with the process however it ends.

Reads and writes are direct I/O (O_DIRECT, buffered where the file system refuses it), run from the file's thread
pool. Every page on disk carries, in its alignment padding, the CRC-32 of its rows and its own page number, and the
file keeps each row's CRC-32 (seeded with the row's place) in host memory for the reads of single rows, which read
only the 4 KiB sectors that hold them: a page or row read back changed, or from another place, is refused naming the
file and the page.
"""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import zlib

import numpy as np

from ess.core import layout
from ess.core.settings import DISK_PAGE_BYTES, PAGE_TOKENS, KnobError, check_disk_dir

PAGE_BYTES = PAGE_TOKENS * layout.LATENT_ROW_BYTES
DISK_PAGE = DISK_PAGE_BYTES  # PAGE_BYTES, 4 KiB-aligned for direct I/O
IO_THREADS = 8
SECTOR = 4096  # the unit of a direct-I/O read
SEAL = np.dtype([("crc", "<u4"), ("page", "<u4")])  # after a page's rows, in its alignment padding
assert DISK_PAGE - PAGE_BYTES >= SEAL.itemsize, "a disk page's padding holds its seal"


class DiskTierError(RuntimeError):
    """A disk-tier setting or an I/O fault; the message names the flag. Nothing was lost: every page is in a frame or
    in the file as before the call."""


class PageChecksumError(DiskTierError):
    """A page read back from the file is not the page written there (its checksum or its page number differ)."""

    def __init__(self, message: str, page: int):
        super().__init__(message)
        self.page = page


def free_disk_bytes(directory: str) -> int:
    """Bytes an unprivileged process may still write in `directory`'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class DiskFile:
    """The pages of the tier's file: page i at offset i x DISK_PAGE. Preallocated, so a full disk shows at start."""

    def __init__(self, directory: str, pages: int, budget_bytes: int | None, flags: dict):
        self.flags = flags
        need = pages * DISK_PAGE
        if budget_bytes is not None and need > budget_bytes:
            raise DiskTierError(f"{flags['disk_gib']} {budget_bytes / 2**30:.3g}: the batch needs {need / 2**30:.3g} GiB "
                                f"on disk ({pages} pages of {DISK_PAGE} bytes)")
        try:
            check_disk_dir(directory, flags["disk_dir"])
        except KnobError as e:
            raise DiskTierError(str(e)) from e
        path = os.path.join(directory, f"ess_tier_{os.getpid()}_{id(self):x}.pages")
        self.path = path  # for messages: the file is unlinked once open
        self.direct = True
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise DiskTierError(f"{flags['disk_dir']} {directory}: cannot create the page file ({e.strerror})") from e
            self.direct = False  # the file system refuses direct I/O (tmpfs): buffered I/O
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)  # the open descriptor keeps the pages: the file goes with the process, however it ends
        self.row_crc = np.zeros((pages, PAGE_TOKENS), dtype=np.uint32)  # each written row's CRC, for read_rows
        try:
            os.posix_fallocate(self.fd, 0, need)
        except OSError as e:
            self.close()
            raise DiskTierError(f"{flags['disk_dir']} {directory}: cannot hold {need / 2**30:.3g} GiB of pages "
                                f"({e.strerror}); free space or give another directory") from e
        self.pool = concurrent.futures.ThreadPoolExecutor(IO_THREADS)

    def _buffer(self) -> mmap.mmap:
        return mmap.mmap(-1, DISK_PAGE)  # page-aligned, as direct I/O needs

    @staticmethod
    def _row_crc(page: int, row: int, data) -> int:
        """A row's CRC-32 seeded with its place: the same bytes read from another row or page do not match."""
        return zlib.crc32(data, (page * PAGE_TOKENS + row) & 0xFFFFFFFF)

    def write(self, page: int, data: np.ndarray) -> None:
        buf = self._buffer()
        rows = data.tobytes()
        row_bytes = layout.LATENT_ROW_BYTES
        crcs = [self._row_crc(page, r, rows[r * row_bytes:(r + 1) * row_bytes]) for r in range(PAGE_TOKENS)]
        buf[:PAGE_BYTES] = rows
        buf[PAGE_BYTES:PAGE_BYTES + SEAL.itemsize] = np.array([(zlib.crc32(rows), page)], dtype=SEAL).tobytes()
        n = os.pwrite(self.fd, buf, page * DISK_PAGE)
        if n != DISK_PAGE:
            raise DiskTierError(f"{self.flags['disk_dir']}: short write of page {page} ({n} of {DISK_PAGE} bytes); "
                                "the page stays in host memory")
        self.row_crc[page] = crcs

    def read(self, page: int, out: np.ndarray) -> None:
        buf = self._buffer()
        n = os.preadv(self.fd, [buf], page * DISK_PAGE)
        if n != DISK_PAGE:
            raise DiskTierError(f"{self.flags['disk_dir']}: short read of page {page} ({n} of {DISK_PAGE} bytes); "
                                "the page stays on disk")
        rows = buf[:PAGE_BYTES]
        seal = np.frombuffer(buf, dtype=SEAL, count=1, offset=PAGE_BYTES)[0]
        if int(seal["page"]) != page or int(seal["crc"]) != zlib.crc32(rows):
            raise PageChecksumError(f"{self.flags['disk_dir']}: page {page} of {self.path} fails its checksum (the "
                                    "file was changed under the tier)", page)
        out[:] = np.frombuffer(rows, dtype=np.uint8).reshape(out.shape)

    def read_rows(self, page: int, rows: np.ndarray, out: np.ndarray) -> tuple[int, np.ndarray]:
        """Rows `rows` (indices within the page) of a written page into out[rows] (out: the page's [64, 656] frame
        view), reading only the 4 KiB sectors that hold them, each run of adjacent sectors in one read. Returns
        (bytes read, the rows whose CRC fails: they are not copied). A short read raises, nothing copied."""
        row_bytes = layout.LATENT_ROW_BYTES
        start = rows.astype(np.int64) * row_bytes
        need = np.zeros(DISK_PAGE // SECTOR, dtype=bool)
        for first, last in zip((start // SECTOR).tolist(), ((start + row_bytes - 1) // SECTOR).tolist()):
            need[first:last + 1] = True
        edges = np.flatnonzero(np.diff(np.concatenate([[0], need.astype(np.int8), [0]])))  # run starts and ends
        data = np.zeros(DISK_PAGE, dtype=np.uint8)
        read = 0
        for a, b in zip(edges[::2].tolist(), edges[1::2].tolist()):
            buf = mmap.mmap(-1, (b - a) * SECTOR)  # page-aligned, as direct I/O needs
            n = os.preadv(self.fd, [buf], page * DISK_PAGE + a * SECTOR)
            if n != len(buf):
                raise DiskTierError(f"{self.flags['disk_dir']}: short read of page {page} ({n} of {len(buf)} bytes "
                                    f"at sector {a}); the page stays on disk")
            data[a * SECTOR:b * SECTOR] = np.frombuffer(buf, dtype=np.uint8)
            read += n
        got = data[:PAGE_BYTES].reshape(PAGE_TOKENS, row_bytes)
        bad = np.array([self._row_crc(page, r, got[r].tobytes()) != self.row_crc[page, r] for r in rows.tolist()],
                       dtype=bool).reshape(-1)
        good = rows[~bad]
        out[good] = got[good]
        return read, rows[bad]

    def close(self) -> None:
        if getattr(self, "pool", None) is not None:
            self.pool.shutdown(wait=True)
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None
