"""The decode benchmark's report (benchmark/decode_gpu.py, docs/gpu.md): decode.json's summary keys and its plot,
from the rows the benchmark measured."""

from __future__ import annotations


def best_at_largest(ess: list[dict]) -> dict:
    """The fastest ESS row among each ratio's largest batch."""
    largest = {r["ratio"]: max(x["batch"] for x in ess if x["ratio"] == r["ratio"]) for r in ess}
    return max((r for r in ess if r["batch"] == largest[r["ratio"]]), key=lambda r: r["tokens_per_s"])


def ratio_by_batch(base: list[dict], ess: list[dict]) -> list[dict]:
    """ESS's best over the baseline at every batch both ran (the baseline's: up to its memory wall), with the
    requests ESS held resident there."""
    out = []
    for r in sorted(base, key=lambda r: r["batch"]):
        at = [e for e in ess if e["batch"] == r["batch"]]
        if at:
            best = max(at, key=lambda e: e["tokens_per_s"])
            out.append({"batch": r["batch"], "ratio": round(best["tokens_per_s"] / r["tokens_per_s"], 4),
                        "resident_requests": best.get("resident_requests")})
    return out


def summary(rows: list[dict], s) -> dict:
    """decode.json's summary (summary_of) of the rows with the paper's locality, and under locality_fit the same of
    the rows with locality fitted to real traces, against the same baseline."""
    fit = [r for r in rows if r.get("locality") == "fit"]
    rows = [r for r in rows if r.get("locality") != "fit"]
    out = summary_of(rows, s) | indexer_floor(rows)
    fitted = summary_of([r for r in rows if r["mode"] == "baseline"] + fit, s) if fit else {}
    return out | ({"locality_fit": fitted} if fitted else {})


def indexer_floor(rows: list[dict]) -> dict:
    """The indexer (layer 0's, with its top-k) over its byte floor at ESS's largest decode batch of each context,
    and worst_over_floor, the larger (issue 48's figure); {} where no row measured it."""
    ess = [r for r in rows if r["mode"] not in ("baseline", "hisparse") and r["query_rows"] == 1
           and "indexer_over_floor" in r]
    by_context = {}
    for ctx in sorted({r["context"] for r in ess}):
        top = best_at_largest([r for r in ess if r["context"] == ctx])
        by_context[str(ctx)] = {"batch": top["batch"], "indexer_over_floor": top["indexer_over_floor"]}
    if not by_context:
        return {}
    return {"indexer_over_floor": by_context,
            "worst_over_floor": max(v["indexer_over_floor"] for v in by_context.values())}


