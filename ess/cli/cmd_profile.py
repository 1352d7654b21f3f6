"""`ess profile`: the miss profile of traces through a cache policy (mean misses per layer and ratio), with plots;
`ess plan` and `ess sim --profile` read it."""

from __future__ import annotations

import json
import os

from rich.table import Table

from ess.cli.cmd_cache import check_replay_fits
from ess.cli.common import (JSON_HELP, POSITIVE, ProgressBar, add_force, check_policy_flags, decay_shift, emit, floats,
                            ints, output, output_dir, output_file, say)
from ess.core.settings import DEFAULT_DECAY_SHIFT, REPLAY_POLICIES

PROFILE_RATIOS = [0.1, 0.2, 0.3, 0.5]


def add_parsers(sub) -> None:
    pr = sub.add_parser("profile", help="miss profile of traces through the ESS cache policy, with plots")
    pr.add_argument("traces", nargs="+", help="trace files; several of different context lengths add misses vs context")
    pr.add_argument("--ratios", type=floats, help=f"Sparse Memory Ratios, comma-separated (default {','.join(map(str, PROFILE_RATIOS))})")
    pr.add_argument("--buffer-tokens", type=ints, help="GPU slots instead of ratios, comma-separated")
    pr.add_argument("--plot", type=output_dir("--plot"), help="directory for PNG plots (created)")
    pr.add_argument("--out", type=output_file("--out"), help="write the profile JSON here too")
    add_force(pr)  # --out, and the PNGs in --plot
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
    pr.set_defaults(func=run_profile, check=check_profile)


def check_profile(args) -> None:
    from ess.analysis.profiling import PLOTS

    there = [name for name in PLOTS if args.plot and os.path.exists(os.path.join(args.plot, name))]
    if there and not args.force:
        raise ValueError(f"--plot {args.plot}: holds {', '.join(there)} already; give --force to overwrite them")
    if args.ratios is not None and args.buffer_tokens is not None:
        raise ValueError("--ratios and --buffer-tokens both size the slots: give one")
    check_policy_flags(args)


def run_profile(args) -> int:
    from ess.analysis.profiling import holds_topk, plot_profile, profile_traces
    from ess.core.trace import load_trace

    traces = [(path, load_trace(path)) for path in args.traces]
    for path, trace in traces:
        check_replay_fits(path, trace)
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
    with ProgressBar(not args.quiet) as progress:
        prof = profile_traces(traces, ratios, args.buffer_tokens, progress=lambda d, t: progress("replays", d, t),
                              policy=args.policy, lookahead=args.lookahead, decay_shift=decay_shift(args))
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
        with open(output(args.out), "w") as f:
            json.dump(prof, f)
    table = Table(title=f"miss profile of {args.traces[0]}, policy {prof['policy']} (mean misses per request-step)")
    table.add_column("layer")
    for r in prof["ratios"]:
        table.add_column(f"ratio {r:.2f}", justify="right")
    table.add_column("similarity", justify="right")
    for li in range(prof["num_layers"]):
        table.add_row(str(li), *(f"{m[li]:.1f}" for m in prof["mean_misses"]), f"{prof['similarity'][li]:.3f}")
    emit(args, prof, table)
    return 0
