"""The disk tier's host-side cost per call (ess.core.disk_tier.PagedHostTier.ensure), on this machine's disk: a call
whose pages are all in host memory (the common case of a step), one whose pages were never written (a prefill), and
one whose pages are all on disk with changed pages to write out first (the worst case of a step).

    python benchmark/disk_tier_calls.py --dir /path/on/the/disk --out benchmark/results/disk/tier_calls_<machine>.json
    python benchmark/disk_tier_calls.py --smoke --dir /tmp --out /tmp/tier_calls.json   # small: checks the script
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import time

import numpy as np

from ess.core.disk_tier import PAGE_BYTES, PagedHostTier


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def one_run(directory: str, pages: int) -> dict:
    """Times in ms of the three calls over `pages` pages, in frames for 2 x pages over 4 x pages of virtual rows."""
    # "lru": the first pages, used twice, must leave for the later ones (by frequency they would stay)
    t = PagedHostTier(1, 4 * pages * 64, 2 * pages * PAGE_BYTES, directory, placement="lru")
    try:
        first = np.arange(pages)
        fresh = timed(lambda: t.ensure(first, dirty=True))
        held = timed(lambda: t.ensure(first))
        for j in range(pages, 4 * pages, pages):  # fill the frames with changed pages, pushing the first ones to disk
            t.ensure(np.arange(j, j + pages), dirty=True)
        t.clock += 1
        faults = timed(lambda: t.ensure(first))  # all on disk, and every frame they take holds a changed page
        assert t.stats["disk_faults"] == pages
        return {"fresh_ms": fresh, "held_ms": held, "faults_ms": faults, "direct_io": t.file.direct}
    finally:
        t.close()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure")
    ap.add_argument("--pages", type=int, default=2000, help="pages per call (default 2000: 82 MB)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="64 pages, one run")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    pages, runs = (64, 1) if a.smoke else (a.pages, a.runs)
    results = [one_run(a.dir, pages) for _ in range(runs)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "command": "python benchmark/disk_tier_calls.py " + " ".join(argv or []),
        "machine": platform.node(), "cpu": platform.processor() or platform.machine(), "commit": commit,
        "date": datetime.date.today().isoformat(), "pages_per_call": pages, "page_bytes": PAGE_BYTES, "runs": results,
        "median_ms": {k: round(statistics.median(r[k] for r in results), 2) for k in ("fresh_ms", "held_ms", "faults_ms")},
    }
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report["median_ms"]))
    return report


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