def summary_of(rows: list[dict], s) -> dict:
    """gain_32k_max_batch: the best ESS mode at its largest batch over the baseline at its largest batch (hybrid
    tokens/s, the smallest context, decode); ratio_by_batch: ESS's best over the baseline at every batch both ran
    (up to the baseline's memory wall); exposed_transfer_share: ESS's exposed transfer over its step at its largest
    batch (decode, mode plan where it ran, else the best); ratio_small_batch: the smaller of those at batch 1 and 2;
    the same with MTP verify rows under the keys ending in _mtp; gain_<N>k_max_batch(_mtp): the decode (MTP verify)
    gain at each longer context; gain_vs_hisparse_max_batch: ESS's best over the HiSparse arm, each at its
    largest batch."""
    out = {}
    ctx = min(r["context"] for r in rows) if rows else None
    for S in sorted({r["query_rows"] for r in rows}):
        at = [r for r in rows if r["context"] == ctx and r["query_rows"] == S]
        base = [r for r in at if r["mode"] == "baseline"]
        hisparse = [r for r in at if r["mode"] == "hisparse"]
        ess = [r for r in at if r["mode"] not in ("baseline", "hisparse")]
        if not base or not ess:
            continue
        base_top = max(base, key=lambda r: r["batch"])
        best_top = best_at_largest(ess)
        by_batch = ratio_by_batch(base, ess)
        small = [x["ratio"] for x in by_batch if x["batch"] in (1, 2)]
        key = "" if S == 1 else "_mtp"
        out |= {f"gain_32k_max_batch{key}": round(best_top["tokens_per_s"] / base_top["tokens_per_s"], 4),
                f"best_ess{key}": {k: best_top[k] for k in ("mode", "ratio", "batch")},
                f"ratio_small_batch{key}": round(min(small), 4) if small else None,
                f"ratio_by_batch{key}": by_batch}
        if S == 1 and "step_ms" in best_top:  # ESS's exposed transfer at its largest batch, in the mode plan picks where it ran
            same = [r for r in ess if (r["ratio"], r["batch"]) == (best_top["ratio"], best_top["batch"])]
            at_plan = next((r for r in same if r["mode"] == "plan"), best_top)
            out |= {"exposed_transfer_share": round(at_plan["exposed_transfer_ms"] / at_plan["step_ms"], 4),
                    "exposed_transfer_mode": at_plan["mode"]}
        if hisparse:  # each at its largest batch
            h_top = max(hisparse, key=lambda r: r["batch"])
            out |= {"gain_vs_hisparse_max_batch": round(best_top["tokens_per_s"] / h_top["tokens_per_s"], 4),
                    "hisparse_max_batch": {k: h_top[k] for k in ("batch", "tokens_per_s", "buffer_tokens")},
                    "hisparse_gain_over_baseline": round(h_top["tokens_per_s"] / base_top["tokens_per_s"], 4)}
    for other in sorted({r["context"] for r in rows} - {ctx}):  # the longer contexts' gains, by name
        for S in sorted({r["query_rows"] for r in rows if r["context"] == other}):
            at = [r for r in rows if r["context"] == other and r["query_rows"] == S]
            base = [r for r in at if r["mode"] == "baseline"]
            ess = [r for r in at if r["mode"] not in ("baseline", "hisparse")]
            if base and ess:
                base_top = max(base, key=lambda r: r["batch"])
                key = f"gain_{other // 1024}k_max_batch" + ("" if S == 1 else "_mtp")
                out[key] = round(best_at_largest(ess)["tokens_per_s"] / base_top["tokens_per_s"], 4)
    return {"gain_context": ctx, **out} if out else {}


def plot(doc: dict, path: str) -> None:
    if not doc["rows"]:  # every configuration failed: decode.json's errors say why
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in doc["rows"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6.5 * len(contexts), 4), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        rows = [r for r in doc["rows"] if r["context"] == ctx]
        def key(r):
            return r["mode"], r["ratio"], r["query_rows"], r.get("locality", "paper")

        keys = sorted({key(r) for r in rows}, key=lambda k: (k[0] != "baseline", str(k)))
        for i, (mode, ratio, S, loc) in enumerate(keys):
            pts = sorted((r for r in rows if key(r) == (mode, ratio, S, loc)), key=lambda r: r["batch"])
            label = ("baseline" if mode == "baseline" else "HiSparse (modelled policy)" if mode == "hisparse"
                     else f"ESS {mode}, ratio {ratio}") + ("" if S == 1 else f", verify {S}") \
                + ("" if loc == "paper" else ", locality fitted to real traces")
            ax.plot([r["batch"] for r in pts], [r["tokens_per_s"] for r in pts], marker="o" if S == 1 else "^",
                    ls="-" if S == 1 else ":", color=f"C{i % 10}", label=label)
        ax.axvline(rows[0]["memory_wall_batch"], color="k", ls="--", lw=1, label="memory wall (baseline)")
        ax.set_xlabel("batch (requests)")
        ax.set_ylabel("tokens/s (whole layer measured, the network modelled)" if doc.get("whole_layer")
                      else "tokens/s (hybrid: measured attention + modelled rest)")
        ax.set_title(f"context {ctx}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
