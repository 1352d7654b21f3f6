"""Progressive PD transfer (issue 36), simulated: what the plugin runs over Mooncake (docs/pd.md, "Progressive PD
transfer"), not timed on a cluster.

Without it a decode node waits for a request's whole cache before its first step. Progressive transfer sends, in
order, (1) every token's index-K rows and the LRU-Warmup state, (2) the latent pages of the warm-up set, (3) the other
latent pages in slices; decode starts once (1) and (2) have landed, and a step whose misses include a row not yet
landed waits: its decode node names the (layer, page) blocks, which the prefill node sends after the slice in flight.
The model and every term's source: docs/simulator.md, "Progressive PD transfer".
"""

from __future__ import annotations

import math

from ess.analysis.sim import cost
from ess.analysis.sim.engine import HARDWARE, EP, layer_misses, load_calibration, profile_for, simulate
from ess.analysis.sim.profile import ProfileError
from ess.analysis.sim.specs import DSV32, ModelSpec, get_hardware, get_model
from ess.core.settings import DEFAULT_SPARSE_RATIO, PROGRESSIVE_SLICE_PAGES, capacity

LINK_GBPS = (25.0, 50.0, 100.0, 200.0, 400.0)  # the range
CONTEXTS = (32768, 131072)
TOKENS = 64  # time to the k-th decode token
GOAL = {"context": 131072, "link_gbps": 100.0, "first_token_speedup": 2.0}  # the goal
PAGE_TOKENS = 64  # SGLang's KV page for DeepSeek-V3.2 (FlashMLA's FP8 sparse decode): a row asked for brings its page


def warmup_state_bytes(spec: ModelSpec) -> int:
    """The LRU-Warmup row a prefill node sends per request: an 8-int32 header and 4 x top-k int32 entries per layer
    (sglang_ess.pd.warmup.row_ints; docs/pd.md, "LRU-Warmup with PD")."""
    return 4 * (8 + spec.layers * 4 * spec.index_topk)


def warm_rows(spec: ModelSpec, context: int, ratio: float) -> int:
    """Latent rows per layer the warm-up set names: what the decode node's slots keep of the N = 4 x top-k entries
    (docs/pd.md). Taken as full (the warm-up windows' union has at least that many positions): an upper bound on
    phase 2."""
    slots = capacity(None, ratio, context, spec.index_topk)
    return min(slots, 4 * spec.index_topk, context)


def phases(spec: ModelSpec, context: int, ratio: float) -> dict:
    """Bytes of one request's transfer by phase. A full transfer sends the same bytes (SGLang's DSA pool sends
    index-K beside the latent rows), the warm-up state last with the metadata."""
    warm = warm_rows(spec, context, ratio)
    return {"warm_rows_per_layer": warm,
            "phase1_bytes": context * spec.layers * spec.index_row_bytes + warmup_state_bytes(spec),
            "phase2_bytes": warm * spec.layers * spec.latent_row_bytes,
            "phase3_bytes": (context - warm) * spec.layers * spec.latent_row_bytes}


def step_misses(profile: dict | None, misses: list[float], steps: int) -> list[float]:
    """Misses per request-step summed over the layers, step by step: the layers' means, shaped by the profile's
    misses after warm-up by decode step where it has them (`misses_by_step.warmup`; past its last step, the mean)."""
    total = sum(misses)
    curve = ((profile or {}).get("misses_by_step") or {}).get("warmup")
    if not curve:
        return [total] * steps
    if not isinstance(curve, list) or not all(isinstance(x, (int, float)) and 0 <= x < math.inf for x in curve):
        raise ProfileError(f"miss profile {profile.get('source', '')!r}: 'misses_by_step.warmup' must be a list of "
                           "non-negative numbers")
    mean = sum(curve) / len(curve)
    return [total * (curve[s] / mean if s < len(curve) and mean > 0 else 1.0) for s in range(steps)]


ORDERS = ("full", "demand", "stream")  # a full transfer; progressive with a step's unlanded rows sent first, or not


