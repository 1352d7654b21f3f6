"""`ess demo` (the mini model, with or without ESS; or, with --server, real SGLang servers) and `ess tiny-checkpoint`.
The reference model run's options and their checks are shared with `ess trace record`."""

from __future__ import annotations

import dataclasses
import os

from rich.table import Table

from ess.cli.common import (JSON_HELP, NON_NEGATIVE, POSITIVE, SEED, SEED_HELP, ProgressBar, emit, out, output_dir,
                            positive_float, say)
from ess.core.settings import DEFAULT_SPARSE_RATIO, GIB, TIER_PLACEMENTS, KnobError, check_disk_dir

# flags of the mini-model demo that mean nothing to `ess demo --server` (name: default)
MINI_ONLY = {"ess": False, "buffer_tokens": None, "sparse_ratio": None, "no_warmup": False, "device_mem_gib": None,
             "overlap": "none", "layer_plan": None, "host_budget_mib": None, "disk_dir": None, "disk_gib": None,
             "tier_placement": TIER_PLACEMENTS[0], "config": "mini", "layers": None, "topk": None, "batch": 4,
             "context": 2048, "steps": 32, "device": "auto"}
# and the flags of `ess demo --server` that mean nothing to the mini-model demo
SERVER_ONLY = {"server_model": None, "server_modes": "none,da", "server_logs": None}


def add_model_args(p, batch: int, steps_type) -> None:
    """The reference model run's options, shared by `demo` and `trace record`."""
    p.add_argument("--config", default="mini", choices=["mini", "full"], help="model configuration (full needs a GPU)")
    p.add_argument("--layers", type=POSITIVE, help="override the number of layers")
    p.add_argument("--topk", type=POSITIVE, help="override the indexer's top-k")
    p.add_argument("--batch", type=POSITIVE, default=batch, help="prompts decoded together")
    p.add_argument("--context", type=POSITIVE, default=2048, help="prompt length in tokens")
    p.add_argument("--steps", type=steps_type, default=32, help="decode steps")
    p.add_argument("--seed", type=SEED, default=0, help=SEED_HELP)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the model runs (auto: CUDA if present)")


