"""`ess sim run | paper | sweep | calibrate` (the decode simulator; `ess sim pd` is cmd_sim_pd's), and the simulator's
options that `ess plan` shares."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from ess.cli import cmd_sim_pd
from ess.cli.common import (JSON_HELP, NON_NEGATIVE, POSITIVE, add_force, emit, out, output, output_file,
                            positive_float, say)

SWEEP_BATCH_MAX = 192


def add_sim_args(p, profile: bool = True) -> None:
    p.add_argument("--model", default="dsv32", choices=["dsv32", "dsv3"])
    p.add_argument("--hardware", default="H200", help="H20, H20-141G, H800, H100, H200, B200 (ess/analysis/sim/data/hardware.json)")
    p.add_argument("--context", type=POSITIVE, default=32768, help="KV length per request")
    p.add_argument("--mtp", type=NON_NEGATIVE, default=2, help="MTP draft tokens per step")
    p.add_argument("--accept", type=positive_float, default=1.7, help="mean tokens accepted per step (1 .. mtp + 1)")
    p.add_argument("--ep", type=POSITIVE, default=32, help="expert-parallel GPUs")
    p.add_argument("--tbo", action=argparse.BooleanOptionalAction, default=True, help="Two-Batch Overlap")
    if profile:
        p.add_argument("--profile", help="miss profile JSON from `ess profile` (default: the synthetic one)")
    add_measured(p)
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def add_measured(p) -> None:
    p.add_argument("--measured", nargs="+", metavar="FILE",
                   help="ESS's own terms (FlashTrans by rows, LRU step, DA/DBA overhead) from a GPU run: the kit's "
                        "kit.json, then optionally bookkeeping.json, a whole-layer decode.json (the rest of a "
                        "layer, for every arm) and benchmark/indexer_kernels.py's indexer.json (the indexer's logits and "
                        "top-k, for every arm; docs/simulator.md); default: modelled")


def add_parsers(sub) -> None:
    s = sub.add_parser("sim", help="decode simulator: baseline, HiSparse-style and ESS on a GPU cluster")
    ssub = s.add_subparsers(dest="sim_command", required=True)
    run = ssub.add_parser("run", help="one configuration")
    add_sim_args(run)
    run.add_argument("--batch-size", type=POSITIVE, required=True, help="requests per GPU")
    run.add_argument("--sparse-ratio", type=positive_float, help="ESS GPU share of the latent cache (omit: baseline)")
    run.add_argument("--overlap", default="plan", choices=["none", "da", "dba", "plan"])
    run.add_argument("--disk-tier", action="store_true",
                     help="ESS's host pool holds what the host budget allows, a disk tier the rest (docs/design.md)")
    run.add_argument("--nvme-gbps", type=positive_float,
                     help="with --disk-tier: a node's NVMe read bandwidth in GB/s (default: the profile's, assumed 48)")
    run.set_defaults(func=run_one, check=check_run)
    paper = ssub.add_parser("paper", help="the ESS paper's evaluation table, predicted")
    paper.add_argument("--profile", nargs="+", metavar="FILE",
                       help="miss profiles from `ess profile`: each ESS row uses the one recorded nearest its context "
                            "(default: the synthetic one)")
    add_measured(paper)
    paper.add_argument("--json", action="store_true", help=JSON_HELP)
    paper.set_defaults(func=run_paper)
    sw = ssub.add_parser("sweep", help="throughput and OTPS against batch size, with a plot")
    add_sim_args(sw)
    sw.add_argument("--batch-min", type=POSITIVE, default=8, help="smallest batch per GPU")
    sw.add_argument("--batch-max", type=POSITIVE, help=f"largest batch per GPU (default {SWEEP_BATCH_MAX}, or fewer: as "
                                                       "many requests as the GPU holds the index-K rows of)")
    sw.add_argument("--batch-step", type=POSITIVE, default=8, help="batch increment")
    sw.add_argument("--plot", type=output_file("--plot", plot=True), help="plot path (.png, .pdf, .svg ...)")
    add_force(sw)
    sw.add_argument("--disk-tier", action="store_true", help="also ESS past its host memory wall, with a disk tier")
    sw.add_argument("--nvme-gbps", type=positive_float, help="with --disk-tier: a node's NVMe read bandwidth, GB/s")
    sw.set_defaults(func=run_sweep, check=check_sweep)
    cmd_sim_pd.add_parser(ssub)
    cal = ssub.add_parser("calibrate", help="refit the efficiency constants on the paper's baseline rows")
    cal.add_argument("--hardware", default="H200")
    cal.add_argument("--out", type=output_file("--out"), help="write the fitted constants (JSON) here; ess/analysis/sim/data/calibration.json is the file "
                                   "the simulator reads")
    cal.add_argument("--json", action="store_true", help=JSON_HELP)
    add_force(cal)
    cal.set_defaults(func=run_calibrate)


# -- checks --------------------------------------------------------------------------------------------------------
def check_sim_args(args) -> None:
    """`ess sim run | sweep` and `ess plan`: the flags the simulated model and the disk tier bound."""
    if getattr(args, "nvme_gbps", None) is not None and not getattr(args, "disk_tier", False):
        raise ValueError("--nvme-gbps is the disk tier's drive bandwidth: give --disk-tier too")
    if args.mtp >= args.context:
        raise ValueError(f"--mtp {args.mtp}: a verify step's {args.mtp} draft tokens go past the --context "
                         f"{args.context} positions they extend")
    from ess.analysis.sim.specs import get_model

    spec = get_model(args.model)
    if args.ep > spec.experts:
        raise ValueError(f"--ep {args.ep}: {args.model} has {spec.experts} routed experts; a GPU past the "
                         f"{spec.experts}th would hold none")
    if args.context > spec.max_positions:
        raise ValueError(f"--context {args.context}: {args.model} serves at most {spec.max_positions} positions")


def check_run(args) -> None:
    check_sim_args(args)
    given = [flag for flag, on in (("--disk-tier", args.disk_tier), (f"--overlap {args.overlap}", args.overlap != "plan"),
                                   ("--profile", args.profile is not None)) if on]
    if args.sparse_ratio is None and given:
        raise ValueError(f"{', '.join(given)}: ESS settings; give --sparse-ratio (without it `sim run` simulates "
                         "the baseline)")
    if args.overlap == "dba" and not args.tbo:
        raise ValueError("--overlap dba overlaps one micro-batch's transfer with the other's compute: it needs "
                         "two-batch overlap (--tbo)")


def check_sweep(args) -> None:
    check_sim_args(args)
    _check_sweep_batches(args)
    if args.disk_tier and args.model == "dsv3":
        raise ValueError("--disk-tier extends ESS, which needs sparse attention: --model dsv3 has none")
    if args.batch_min > args.batch_max:
        raise ValueError(f"--batch-min {args.batch_min} is above --batch-max {args.batch_max}: no batch to sweep")


def _check_sweep_batches(args) -> None:
    """A sweep's largest batch: every system keeps at least each request's index-K rows on the GPU (its latent rows,
    for a model without sparse attention)."""
    from ess.analysis.sim.specs import GIB, get_hardware, get_model

    spec, hw = get_model(args.model), get_hardware(args.hardware)
    row, what = (spec.index_row_bytes, "index-K") if spec.index_topk else (spec.latent_row_bytes, "latent")
    most = int(hw.memory_gib * GIB // (args.context * spec.layers * row))
    if args.batch_max is None:
        args.batch_max = min(SWEEP_BATCH_MAX, most)
    if args.batch_max > most:
        raise ValueError(f"--batch-max {args.batch_max}: {args.hardware}'s {hw.memory_gib} GiB hold the {what} rows of "
                         f"at most {most} requests of --context {args.context}, which every system keeps on the GPU")


# -- inputs read before any work ---------------------------------------------------------------------------------------
def profile_arg(args):
    from ess.analysis.sim.profile import load_profile

    return load_profile(args.profile) if getattr(args, "profile", None) else None


def measured_arg(args):
    """`--measured KIT [BOOKKEEPING]`: ESS's own terms from a GPU run (ess.analysis.sim.measured), read before any
    work; the simulated part and the measured device are named when they differ."""
    from ess.analysis.sim.measured import load_measured

    if not getattr(args, "measured", None):
        return None
    m = load_measured(args.measured)
    part = getattr(args, "hardware", "H200")
    if part.lower() not in m.device.lower():
        say(f"--measured: ESS's terms were measured on {m.device}; the rest of the step is modelled for {part}")
    return m


def measured_notes(measured) -> None:
    """What the measurements lacked and the simulator assumed (known once the rows are computed)."""
    for note in measured.assumed if measured is not None else ():
        say(f"--measured: assumed: {note}")


# -- runs ----------------------------------------------------------------------------------------------------------
def run_one(args) -> int:
    from ess.analysis.sim.engine import simulate

    measured = measured_arg(args)
    row = simulate(model=args.model, hardware=args.hardware, context=args.context, mtp=args.mtp, accept=args.accept,
                   batch=args.batch_size, sparse_ratio=args.sparse_ratio, tbo=args.tbo, overlap=args.overlap, ep=args.ep,
                   profile=profile_arg(args), disk_tier=args.disk_tier, nvme_gbps=args.nvme_gbps, measured=measured)
    measured_notes(measured)
    if args.disk_tier and not row.get("disk_share"):
        say(f"--disk-tier: batch {args.batch_size}'s host pool fits the host budget, so nothing of this step is on disk")
    emit(args, row, _sim_table([row], f"ess sim run ({args.model} on {args.hardware})"))
    return 0


def run_paper(args) -> int:
    from ess.analysis.sim.engine import dsv3_check, paper_headlines, paper_table
    from ess.analysis.sim.profile import load_profile

    measured = measured_arg(args)
    profiles = [load_profile(p) for p in args.profile or []]
    rows, check = paper_table(profiles=profiles, measured=measured), dsv3_check()
    heads = paper_headlines(rows)
    measured_notes(measured)
    if args.json:
        doc = {"rows": rows, "headlines": heads, "dsv3_check": check}
        if measured is not None:
            doc["measured"] = measured.describe()
        print(json.dumps(doc))
        return 0
    out.print(_sim_table(rows, "ESS paper evaluation, simulated (H200, EP 32; ESS rows: per-layer plan)"))
    if measured is not None:
        out.print(_measured_table([r for r in rows if "measured" in r], measured))
    out.print(_headline_table(heads))
    out.print("ESS rows are the paper's (batch, ratio) pairs as given: they exceed the cache budget that reproduces its "
              "baseline batch by a few requests (fits_memory: the largest batch at that ratio; README, simulator).")
    out.print(f"DeepSeek-V3 check (H800, EP 144, KV 4989, batch {check['batch_size']}): {check['throughput']} "
                    f"tok/s per node vs published 14800 ({check['error_vs_published']:+.1%})")
    return 0


def run_sweep(args) -> int:
    from ess.analysis.sim.engine import plot_sweep, sweep

    batches = list(range(args.batch_min, args.batch_max + 1, args.batch_step))
    measured = measured_arg(args)
    result = sweep(batches, args.context, args.mtp, args.accept, args.model, args.hardware, args.tbo, args.ep, profile_arg(args),
                   args.disk_tier, args.nvme_gbps, measured)
    measured_notes(measured)
    if args.plot:
        plot_sweep(result, output(args.plot), f"{args.model} on {args.hardware}, context {args.context}, MTP {args.mtp} "
                   f"(accept {args.accept}), EP {args.ep}, TBO {'on' if args.tbo else 'off'}")
    rows = result["baseline"] + result["hisparse"] + result["ess"] + result["ess_disk"]
    if args.disk_tier and not result["ess_disk"]:
        say(f"--disk-tier: no batch of this sweep passes ESS's host memory wall (batch {result['host_wall_batch']}), "
            "so no row needs the disk; raise --batch-max past it")
    emit(args, result, _sim_table(rows, f"sweep (GPU memory wall at batch {result['memory_wall_batch']}, host memory "
                                         f"wall of ESS at batch {result['host_wall_batch']})"))
    return 0


def run_calibrate(args) -> int:
    from ess.analysis.sim.engine import fit_calibration

    fit = fit_calibration(args.hardware)
    if args.out:
        with open(output(args.out), "w") as f:
            json.dump(fit, f, indent=1)
    table = Table(title=f"calibration on the paper's baseline rows ({args.hardware}); "
                        + (f"written to {args.out}" if args.out else "not saved: --out PATH writes it"))
    table.add_column("constant")
    table.add_column("value", justify="right")
    for key, value in fit.items():
        table.add_row(key, str(value))
    emit(args, fit, table)
    return 0


# -- tables --------------------------------------------------------------------------------------------------------
def _measured_table(rows: list[dict], measured) -> Table:
    """The paper's ESS points predicted twice: ESS's own terms modelled and measured, with the term that differs most."""
    table = Table(title=f"ESS rows, modelled against measured ESS terms ({measured.source})")
    for c in ("context", "mtp / accept", "batch", "ratio", "modelled tok/s", "measured tok/s", "change",
              "plan (measured)", "differs most: modelled -> measured ms per step"):
        table.add_column(c, justify="right")
    for r in rows:
        m, d = r["measured"], r["differs_most"]
        table.add_row(str(r["context"]), f"{r['mtp']} / {r['accept_ratio']}", str(r["batch_size"]), str(r["sparse_ratio"]),
                      str(r["throughput"]), str(m["throughput"]), f"{m['throughput'] / r['throughput'] - 1:+.1%}",
                      " ".join(f"{k} {v}" for k, v in m["plan"].items() if v),
                      f"{d['term']}: {d['modelled']} -> {d['measured']}")
    return table


def _headline_table(heads: list[dict]) -> Table:
    table = Table(title="the paper's headline gains: the throughput they imply against each prediction")
    for c in ("context", "mtp / accept", "batch", "paper gain", "paper tok/s", "modelled (batch): error",
              "measured (batch): error"):
        table.add_column(c, justify="right")
    for h in heads:
        cells = [f"{h[k]['throughput']} ({h[k]['batch_size']}): {h[k]['error_vs_paper']:+.1%}" if k in h else ""
                 for k in ("modelled", "measured")]
        table.add_row(str(h["context"]), f"{h['mtp']} / {h['accept_ratio']}", str(h["batch_size"] or "best"),
                      f"{h['paper_gain']:+.1%}", str(h["paper_throughput"]), *cells)
    return table


def _sim_cell(row: dict, col: str) -> str:
    v = row.get(col)
    if col == "fits_memory":  # why not: the largest batch that fits at this ratio
        return "yes" if v else f"no (max {row['max_batch']})"
    if col == "fits_host_memory":
        return "yes" if v else f"no ({row['host_budget_gib_per_gpu']} GiB pinnable per GPU)"
    if v is None:
        return ""
    return str(round(v, 4)) if isinstance(v, float) else str(v)


def _sim_table(rows: list[dict], title: str) -> Table:
    cols = ["context", "mtp", "accept_ratio", "batch_size", "sparse_ratio", "throughput", "otps", "step_ms",
            "exposed_transfer_ms", "gain_vs_baseline", "error_vs_paper", "fits_memory", "host_gib_per_gpu",
            "fits_host_memory"]
    if any("exposed_disk_ms" in r for r in rows):
        cols += ["disk_share", "exposed_disk_ms"]
    if any("system" in r for r in rows):
        cols.insert(0, "system")
    table = Table(title=title)
    for c in cols:
        table.add_column(c, justify="left" if c == "system" else "right")
    for r in rows:
        table.add_row(*(_sim_cell(r, c) for c in cols))
    return table
