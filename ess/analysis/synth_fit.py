"""`ess trace synth --like REAL.npz`: the synthetic generator (ess.analysis.synth) fitted to a real trace
(docs/profiling.md, "Fitting the synthetic generator").

The real trace fixes the shape (layers, top-k, context, steps) and, measured, the knobs it shows directly: attention
sinks (first positions in at least half the decode sets), the local window (offsets behind the own position in at
least half; the generator's window counts the own position too), and the per-layer spread of new entries per step (the generator's churn, log-uniform between the
layers' least and most). A coordinate search then sets the working-set pool, its spread over layers (in the layers' churn order
or not: pool_by_churn) and its skew (pool_power), the fresh share and a scale on churn so
that the LRU miss curve (mean misses per request-layer-step at ratios FIT_RATIOS, warm-up on, ess.analysis.lru_curve)
comes closest to the real one in the worst ratio's relative error. Reported: the fitted options, both curves, the
error per ratio, and the statistics of both traces (consecutive-step overlap, re-entry gaps, first touches per step,
per-layer spread).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

import numpy as np

from ess.analysis.lru_curve import FIRST_TOUCH, lru_ranks, misses_at
from ess.analysis.profiling import buffer_for_ratio, holds_topk, similarity
from ess.analysis.synth import SynthOptions, synth_trace
from ess.core.trace import Trace

FIT_RATIOS = [0.05, 0.1, 0.2, 0.3, 0.5]
FIT_REQUESTS = 2  # synthetic requests per candidate during the search (the curve is a per-request mean)
MAX_EVALS = 140  # candidate traces the search may try
GAP_EDGES = [1, 2, 5, 17, 65]  # re-entry gap buckets in steps: 1, 2-4, 5-16, 17-64, 65 and more


def curve(trace: Trace, ratios: list[float], ranks: np.ndarray | None = None) -> np.ndarray:
    """Mean LRU misses per request-layer-step at each ratio (warm-up where the trace has prefill sets)."""
    ranks = lru_ranks(trace, trace.prefill_topk is not None) if ranks is None else ranks
    return np.array([misses_at(ranks, buffer_for_ratio(trace, r)).mean() for r in ratios])


def _reentry_gaps(trace: Trace) -> list[float]:
    """Share of decode accesses that re-use a position last used 1, 2-4, 5-16, 17-64, 65+ steps before (prefill
    windows count as steps before the first), and the share that are first touches (last entry)."""
    R, steps, L, K = trace.topk.shape
    sets = trace.topk.transpose(1, 0, 2, 3).reshape(steps, R * L, K).astype(np.int64)
    W = 0
    if trace.prefill_topk is not None:
        W = trace.prefill_topk.shape[1]
        sets = np.concatenate([trace.prefill_topk.transpose(1, 0, 2, 3).reshape(W, R * L, K), sets])
    P = int(trace.context_len.max()) + steps + 1
    last = np.full((R * L, P + 1), -1, dtype=np.int64)
    rows = np.arange(R * L)[:, None]
    counts = np.zeros(len(GAP_EDGES) + 1)
    for t in range(sets.shape[0]):
        s = np.where(sets[t] >= 0, sets[t], P)
        prev = last[rows, s]
        if t >= W:
            ok = s < P
            gap = t - prev
            counts[-1] += (ok & (prev < 0)).sum()
            b = np.digitize(gap[ok & (prev >= 0)], GAP_EDGES) - 1
            counts[: len(GAP_EDGES)] += np.bincount(b, minlength=len(GAP_EDGES))
        last[rows, s] = t
    return [round(float(c), 4) for c in counts / max(counts.sum(), 1)]


def trace_stats(trace: Trace, ranks: np.ndarray | None = None) -> dict:
    """The statistics the fit reports for a trace."""
    ranks = lru_ranks(trace, trace.prefill_topk is not None) if ranks is None else ranks
    sim = similarity(trace)
    first = (ranks == FIRST_TOUCH).sum(-1).mean()
    per_layer = misses_at(ranks, buffer_for_ratio(trace, 0.2)).mean(axis=(0, 1))
    return {"overlap_mean": round(float(sim.mean()), 4), "overlap_min": round(float(sim.min()), 4),
            "overlap_max": round(float(sim.max()), 4), "reentry_gap_edges": GAP_EDGES,
            "reentry_gap_shares_and_first_touch": _reentry_gaps(trace),
            "first_touches_per_step": round(float(first), 3),
            "layer_misses_at_0.2": {"min": round(float(per_layer.min()), 3), "max": round(float(per_layer.max()), 3)}}


def _measured_knobs(trace: Trace) -> dict:
    """Sinks, window and the per-layer new entries per step, as the real trace shows them."""
    t = trace.topk.astype(np.int64)  # [R, steps, L, K]
    R, steps, L, K = t.shape
    pos = trace.context_len[:, None, None, None] + np.arange(steps)[None, :, None, None]
    sinks = 0
    while sinks < K // 8 and ((t == sinks).any(-1)).mean() >= 0.5:
        sinks += 1
    window = 0  # offsets 1, 2, ... behind the own position, each in at least half the sets
    while window < K // 4 and ((t == pos[..., 0][..., None] - window - 1).any(-1)).mean() >= 0.5:
        window += 1
    new = np.zeros(L)
    if steps > 1:
        for l in range(L):
            cur, prev = t[:, 1:, l], t[:, :-1, l]
            new[l] = np.mean([[len(np.setdiff1d(cur[r, s][cur[r, s] >= 0], prev[r, s])) for s in range(steps - 1)]
                              for r in range(R)])
    return {"sinks": sinks, "window": window, "new_min": float(new.min()), "new_max": float(new.max())}


def fit_like(real: Trace, seed: int = 0, progress: Callable[[int, int], None] | None = None,
             ratios: list[float] = FIT_RATIOS) -> tuple[SynthOptions, Trace, dict]:
    """The generator's options fitted to `real` (its request count kept), the trace they make, and the report."""
    R, steps, L, K = real.topk.shape
    context = int(round(float(real.context_len.mean())))
    windows = real.prefill_topk.shape[1] if real.prefill_topk is not None else 0
    if windows == 0:
        raise ValueError("--like: the real trace has no prefill_topk (warm-up windows); the fit replays with warm-up")
    ratios = [r for r in ratios if holds_topk(real, r)]
    if not ratios:
        raise ValueError(f"--like: top-k {K} of a {context}-token context: no fit ratio gives top-k + 1 slots")
    real_ranks = lru_ranks(real, True)
    target = curve(real, ratios, real_ranks)
    k = _measured_knobs(real)
    room = K - k["sinks"] - k["window"] - 1 - max(1, K // 8)  # a hot set of at least K/8 stays
    base = SynthOptions(requests=FIT_REQUESTS, steps=steps, layers=L, topk=K, context=context, warmup_windows=windows,
                        sinks=k["sinks"], window=k["window"] + 1, drift_min=0.0, drift_max=0.0, seed=seed)
    churn_lo, churn_hi = max(0.0, k["new_min"]), max(1.0, k["new_max"])
    evals = []

    def options(pool: int, fresh: float, scale: float, spread: float = 1.0, power: float = 1.0,
                by_churn: bool = False) -> SynthOptions:
        hi = int(min(room, max(1, round(churn_hi * scale))))
        lo = int(min(hi, round(churn_lo * scale)))
        pool = min(max(hi, pool), context)
        return dataclasses.replace(base, churn_min=lo, churn_max=hi, pool=pool, fresh=fresh, pool_power=power,
                                   pool_min=None if spread <= 1 else max(1, int(pool / spread)),
                                   pool_by_churn=by_churn and spread > 1)

    def error(x: tuple) -> float:
        x = x[:5] + (bool(x[5] and x[3] > 1),)  # by_churn changes nothing without a spread: one evaluation
        for prev_x, err, _ in evals:
            if prev_x == x:
                return err
        got = curve(synth_trace(options(*x)), ratios)
        err = float(np.max(np.abs(got - target) / np.maximum(target, 1e-9)))
        evals.append((x, err, got))
        if progress:
            progress(len(evals), MAX_EVALS)  # the search may stop earlier
        return err

    pools = sorted({max(16, int(f * context)) for f in (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)})
    freshes = [0.0, 0.01, 0.03, 0.1, 0.2, 0.4]  # a multiplicative step keeps 0 at 0: start the refinement above it
    scales = [0.6, 0.8, 1.0, 1.25, 1.6]
    spreads = [1.0, 2.0, 4.0, 8.0, 16.0, 64.0]  # the largest layer pool over the smallest
    # start from the fresh share that gives the real first touches per step (fresh draws are nearly all first touches)
    first = float((real_ranks == FIRST_TOUCH).sum(-1).mean())
    fresh0 = min(1.0, first / max(1.0, (churn_lo + churn_hi) / 2))
    freshes = sorted(set(freshes) | {round(fresh0, 4)})
    powers = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0]  # the pool's skew: 1 uniform
    # two starts: a narrow uniform pool, and a wide skewed spread tied to churn (real layers that churn more also come
    # back over longer gaps: docs/profiling.md); one knob at a time, neither start reaches every trace's best alone
    grids = [(0, pools), (4, powers), (3, spreads), (5, [True, False]), (1, freshes), (2, scales)]
    starts = []
    for x in [(pools[3], round(fresh0, 4), 1.0, 1.0, 1.0, False), (pools[5], round(fresh0, 4), 1.0, 8.0, 3.0, True)]:
        for _ in range(2):  # coordinate search over the knobs' grids, twice
            for i, grid in grids:
                x = min((x[:i] + (v,) + x[i + 1:] for v in grid), key=error)
        starts.append(x)
    x = min(starts, key=error)
    step = 1.25  # then a pattern search: each knob up and down by a factor, the factor shrinking
    while step > 1.03 and len(evals) < MAX_EVALS:
        moves = []
        for i in range(5):  # the numeric knobs (not by_churn)
            for f in (step, 1 / step):
                y = list(x)
                y[i] = int(y[i] * f) if i == 0 else min(1.0, y[i] * f) if i == 1 else max(1.0, y[i] * f) if i >= 3 \
                    else y[i] * f
                moves.append(tuple(y))
        best = min(moves, key=error)
        if error(best) < error(x):
            x = best
        else:
            step = step ** 0.5
    fitted = dataclasses.replace(options(*x), requests=R)
    syn = synth_trace(fitted)
    syn_ranks = lru_ranks(syn, True)
    got = curve(syn, ratios, syn_ranks)
    err = np.abs(got - target) / np.maximum(target, 1e-9)
    report = {
        "ratios": ratios, "real_curve": [round(float(v), 3) for v in target],
        "synthetic_curve": [round(float(v), 3) for v in got], "relative_error": [round(float(e), 4) for e in err],
        "max_relative_error": round(float(err.max()), 4), "within_15_percent": bool(err.max() <= 0.15),
        "options": dataclasses.asdict(fitted), "measured": k, "evaluations": len(evals),
        "real_stats": trace_stats(real, real_ranks), "synthetic_stats": trace_stats(syn, syn_ranks),
    }
    return fitted, syn, report


def load_fitted(path: str) -> SynthOptions:
    """The fitted options of a `ess trace synth --like` report (its "options")."""
    try:
        with open(path) as f:
            options = json.load(f)["options"]
        return SynthOptions(**options)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a fit report of `ess trace synth --like` ({type(e).__name__}: {e})") from e


def scaled(fitted: SynthOptions, topk: int, context: int) -> SynthOptions:
    """The fitted locality carried to another shape: what counts top-k entries (the local window, the churn) scales
    with top-k, what counts positions of the context (the working-set pools) with the context; sinks, the fresh
    share, the pool's skew and spread stay. The decode benchmark's rows with real-trace locality (docs/gpu.md)."""
    k, c = topk / fitted.topk, context / fitted.context
    hi = max(1, round(fitted.churn_max * k))
    pool = max(hi, round(fitted.pool * c))
    return dataclasses.replace(fitted, topk=topk, context=context, window=max(1, round(fitted.window * k)),
                               churn_min=min(hi, round(fitted.churn_min * k)), churn_max=hi, pool=min(pool, context),
                               pool_min=None if fitted.pool_min is None else
                               max(1, min(pool, round(fitted.pool_min * c))))
