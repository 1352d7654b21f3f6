"""`ess cache replay`: a trace through the LRU step, the offline optimum or a candidate policy, misses counted."""

from __future__ import annotations

from rich.table import Table

from ess.cli.common import (JSON_HELP, NON_NEGATIVE, POSITIVE, ProgressBar, check_policy_flags, decay_shift, emit,
                            free_memory_bytes)
from ess.core.settings import GIB, KERNELS, REPLAY_POLICIES, WARMUP_WINDOWS


def add_parsers(sub) -> None:
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
    r.set_defaults(func=run_replay, check=check_replay)


def check_replay(args) -> None:
    if args.warmup_windows is not None and not args.warmup:
        raise ValueError("--warmup-windows sets LRU-Warmup's windows: give --warmup too")
    if args.kernel != "torch" and args.policy != "lru":
        raise ValueError(f"--kernel chooses the LRU step's implementation; --policy {args.policy} would ignore it")
    check_policy_flags(args)


def check_replay_fits(path: str, trace, policy: str = "lru") -> None:
    """The replay's position -> slot tables have a column per position of the trace: its positions must be int32
    (as the trace's top-k is) and one layer's tables must fit the memory free here (`ess cache replay`, `ess
    profile`)."""
    from ess.analysis.replay import position_table_bytes
    from ess.core.trace import TRACE_POSITIONS

    longest, steps = int(trace.context_len.max()), trace.topk.shape[1]
    where = f"{path}: 'context_len' {longest} + {steps} decode steps"
    if longest + steps > TRACE_POSITIONS:
        raise ValueError(f"{where}: a trace's positions are int32, at most {TRACE_POSITIONS}")
    need, free = position_table_bytes(trace, policy), free_memory_bytes()
    if need > free:
        raise ValueError(f"{where}: the replay's position tables take {need / GIB:.1f} GiB a layer, more than the "
                         f"{free / GIB:.1f} GiB of memory free here")


def run_replay(args) -> int:
    from ess.analysis.replay import replay_counts
    from ess.core.layout import LATENT_ROW_BYTES
    from ess.core.trace import load_trace

    trace = load_trace(args.trace)
    held = None if trace.prefill_topk is None else trace.prefill_topk.shape[2]
    if args.warmup_windows is not None and held is not None and args.warmup_windows > held:  # (the default takes all)
        raise ValueError(f"--warmup-windows {args.warmup_windows}: {args.trace} holds {held} prefill windows "
                         "('prefill_topk')")
    check_replay_fits(args.trace, trace, args.policy)
    with ProgressBar(not args.quiet) as progress:
        c = replay_counts(
            trace, args.buffer, args.warmup, WARMUP_WINDOWS if args.warmup_windows is None else args.warmup_windows,
            progress=lambda d, t: progress("decode steps", d, t),
            kernel=args.kernel, policy=args.policy, lookahead=args.lookahead, decay_shift=decay_shift(args),
        )
    misses = c.misses
    doc = {"trace": args.trace, "buffer": args.buffer, "warmup": args.warmup, "policy": args.policy,
           "shape": list(misses.shape), "misses": misses.tolist()}
    prefetching = args.policy == "prefetch"
    if prefetching:
        doc |= {"lookahead": args.lookahead or trace.lookahead, "prefetched": c.prefetched.tolist(),
                "prefetch_hits": c.prefetch_hits.tolist(), "wasted": c.wasted.tolist()}
    if args.policy == "score":
        doc["decay_shift"] = decay_shift(args)
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
    emit(args, doc, table)
    return 0
