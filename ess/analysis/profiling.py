"""`ess profile`: miss profiles of traces through the real cache policy (ess.analysis.replay), with plots.

The profile JSON extends the simulator's format (ess.analysis.sim.profile): per-layer mean misses per request-step at each
ratio from the first trace (with warm-up where the trace has prefill sets, as ESS runs), plus intra-layer
similarity, misses against decode step with and without warm-up, and misses against context over all traces.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ess.analysis.replay import replay_counts, replay_misses
from ess.analysis.sim.profile import FORMAT
from ess.core.settings import DEFAULT_DECAY_SHIFT, PAGE_TOKENS
from ess.core.trace import Trace


def similarity(trace: Trace) -> np.ndarray:
    """Per layer, the mean over requests and steps t >= 1 of |T_t & T_{t-1}| / |T_t| (-1 entries ignored)."""
    t = trace.topk.astype(np.int64)  # [R, steps, layers, K]
    R, S, Lyr, K = t.shape
    if S < 2:
        return np.zeros(Lyr)
    cur, prev = t[:, 1:], t[:, :-1]
    span = int(max(t.max(), 0)) + 2
    row = np.arange(R * (S - 1) * Lyr, dtype=np.int64).reshape(R, S - 1, Lyr, 1)
    key_cur = np.where(cur >= 0, row * span + cur, -1)
    key_prev = np.where(prev >= 0, row * span + prev, -2)
    inter = (np.isin(key_cur, key_prev) & (cur >= 0)).sum(-1)
    size = np.maximum((cur >= 0).sum(-1), 1)
    return (inter / size).mean(axis=(0, 1))


DISK_SHARES = [round(0.05 * i, 2) for i in range(21)]  # the page shares `page_access` reports


def page_access(trace: Trace, shares: list[float] = DISK_SHARES) -> dict:
    """How the decode steps' top-k accesses spread over latent pages (PAGE_TOKENS rows of one layer): per share x of a
    request-layer's pages, ranked coldest first by their access count over the trace, the share of accesses they
    receive, averaged over requests and layers. A disk tier that keeps the hottest pages in host frames (KVDrive's
    placement by access frequency) reads from disk the accesses of its coldest `disk_share` pages; the ranking uses
    the whole trace's counts (hindsight), where a running tier ranks by the counts so far (docs/simulator.md)."""
    t = trace.topk  # [R, steps, layers, K]
    R, _, L, _ = t.shape
    pages = -(-(int(trace.context_len.max()) + t.shape[1]) // PAGE_TOKENS)
    sel = t >= 0
    group = np.broadcast_to(np.arange(R)[:, None, None, None] * L + np.arange(L)[None, None, :, None], t.shape)
    counts = np.bincount((group * pages + t // PAGE_TOKENS)[sel], minlength=R * L * pages).reshape(R * L, pages)
    # each request-layer over the pages its context spans
    span = -(-(trace.context_len + t.shape[1]) // PAGE_TOKENS)  # [R]
    out = np.zeros(len(shares))
    for r in range(R):  # a request's pages: its own context (requests differ in length)
        c = np.sort(counts[r * L:(r + 1) * L, : span[r]], axis=1)  # coldest first
        cum = np.concatenate([np.zeros((L, 1)), np.cumsum(c, axis=1)], axis=1) / np.maximum(c.sum(1, keepdims=True), 1)
        x = np.linspace(0, 1, span[r] + 1)
        out += np.mean([np.interp(shares, x, row) for row in cum], axis=0)
    return {"disk_share": list(shares), "access_share": [round(float(v), 5) for v in out / R]}


def holds_topk(trace: Trace, ratio: float) -> bool:
    """A ratio of the trace's mean context gives at least top-k + 1 slots (below, buffer_for_ratio would give top-k + 1
    slots under the ratio's name)."""
    return math.ceil(ratio * float(trace.context_len.mean())) >= trace.topk.shape[3] + 1


def buffer_for_ratio(trace: Trace, ratio: float) -> int:
    """Slots for a ratio: the ratio of the mean context, never below top-k + 1."""
    K = trace.topk.shape[3]
    return max(K + 1, math.ceil(ratio * float(trace.context_len.mean())))


def profile_traces(
    traces: list[tuple[str, Trace]],
    ratios: list[float] | None = None,
    buffer_tokens: list[int] | None = None,
    progress: Callable[[int, int], None] | None = None,
    policy: str = "lru",
    lookahead: int | None = None,
    decay_shift: int = DEFAULT_DECAY_SHIFT,
) -> dict:
    """The profile of `policy` (ess.analysis.replay: lru, prefetch or score; MIN beside it). With prefetch, the
    rows fetched ahead per request-step go in `mean_prefetched`, which the simulator charges as transfer too."""
    if policy == "belady":
        raise ValueError("--policy belady: MIN is the bound every profile reports beside its policy, not a policy to run")
    kw = {"policy": policy, "lookahead": lookahead, "decay_shift": decay_shift}
    if (ratios is None) == (buffer_tokens is None):
        raise ValueError("give --ratios or --buffer-tokens")
    first_name, first = traces[0]
    R, steps, layers, K = first.topk.shape
    for name, tr in traces:
        if tr.topk.shape[1] == 0:
            raise ValueError(f"{name}: no decode steps to profile")
    for name, tr in traces[1:]:
        if tr.topk.shape[2:] != (layers, K):
            raise ValueError(f"{name}: {tr.topk.shape[2]} layers and top-k {tr.topk.shape[3]}, the first trace has {layers} and {K}")
    ctx0 = float(first.context_len.mean())
    if buffer_tokens is not None:
        if min(buffer_tokens) < K + 1:
            raise ValueError(f"--buffer-tokens: each must be at least top-k + 1 = {K + 1}")
        if max(buffer_tokens) > ctx0:
            raise ValueError(f"--buffer-tokens {max(buffer_tokens)}: more than the mean context of {first_name} "
                             f"({ctx0:.0f} tokens), a ratio above 1")
        pairs = sorted((b / ctx0, b) for b in buffer_tokens)
    else:
        if not ratios or any(not 0 < r <= 1 for r in ratios):
            raise ValueError(f"--ratios: one or more ratios in (0, 1], got {ratios}")
        low = [r for r in ratios if not holds_topk(first, r)]
        if low:
            raise ValueError(f"--ratios {','.join(map(str, low))}: below top-k + 1 = {K + 1} slots of the mean context "
                             f"of {first_name} ({ctx0:.0f} tokens); the smallest ratio is {(K + 1) / ctx0:.4f}")
        pairs = sorted((r, buffer_for_ratio(first, r)) for r in ratios)
    warm = first.prefill_topk is not None
    total = len(traces) * len(pairs) + 2 + len(pairs)
    done = 0

    def tick():
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    mean_misses, mean_prefetched, min_misses = [], [], []
    for _, buf in pairs:
        c = replay_counts(first, buf, warmup=warm, **kw)
        mean_misses.append(c.misses.mean(axis=(0, 1)))
        mean_prefetched.append(c.prefetched.mean(axis=(0, 1)))
        tick()
        min_misses.append(replay_misses(first, buf, warmup=warm, policy="belady").mean(axis=(0, 1)))
        tick()
    by_context = [{"trace": first_name, "context": ctx0, "mean_misses": [float(m.mean()) for m in mean_misses]}]
    for name, tr in traces[1:]:
        c = float(tr.context_len.mean())
        row = []
        for r, _ in pairs:
            row.append(float(replay_misses(tr, max(K + 1, math.ceil(r * c)), warmup=tr.prefill_topk is not None, **kw).mean()))
            tick()
        by_context.append({"trace": name, "context": c, "mean_misses": row})
    # Misses against decode step at the ratio nearest 0.2, with and without warm-up.
    r_step, b_step = min(pairs, key=lambda p: abs(p[0] - 0.2))
    cold = replay_misses(first, b_step, warmup=False, **kw).mean(axis=(0, 2))
    tick()
    warm_curve = replay_misses(first, b_step, warmup=True, **kw).mean(axis=(0, 2)) if warm else None
    tick()
    doc = {
        "format": FORMAT,
        "source": first.meta.get("source", first_name),
        "trace_kind": trace_kind(first),
        "policy": policy,
        "traces": [n for n, _ in traces],
        "num_layers": layers,
        "topk": K,
        "requests": R,
        "steps": steps,
        "context_len": ctx0,
        "ratios": [round(r, 6) for r, _ in pairs],
        "buffer_tokens": [b for _, b in pairs],
        "mean_misses": [[round(float(x), 4) for x in m] for m in mean_misses],
        # the offline optimum with the same slots (Belady's MIN, ess.analysis.belady): LRU's distance from the bound
        "min_mean_misses": [[round(float(x), 4) for x in m] for m in min_misses],
        "similarity": [round(float(x), 5) for x in similarity(first)],
        "misses_by_step": {
            "ratio": round(r_step, 6),
            "buffer_tokens": b_step,
            "cold": [round(float(x), 3) for x in cold],
            "warmup": None if warm_curve is None else [round(float(x), 3) for x in warm_curve],
        },
        "by_context": sorted(by_context, key=lambda d: d["context"]),
        "page_access": page_access(first),
    }
    if policy == "prefetch":
        doc["mean_prefetched"] = [[round(float(x), 4) for x in m] for m in mean_prefetched]
    return doc


def trace_kind(trace: Trace) -> str:
    """What a trace is, from its metadata: 'real' (a pretrained model's attention, `ess trace record --model NAME`),
    'synthetic' (`ess trace synth`), 'reference' (the mini model, random weights) or 'recorded' (anything else, a
    server's trace)."""
    source = str(trace.meta.get("source", ""))
    if "texts" in trace.meta and isinstance(trace.meta.get("model"), str):
        return "real"
    if "synthetic" in source.lower():
        return "synthetic"
    return "reference" if source.startswith("reference") else "recorded"


def rescale_profile(p: dict, layers: int, topk: int, model: str) -> dict:
    """A profile of another model's trace mapped onto `model`'s `layers` and `topk` (`ess profile --for-model`):
    each target layer takes the traced layer at the same relative depth, and misses (and prefetched rows) scale by
    topk / the trace's top-k, the share of the top-k kept. A modelling step, said in 'source' and 'rescaled'."""
    n0, k0 = p["num_layers"], p["topk"]
    pick = [round(j * (n0 - 1) / max(1, layers - 1)) for j in range(layers)]
    f = topk / k0
    out = dict(p)
    for field in ("mean_misses", "min_mean_misses", "mean_prefetched"):
        if field in p:
            out[field] = [[round(row[i] * f, 4) for i in pick] for row in p[field]]
    out["similarity"] = [p["similarity"][i] for i in pick]
    out["num_layers"], out["topk"] = layers, topk
    out["source"] = (f"{p.get('trace_kind', 'recorded').upper()} trace rescaled for {model} ({n0} layers -> {layers} by "
                     f"depth, misses x {f:g} = top-k {topk} / {k0}): {p['source']}")
    out["rescaled"] = {"model": model, "from_layers": n0, "from_topk": k0, "factor": f, "layer_of": pick}
    return out


PLOTS = ("misses_per_layer.png", "similarity.png", "misses_by_step.png", "misses_vs_context.png")  # plot_profile's


def plot_profile(p: dict, out_dir: str) -> list[str]:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    layers = np.arange(p["num_layers"])

    def save(fig, name):
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(10, 3.6))
    name = {"lru": "LRU"}.get(p.get("policy", "lru"), p.get("policy"))  # older profiles name no policy: LRU's
    for i, (r, b, m) in enumerate(zip(p["ratios"], p["buffer_tokens"], p["mean_misses"])):
        ax.plot(layers, m, marker=".", color=f"C{i}", label=f"{name}, ratio {r:.2f} ({b} slots)")
        if p.get("min_mean_misses"):  # older profiles have no MIN
            ax.plot(layers, p["min_mean_misses"][i], ls=":", color=f"C{i}", label=f"MIN (the optimum), ratio {r:.2f}")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean misses per request-step")
    ax.set_yscale("log")
    ax.set_title(f"Misses per layer (top-k {p['topk']}, context {p['context_len']:.0f}; {p['source']})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save(fig, "misses_per_layer.png")

    fig, ax = plt.subplots(figsize=(10, 3.2))
    ax.bar(layers, p["similarity"], color="C2")
    ax.set_ylim(0, 1)
    ax.set_xlabel("layer")
    ax.set_ylabel("|T_t & T_t-1| / |T_t|")
    ax.set_title("Intra-layer similarity of consecutive top-k sets", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    save(fig, "similarity.png")

    s = p["misses_by_step"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(s["cold"], "C3-", label="no warm-up")
    if s["warmup"] is not None:
        ax.plot(s["warmup"], "C0-", label="LRU-Warmup (W = 32)")
    ax.set_yscale("log")
    ax.set_xlabel("decode step")
    ax.set_ylabel("mean misses per request-layer")
    ax.set_title(f"Misses against decode step (ratio {s['ratio']:.2f})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "misses_by_step.png")

    if len(p["by_context"]) > 1:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        ctx = [d["context"] for d in p["by_context"]]
        for i, r in enumerate(p["ratios"]):
            ax.plot(ctx, [d["mean_misses"][i] for d in p["by_context"]], marker="o", label=f"ratio {r:.2f}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("mean misses per request-step")
        ax.set_title("Misses against context length", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "misses_vs_context.png")
    return paths
