"""Page reads and writes on this machine's disk against the page size: what a disk tier under ESS's host pool
(issue 19, KVDrive's idea) could move. Direct I/O (O_DIRECT, 4 KiB-aligned buffers from mmap), random page offsets
in one file, from a pool of threads (os.pread / os.pwrite release the GIL).

    python benchmark/disk_pages.py --dir /path/on/the/disk --out benchmark/results/disk/<machine>.json
    python benchmark/disk_pages.py --smoke --dir /tmp --out /tmp/disk.json   # a few MiB: checks the script

Page sizes: one layer's 64-token page of latent rows (64 x 656 B = 41,984 B, padded to 45,056 = 11 x 4 KiB for direct
I/O), 4 and 16 such pages, and one 64-token page of all 61 layers (2,561,024 B, padded to 2,564,096).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import platform
import random
import sys
import time

ALIGN = 4096
LAYER_PAGE = 64 * 656  # one layer's 64-token page of latent rows


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


PAGE_SIZES = {"1 layer-page": padded(LAYER_PAGE), "4 layer-pages": padded(4 * LAYER_PAGE),
              "16 layer-pages": padded(16 * LAYER_PAGE), "61 layer-pages (all layers)": padded(61 * LAYER_PAGE)}


def run_case(path: str, file_bytes: int, page: int, threads: int, ops: int, write: bool, seed: int) -> dict:
    """`ops` random page reads or writes of `page` bytes with `threads` threads; returns MB/s and ops/s."""
    pages = file_bytes // page
    rng = random.Random(seed)
    offsets = [rng.randrange(pages) * page for _ in range(ops)]
    flags = (os.O_WRONLY if write else os.O_RDONLY) | os.O_DIRECT
    fd = os.open(path, flags)
    bufs = [mmap.mmap(-1, page) for _ in range(threads)]  # page-aligned, as direct I/O needs
    for b in bufs:
        b.write(os.urandom(page))

    def work(i: int) -> None:
        buf = bufs[i]
        for off in offsets[i::threads]:
            n = os.pwrite(fd, buf, off) if write else os.preadv(fd, [buf], off)
            if n != page:
                raise OSError(f"short {'write' if write else 'read'}: {n} of {page} bytes at {off}")

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))
    if write:
        os.fsync(fd)
    dt = time.perf_counter() - t0
    os.close(fd)
    return {"op": "write" if write else "read", "page_bytes": page, "threads": threads, "ops": ops,
            "seconds": round(dt, 4), "mb_per_s": round(ops * page / dt / 1e6, 1), "ops_per_s": round(ops / dt, 1)}


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())


def mount_of(path: str) -> dict:
    """The mount holding path (device, filesystem type), from /proc/mounts."""
    path = os.path.realpath(path)
    best = {"device": "?", "mount": "/", "type": "?"}
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best["mount"]):
                best = {"device": dev, "mount": mnt, "type": fstype}
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="a folder on the disk to measure (a scratch file is made and removed)")
    p.add_argument("--out", required=True, help="JSON results")
    p.add_argument("--file-mib", type=int, default=4096, help="scratch file size (larger than the page cache helps "
                                                              "nothing here: direct I/O bypasses it)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--mib-per-case", type=int, default=256, help="bytes moved per case")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script")
    args = p.parse_args(argv)
    if args.smoke:
        args.file_mib, args.threads, args.mib_per_case = 16, [1, 2], 4
    path = os.path.join(args.dir, f"ess_disk_pages_{os.getpid()}.bin")
    file_bytes = args.file_mib << 20
    try:
        chunk = mmap.mmap(-1, 1 << 20)
        chunk.write(os.urandom(1 << 20))
        try:
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        except OSError as e:  # tmpfs and some overlays refuse direct I/O
            raise SystemExit(f"--dir {args.dir}: direct I/O (O_DIRECT) refused there ({e.strerror}); give a folder on a disk")
        for off in range(0, file_bytes, 1 << 20):
            os.pwrite(fd, chunk, off)
        os.fsync(fd)
        os.close(fd)
        rows = []
        for name, page in PAGE_SIZES.items():
            ops = max(8, (args.mib_per_case << 20) // page)
            for threads in args.threads:
                for write in (False, True):
                    row = {"page": name, **run_case(path, file_bytes, page, threads, ops, write, seed=threads)}
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    rows.append(row)
    finally:
        if os.path.exists(path):
            os.remove(path)
    st = os.statvfs(args.dir)
    doc = {"cpu": cpu_model(), "cpus": os.cpu_count(), "disk": mount_of(args.dir),
           "platform": platform.platform(), "date": time.strftime("%Y-%m-%d"), "dir": args.dir,
           "filesystem_free_gib": round(st.f_bavail * st.f_frsize / (1 << 30), 1), "file_mib": args.file_mib,
           "io": "O_DIRECT, random page offsets, os.pread/pwrite from a thread pool; writes end with fsync",
           "command": "python benchmark/disk_pages.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
