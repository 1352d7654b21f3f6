"""`ess sim pd`: PD-disaggregated decode, the first and the k-th decode token after a full or a progressive cache
transfer (progressive: simulated only)."""

from __future__ import annotations

import argparse
import json
import math

from rich.table import Table

from ess.cli.common import (JSON_HELP, NON_NEGATIVE, POSITIVE, add_force, floats, out, output, output_file,
                            positive_float, say)
from ess.core.settings import DEFAULT_SPARSE_RATIO, KnobError, capacity


def link_gbps(text: str) -> list[float]:
    values = floats(text)
    bad = [v for v in values if not (v > 0 and math.isfinite(v))]
    if bad:
        raise argparse.ArgumentTypeError(f"a link's bandwidth must be a positive, finite number of Gb/s, got {bad[0]:g}")
    return values


def contexts(text: str) -> list[int]:
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


def add_parser(ssub) -> None:
    from ess.analysis.sim import pd_model as pd_sim

    pd = ssub.add_parser("pd", help="PD-disaggregated decode: time to the first and the k-th decode token after a "
                                    "full or a progressive cache transfer (progressive: SIMULATED only)")
    pd.add_argument("--progressive", action="store_true",
                    help="also progressive transfer: index-K and warm-up state, then the warm-up set's latent rows, "
                         "decode starts, the rest streams (docs/simulator.md; not in the plugin)")
    pd.add_argument("--link-gbps", type=link_gbps, default=",".join(f"{g:g}" for g in pd_sim.LINK_GBPS),
                    help="link bandwidths, Gb/s, comma-separated: the link one request's transfer has")
    pd.add_argument("--contexts", type=contexts, default=",".join(f"{c // 1024}K" for c in pd_sim.CONTEXTS),
                    help="request contexts, comma-separated: tokens, or K (x 1024)")
    pd.add_argument("--tokens", type=POSITIVE, default=pd_sim.TOKENS, help="the k-th decode token timed beside the first")
    pd.add_argument("--hardware", default="H200", help="the decode node's GPU (ess/analysis/sim/data/hardware.json)")
    pd.add_argument("--mtp", type=NON_NEGATIVE, default=2, help="MTP draft tokens per step")
    pd.add_argument("--accept", type=positive_float, default=1.7, help="mean tokens accepted per step (1 .. mtp + 1)")
    pd.add_argument("--ep", type=POSITIVE, default=32, help="expert-parallel GPUs")
    pd.add_argument("--tbo", action=argparse.BooleanOptionalAction, default=True, help="Two-Batch Overlap")
    pd.add_argument("--batch-size", type=POSITIVE,
                    help="the decode batch per GPU the request joins (default: the largest that fits GPU and host "
                         "memory at the ratio, per context)")
    pd.add_argument("--sparse-ratio", type=positive_float, default=DEFAULT_SPARSE_RATIO, help="ESS's GPU share")
    pd.add_argument("--profile", nargs="+", metavar="FILE",
                    help="miss profiles from `ess profile`: each context uses the one recorded nearest it (default: "
                         "the synthetic one)")
    pd.add_argument("--plot", type=output_file("--plot", plot=True), help="plot path (.png, .pdf, .svg ...)")
    add_force(pd)
    pd.add_argument("--json", action="store_true", help=JSON_HELP)
    pd.set_defaults(func=run_pd, check=check_pd)


def check_pd(args) -> None:
    """The contexts the model serves and the ratio's slots at each, the MTP setting, the hardware."""
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


def run_pd(args) -> int:
    from ess.analysis.sim.pd_model import goal, pd_rows, plot_pd
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
        plot_pd(rows, output(args.plot), args.tokens, title)
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