def add_parsers(sub) -> None:
    d = sub.add_parser("demo", help="prefill and greedy-decode the reference mini model, with or without ESS")
    add_model_args(d, batch=4, steps_type=POSITIVE)
    d.add_argument("--ess", action="store_true", help="also decode with ESS and compare with the baseline")
    g = d.add_mutually_exclusive_group()
    g.add_argument("--ess-buffer-tokens", dest="buffer_tokens", type=NON_NEGATIVE, help="ESS GPU slots per request and layer (with --ess)")
    g.add_argument("--ess-sparse-ratio", dest="sparse_ratio", type=positive_float, help=f"ESS GPU share of the cache (with --ess; default {DEFAULT_SPARSE_RATIO})")
    d.add_argument("--no-warmup", action="store_true", help="start decode with an empty GPU buffer (with --ess)")
    d.add_argument("--device-mem-gib", type=positive_float, help="report the largest batch whose caches fit this budget")
    d.add_argument("--overlap", default="none", choices=["none", "da", "dba", "plan"],
                   help="ESS overlap mode for every layer, or plan: per layer from --layer-plan, which it requires "
                        "(with --ess)")
    d.add_argument("--layer-plan", help="layer plan JSON (format ess-layer-plan/1) with one mode per layer")
    d.add_argument("--host-budget-mib", type=positive_float,
                   help="with --disk-dir: host memory for latent pages (a disk tier holds the rest; with --ess)")
    d.add_argument("--disk-dir", help="directory for the disk tier's page file (with --host-budget-mib and --ess)")
    d.add_argument("--disk-gib", type=positive_float, help="refuse a batch whose pages need more disk than this")
    d.add_argument("--tier-placement", default=TIER_PLACEMENTS[0], choices=TIER_PLACEMENTS,
                   help="which page the disk tier's full host frames give up: the lowest decayed access count "
                        "(frequency) or the least recently used (with --disk-dir)")
    d.add_argument("--server", action="store_true",
                   help="instead: real SGLang servers on this machine, stock and --enable-ess (one per overlap mode), "
                        "on a tiny DeepSeek-V3.2 checkpoint, the same concurrent requests and SGLang's serving "
                        "benchmark; tokens compared request by request (docs/plugin.md)")
    d.add_argument("--server-model", help="with --server: a checkpoint directory (default: `ess tiny-checkpoint`'s)")
    d.add_argument("--server-modes", default="none,da", help="with --server: the ESS servers' --ess-overlap modes")
    d.add_argument("--server-logs", type=output_dir("--server-logs"),
                   help="with --server: keep the servers' logs in this directory")
    d.add_argument("--json", action="store_true", help=JSON_HELP)
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.set_defaults(func=run_demo, check=check_demo)

    t = sub.add_parser("tiny-checkpoint", help="write a tiny random DeepSeek-V3.2 checkpoint that SGLang serves "
                                              "(the CPU server's model; ess/reference/checkpoint.py)")
    t.add_argument("out", type=output_dir("OUT"),
                   help="directory to write (created; refused if it holds a checkpoint already)")
    t.add_argument("--seed", type=SEED, default=0, help="the weights' generator seed (the same seed, the same bytes)")
    t.add_argument("--full-width", action="store_true",
                   help="DeepSeek-V3.2's own widths at 4 dense layers (about 8.5 GB; the GPU server's model)")
    t.add_argument("--no-mtp", action="store_true", help="without the MTP layer (with --full-width it would be MoE)")
    t.add_argument("--moe-layers", type=int, metavar="N",
                   help="with --full-width: DeepSeek-V3.2's layer mix at one GPU's share of EP8, 3 dense layers then N "
                        "MoE layers of 32 routed experts (top-1) and the shared expert; MTP allowed")
    t.add_argument("--fp8", action="store_true",
                   help="the layers' projections in DeepSeek's FP8 format (e4m3, a ue8m0 scale per 128x128 block), "
                        "as DeepSeek-V3.2 ships; default bf16")
    t.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the weights are drawn (cuda: a GPU draws a full-width model in seconds)")
    t.add_argument("--locality", type=float, metavar="KNOB",
                   help="a real model's top-k locality at this noise share in [0, 1] (fitted: benchmark/results/"
                        "locality/fit.json; ess/reference/locality.py); default: the random checkpoint")
    t.set_defaults(func=run_tiny_checkpoint)


# -- checks --------------------------------------------------------------------------------------------------------
def check_model_run(args) -> int:
    """`ess trace record` and the mini-model `ess demo`: the model configuration's positions and top-k. Returns the
    top-k."""
    from ess.reference.config import get_config

    config = get_config(args.config)
    if args.context + args.steps > config.max_positions:
        raise ValueError(f"--context {args.context} + --steps {args.steps}: the {args.config} model serves at most "
                         f"{config.max_positions} positions")
    topk = args.topk or config.index_topk
    if topk > args.context:  # the first step would select padding
        flag = f"--topk {args.topk}" if args.topk else f"--config {args.config}'s top-k {topk}"
        raise ValueError(f"{flag}: more than the --context {args.context} positions a step can select from")
    return topk


def check_demo(args) -> None:
    """The mini-model demo's flags (`ess demo --server` checks its own when it starts, before any server)."""
    if args.server:
        return
    check_model_run(args)
    given = [f"--{k.replace('_', '-')}" for k, default in SERVER_ONLY.items() if getattr(args, k) != default]
    if given:
        raise ValueError(f"{', '.join(given)}: options of `ess demo --server`; give --server too")
    if args.ess and args.buffer_tokens is not None and args.buffer_tokens > args.context + args.steps:
        raise ValueError(f"--ess-buffer-tokens {args.buffer_tokens}: more slots than the --context + --steps = "
                         f"{args.context + args.steps} positions a request holds")
    if args.disk_dir is not None:
        try:
            check_disk_dir(args.disk_dir, "--disk-dir")
        except KnobError as e:
            raise ValueError(str(e)) from e
        if args.ess and args.host_budget_mib is not None:  # the disk tier's two flags
            _check_page_file_fits(args)


