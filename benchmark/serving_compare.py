"""Turns the JSONL results of `python -m sglang.benchmark.serving --output-file F --tag SYSTEM` (one line per run)
into a CSV and a PNG comparing baseline, HiSparse and ESS: output throughput, TPOT, ITL and TTFT vs max concurrency.

    python benchmark/serving_compare.py results.jsonl --out benchmark/results/serving/compare
"""

from __future__ import annotations

import argparse
import csv
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METRICS = [("output_throughput", "output tok/s"), ("mean_tpot_ms", "TPOT ms"), ("mean_itl_ms", "ITL ms"), ("mean_ttft_ms", "TTFT ms")]
COLUMNS = ["tag", "max_concurrency"] + [m for m, _ in METRICS]


def load_rows(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not a JSON line ({e})")
            missing = [c for c in COLUMNS if r.get(c) is None]
            if missing:
                raise SystemExit(f"{path}:{n}: missing {missing} (run sglang.benchmark.serving with --tag and --max-concurrency)")
            rows.append({c: r[c] for c in COLUMNS})
    if not rows:
        raise SystemExit(f"{path}: no results")
    return sorted(rows, key=lambda r: (r["tag"], r["max_concurrency"]))


def write(rows: list[dict], out: str) -> tuple[str, str]:
    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 3.6))
    for ax, (metric, label) in zip(axes, METRICS):
        for tag in sorted({r["tag"] for r in rows}):
            pts = [(r["max_concurrency"], r[metric]) for r in rows if r["tag"] == tag]
            ax.plot(*zip(*pts), marker="o", label=tag)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)
    plt.close(fig)
    return out + ".csv", out + ".png"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl")
    ap.add_argument("--out", required=True, help="output path without extension (.csv and .png are written)")
    a = ap.parse_args(argv)
    for p in write(load_rows(a.jsonl), a.out):
        print(p)


if __name__ == "__main__":
    main()