def timeline(link_gbps: float, ph: dict, row_bytes: int, join_s: float, step_s: float, misses: list[float],
             accept: float, tokens: int, order: str, layers: int = DSV32.layers, block_rows: int = 1,
             slice_bytes: float = 0.0) -> dict:
    """One request's first decode steps after its prefill (t = 0: the prefill node starts sending). The link is the
    request's alone and never idles until the last byte lands. full: the first step waits for the whole transfer.
    Progressive: decode starts when phases 1 and 2 have landed; phase 3 streams on in an order unrelated to the rows
    decode reads, so a step's miss finds its row not landed yet with the share of phase 3 still to come (every miss
    taken for a first touch, a row outside the warm-up set: an upper bound). demand: those rows are sent ahead of the
    stream, each as a block of `block_rows` rows of its layer (the plugin: a page), after the slice of the stream in
    flight (half of `slice_bytes` expected, once per layer that waits, its misses spread evenly over the `layers`),
    and the step waits for that; the blocks take the link from the stream. stream: nothing is reordered, and the step
    waits until the last of them lands (expected: the rest of phase 3 x n / (n + 1) for n such rows)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    rate = link_gbps * 1e9 / 8  # bytes per second; inf: the floor
    total = ph["phase1_bytes"] + ph["phase2_bytes"] + ph["phase3_bytes"]
    ready = (total if order == "full" else ph["phase1_bytes"] + ph["phase2_bytes"]) / rate
    phase3_rows = 0.0 if order == "full" else ph["phase3_bytes"] / row_bytes
    steps = math.ceil(tokens / accept)
    t = ready + join_s  # the warm-up gather into the GPU slots, then the first step
    demanded = demand_bytes = wait_s = waiting = first_wait_rows = first = 0.0
    for s in range(steps):
        streamed = max(0.0, (t - ready) * rate - demand_bytes) / row_bytes  # the link's time less the blocks'
        sent = min(phase3_rows, streamed) if phase3_rows else 0.0
        untouched = phase3_rows - demanded  # phase-3 rows no step has asked for
        unlanded = (phase3_rows - sent) / untouched if untouched > 0 else 0.0  # their share not landed yet
        rows = min(misses[s] * unlanded, phase3_rows - sent)  # expected; never more than are still to come
        waiting += 1 - (1 - unlanded) ** misses[s]  # chance the step misses at least one unlanded row
        if order == "demand":
            demanded += rows
            blocks = rows * block_rows * row_bytes
            demand_bytes += blocks
            waiting_layers = layers * (1 - (1 - unlanded) ** (misses[s] / layers)) if rows > 0 else 0.0
            wait = (blocks + waiting_layers * slice_bytes / 2) / rate
        else:
            wait = (phase3_rows - sent) * row_bytes / rate * rows / (rows + 1)
        wait_s += wait
        t += step_s + wait
        if s == 0:
            first, first_wait_rows = t, rows
    return {"ready_s": ready, "first_token_s": first, "token_k_s": t, "steps": steps, "wait_s": wait_s,
            "steps_waiting": waiting, "first_step_wait_rows": first_wait_rows}


def pd_rows(link_gbps: list[float] = LINK_GBPS, contexts: list[int] = CONTEXTS, progressive: bool = True,
            tokens: int = TOKENS, hardware: str = HARDWARE, mtp: int = 2, accept: float = 1.7,
            batch: int | None = None, sparse_ratio: float = DEFAULT_SPARSE_RATIO, tbo: bool = True, ep: int = EP,
            profiles: list[dict] | None = None) -> list[dict]:
    """One row per (context, link): time to the first and the k-th decode token of a request joining a decode batch,
    after a full transfer and (progressive) after a progressive one. batch None: the largest that fits the GPU and
    the host at the ratio."""
    spec, hw = get_model("dsv32"), get_hardware(hardware)
    cal = load_calibration()
    costs = cost.modelled(cal, spec)
    dep = cost.Deployment(ep=ep, tbo=tbo)
    rows = []
    for context in contexts:
        b = batch or min(cost.max_batch(spec, hw, cal, dep, context, sparse_ratio), cost.max_batch_host(spec, hw, context))
        if b < 1:
            raise ValueError(f"--contexts {context}: not one request fits {hardware}'s GPU and host memory at "
                             f"--sparse-ratio {sparse_ratio}; give --batch-size")
        profile = profile_for(profiles, context)
        sim = simulate(hardware=hardware, context=context, mtp=mtp, accept=accept, batch=b, sparse_ratio=sparse_ratio,
                       tbo=tbo, ep=ep, profile=profile, cal=cal)
        step_s = sim["step_ms"] / 1e3
        ph = phases(spec, context, sparse_ratio)
        join_s = costs.h2d(ph["warm_rows_per_layer"] * spec.layers)  # one FlashTrans gather of the warm rows
        per_layer = layer_misses(spec, mtp, profile, sparse_ratio)[:spec.layers]  # the MTP layer's cache: not sent
        misses = step_misses(profile, per_layer, math.ceil(tokens / accept))
        floor = join_s + step_s
        slice_bytes = PROGRESSIVE_SLICE_PAGES * PAGE_TOKENS * spec.layers * spec.latent_row_bytes
        plugin = {"layers": spec.layers, "block_rows": PAGE_TOKENS, "slice_bytes": slice_bytes}
        for gbps in link_gbps:
            full = timeline(gbps, ph, spec.latent_row_bytes, join_s, step_s, misses, accept, tokens, "full")
            row = {"context": context, "link_gbps": gbps, "batch_size": b, "sparse_ratio": sparse_ratio,
                   "fits_memory": sim["fits_memory"], "fits_host_memory": sim["fits_host_memory"],
                   "step_ms": sim["step_ms"], "join_ms": round(join_s * 1e3, 3),
                   "floor_first_token_s": round(floor, 6), **ph,
                   "full_bytes": sum(ph[k] for k in ("phase1_bytes", "phase2_bytes", "phase3_bytes")),
                   "full_transfer_s": round(full["ready_s"], 6),
                   "full_first_token_s": round(full["first_token_s"], 6),
                   f"full_token{tokens}_s": round(full["token_k_s"], 6), "steps_to_token": full["steps"],
                   "misses_per_step": round(sum(misses) / len(misses), 1),
                   "profile": (profile or {}).get("source", "synthetic default")}
            if progressive:
                p = timeline(gbps, ph, spec.latent_row_bytes, join_s, step_s, misses, accept, tokens, "demand",
                             **plugin)
                rows_first = timeline(gbps, ph, spec.latent_row_bytes, join_s, step_s, misses, accept, tokens,
                                      "demand")  # rows sent alone, with no slice to wait for: the bound
                q = timeline(gbps, ph, spec.latent_row_bytes, join_s, step_s, misses, accept, tokens, "stream")
                row |= {"progressive_ready_s": round(p["ready_s"], 6),
                        "progressive_first_token_s": round(p["first_token_s"], 6),
                        f"progressive_token{tokens}_s": round(p["token_k_s"], 6),
                        "first_token_speedup": round(full["first_token_s"] / p["first_token_s"], 3),
                        f"token{tokens}_speedup": round(full["token_k_s"] / p["token_k_s"], 3),
                        "first_step_wait_rows": round(p["first_step_wait_rows"], 1),
                        "progressive_wait_ms": round(p["wait_s"] * 1e3, 3),
                        "steps_waiting": round(p["steps_waiting"], 2),
                        "rows_first_token_s": round(rows_first["first_token_s"], 6),
                        "slice_bytes": slice_bytes, "page_tokens": PAGE_TOKENS,
                        "stream_first_token_s": round(q["first_token_s"], 6),
                        f"stream_token{tokens}_s": round(q["token_k_s"], 6)}
            rows.append(row)
    return rows


def goal(rows: list[dict]) -> dict | None:
    """The issue's goal against the rows: the first token at least 2x sooner at 128K over 100 Gb/s."""
    hit = [r for r in rows if r["context"] == GOAL["context"] and r["link_gbps"] == GOAL["link_gbps"]
           and "first_token_speedup" in r]
    if not hit:
        return None
    return {**GOAL, "model_gives": hit[0]["first_token_speedup"],
            "met": hit[0]["first_token_speedup"] >= GOAL["first_token_speedup"]}


def plot_pd(rows: list[dict], path: str, tokens: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, what, label in ((axes[0], "first_token_s", "first decode token"),
                            (axes[1], f"token{tokens}_s", f"decode token {tokens}")):
        for i, context in enumerate(sorted({r["context"] for r in rows})):
            mine = [r for r in rows if r["context"] == context]
            x = [r["link_gbps"] for r in mine]
            name = f"{context // 1024}K"
            ax.plot(x, [r[f"full_{what}"] for r in mine], f"C{i}-o", ms=4, label=f"{name} full transfer")
            if f"progressive_{what}" in mine[0]:
                ax.plot(x, [r[f"progressive_{what}"] for r in mine], f"C{i}--^", ms=4, label=f"{name} progressive")
                ax.plot(x, [r[f"stream_{what}"] for r in mine], f"C{i}:", lw=1,
                        label=f"{name} progressive, waited-for blocks not sent first")
        ax.set_xscale("log")
        ax.set_xticks(sorted({r["link_gbps"] for r in rows}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("link bandwidth (Gb/s, one request's)")
        ax.set_ylabel(f"seconds to the {label}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