def _check_page_file_fits(args) -> None:
    """The disk tier preallocates its page file once the baseline has run: a disk that cannot hold it is refused
    now."""
    from ess.core.page_file import DISK_PAGE, free_disk_bytes
    from ess.reference.config import get_config
    from ess.reference.tiered_host_pool import page_file_bytes

    layers, tokens = args.layers or get_config(args.config).num_layers, args.context + args.steps
    need, free = page_file_bytes(layers, args.batch, tokens), free_disk_bytes(args.disk_dir)
    if need > free:
        raise ValueError(f"--disk-dir {args.disk_dir}: the disk tier's page file needs {need / GIB:.3g} GiB ({layers} "
                         f"layers x {args.batch} requests x {tokens} positions in {DISK_PAGE}-byte pages), "
                         f"{free / GIB:.3g} GiB free there")


# -- runs ----------------------------------------------------------------------------------------------------------
def run_demo(args) -> int:
    if args.server:
        return run_server_demo(args)
    from ess.reference.demo import DemoOptions, run_demo as demo

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(DemoOptions) if hasattr(args, f.name)}
    opt = DemoOptions(**given, warmup=not args.no_warmup)  # the flags are named as the options (dest), --no-warmup aside
    with ProgressBar(not args.quiet) as progress:
        report = demo(opt, progress)
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
    emit(args, report, table)
    return 0


def run_server_demo(args) -> int:
    from ess.harness.server_demo import ServerDemoOptions, run_server_demo as server_demo

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
    report = server_demo(opt, say=(lambda text: None) if args.quiet else say)
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
        name = "ess, requests fit (residency first)" if mode == "resident" else f"ess offloaded, --ess-overlap {mode}"
        table.add_row(name, f"{e['tokens_identical']}", f"{e['missed_rows_per_forward']}",
                      f"{e['miss_share']:.1%}", f"{e['forwards_without_misses']} of {e['decode_forwards']}",
                      f"{b['output_throughput']:.1f}, {b['mean_tpot_ms']:.1f}")
    emit(args, report, table)
    if not args.json:
        out.print("Where the time goes: an offloaded request's decode step runs the LRU step and copies its misses from "
                  "the host pool, in every layer (on this CPU as torch ops, the CPU path's); a resident one does "
                  "neither, so its step is stock's (docs/design.md, \"Residency first\").")
        for mode, e in report["ess"].items():
            out.print(f"ess {mode}: {e['pool_log']}")
            for d in e["first_differences"]:
                out.print(f"ess {mode}: differs from stock at step {d['step']} (stock's top-2 logprob gap there: "
                          f"{d['stock_top2_logprob_gap']})")
    return 0 if all(e["tokens_identical"] == report["requests"] for e in report["ess"].values()) else 1


def run_tiny_checkpoint(args) -> int:
    from ess.reference import checkpoint

    try:
        paths = checkpoint.write(args.out, args.seed, mtp=not args.no_mtp, full=args.full_width, device=args.device,
                                 locality=args.locality, fp8=args.fp8, moe_layers=args.moe_layers)
    except FileExistsError as e:
        raise ValueError(str(e)) from e
    width = ("full-width " if args.full_width else "") + ("FP8 " if args.fp8 else "")
    kind = "random" if args.locality is None else f"locality {args.locality}"  # the indexer's top-k (random or real)
    mix = "" if args.moe_layers is None else f", {args.moe_layers} MoE layers"
    say(f"ess tiny-checkpoint: a {kind} {width}DeepSeek-V3.2 checkpoint (seed {args.seed}{mix}) in {args.out}: "
        + ", ".join(os.path.basename(p) for p in paths))
    return 0
