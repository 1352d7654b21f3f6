"""ESS's own simulator terms measured on a GPU (docs/simulator.md, "Measured costs"), read from the GPU kit's kit.json
(`bash benchmark/gpu/run.sh OUT kit`) and, optionally, benchmark/bookkeeping.py's bookkeeping.json:

    h2d(rows)          FlashTrans H2D of `rows` latent rows in one launch: kit.json flashtrans.rows, the serving
                       backend's GB/s by row count (launch included), linear in log(rows) between the measured counts
    lru(batch, S, slots)
                       one layer's LRU step: bookkeeping.json's cases (by S query rows, at its largest buffer; per
                       case the fastest kernel equal to the torch path, as `auto` serves: fused_us in files from
                       before the CUDA kernel; linear in slots per request at the slope between its two buffers,
                       assumed the same for every S), else kit.json bookkeeping_us_per_layer (S = 1, slots not
                       scaled); linear in batch
    split(mode, batch, misses)
                       what DA / DBA add to one layer. DA: with kit.json da_split.miss_kernel (DA's Attn1 over the
                       misses, ess.core.kernels.miss_attention), Attn0 + miss kernel + merge - one FlashMLA call, by misses
                       per request, at the split's batch; without it (an older kit.json), the overlap rows at 0
                       misses (one full layer, CUDA graphs, Attn1 a second full call): DA - NONE, at the kit's batch.
                       Either scales with the attention time by batch (kit.json flashmla.attn_us). DBA: DA's plus
                       DBA - DA at 0 misses, whose extra launches do not scale. The fused copy-attend
                       (da_split.fused_copy_attend) is reported by the kit, not charged.
    attention(batch)   one FlashMLA V3.2 sparse decode call, reported beside the modelled one
    rest               with a decode.json of the whole layer (benchmark/decode_gpu.py --rest measured): one layer's
                       compute after attention by tokens (MeasuredRest), for the baseline and ESS alike
    indexer            with benchmark/indexer_kernels.py's indexer.json: the indexer's logits and top-k by query rows x
                       context (MeasuredIndexer), for the baseline and ESS alike

Linear interpolation between measured points and linear extrapolation past them (the two nearest points); what a
file lacks, and had to be assumed, is listed in `assumed`.
"""

from __future__ import annotations

import json
import math

import numpy as np

from ess.core import layout


def _serving_us(case: dict) -> float:
    """A bookkeeping case's LRU step as served: the fastest kernel whose results equalled the torch path's."""
    exact = [case[k[: -len("_equals_torch")] + "_us"] for k, v in case.items()
             if k.endswith("_equals_torch") and v is True and isinstance(case.get(k[: -len("_equals_torch")] + "_us"), (int, float))]
    return min(exact) if exact else case["fused_us"]


class MeasuredError(ValueError):
    """A measurement file that is unreadable or lacks a field the simulator needs; the message names both."""


def _field(doc: dict, path: str, where: str):
    cur = doc
    for key in path.split("."):
        if not isinstance(cur, dict) or key not in cur:
            raise MeasuredError(f"{where}: no {path!r} field (a kit.json from `bash benchmark/gpu/run.sh OUT kit` has it)")
        cur = cur[key]
    return cur


def _number(value, path: str, where: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            (positive and value <= 0):
        raise MeasuredError(f"{where}: {path!r} must be a finite {'positive ' if positive else ''}number, got {value!r}")
    return float(value)


def _points(xs, ys, path: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    if len(xs) == 0:
        raise MeasuredError(f"{where}: {path!r} holds no measurement")
    order = np.argsort(xs)
    x, y = np.asarray(xs, float)[order], np.asarray(ys, float)[order]
    if len(np.unique(x)) != len(x):
        raise MeasuredError(f"{where}: {path!r} measures the same point twice")
    return x, y


def _interp(x: float, xs: np.ndarray, ys: np.ndarray) -> float:
    """Linear between points, linear past them (the two nearest), a constant with one point."""
    if len(xs) == 1:
        return float(ys[0])
    if x < xs[0] or x > xs[-1]:
        i = 0 if x < xs[0] else len(xs) - 2
        return float(ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i]))
    return float(np.interp(x, xs, ys))


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise MeasuredError(f"--measured {path}: not a readable JSON file ({type(e).__name__}: {e})") from e
    if not isinstance(doc, dict):
        raise MeasuredError(f"--measured {path}: a JSON object expected (kit.json or bookkeeping.json)")
    return doc


class MeasuredCosts:
    """ess.analysis.sim.cost.EssCosts' terms from GPU measurements (seconds)."""

    rest: "MeasuredRest | None" = None  # the rest of a layer, from a whole-layer decode.json (load_measured)
    indexer: "MeasuredIndexer | None" = None  # the indexer's logits and top-k, from an indexer.json (load_measured)

    def __init__(self, kit_path: str, bookkeeping_path: str | None = None):
        where = f"--measured {kit_path}"
        kit = _read(kit_path)
        if "cases" in kit and "flashtrans" not in kit:
            raise MeasuredError(f"{where}: a bookkeeping.json; give the kit's kit.json first (it holds FlashTrans, "
                                "FlashMLA and the overlap modes), then bookkeeping.json")
        self.device = str(_field(kit, "device", where))
        self.date = str(kit.get("date", "undated"))
        self.assumed: list[str] = []
        # FlashTrans by row count, the backend the serving path runs
        ft = _field(kit, "flashtrans", where)
        backend = _field(ft, "backend", where + " flashtrans")
        rows = _field(ft, "rows", where + " flashtrans")
        if not isinstance(rows, list):
            raise MeasuredError(f"{where}: 'flashtrans.rows' must be a list")
        h2d_key, d2h_key = f"{backend}_h2d_gbps", f"{backend}_d2h_gbps"
        for i, r in enumerate(rows):
            for key in ("rows", h2d_key, d2h_key):
                _number(_field(r, key, f"{where} flashtrans.rows[{i}]"), f"flashtrans.rows[{i}].{key}", where)
        self.flashtrans_backend = backend
        self._h2d = _points([math.log(r["rows"]) for r in rows], [r[h2d_key] for r in rows], "flashtrans.rows", where)
        self._d2h = _points([math.log(r["rows"]) for r in rows], [r[d2h_key] for r in rows], "flashtrans.rows", where)
        # FlashMLA by batch
        attn = _field(kit, "flashmla.attn_us", where)
        if not isinstance(attn, dict):
            raise MeasuredError(f"{where}: 'flashmla.attn_us' must map batch to microseconds")
        try:
            batches = [int(b) for b in attn]
        except ValueError as e:
            raise MeasuredError(f"{where}: 'flashmla.attn_us' keys must be batch sizes ({e})") from e
        self._attn = _points(batches, [_number(v, f"flashmla.attn_us.{b}", where) for b, v in attn.items()],
                             "flashmla.attn_us", where)
        # DA / DBA: one layer at 0 misses, by mode
        ov = _field(kit, "overlap", where)
        self.split_batch = _number(_field(ov, "batch", where + " overlap"), "overlap.batch", where)
        # rows without `attn1` are from before issue 33: DA's Attn1 was a second full call ("calls")
        at0 = {r.get("mode"): r.get("median_ms") for r in _field(ov, "rows", where + " overlap")
               if isinstance(r, dict) and r.get("misses_per_request") == 0 and r.get("attn1") in (None, "calls")}
        for mode in ("none", "da", "dba"):
            _number(at0.get(mode), f"overlap.rows (mode {mode}, misses_per_request 0).median_ms", where)
        self.da_us_at = max(0.0, (at0["da"] - at0["none"]) * 1e3)
        self.dba_extra_us = max(0.0, (at0["dba"] - at0["da"]) * 1e3)
        self._da_miss = self._miss_kernel(kit, where)
        self.da_cost = ("da_split.miss_kernel: Attn0 + miss kernel + merge - one call, by misses per request"
                        if self._da_miss is not None else "overlap rows at 0 misses: DA - NONE (a second full call)")
        # The LRU step by batch and query rows
        self._lru: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._lru_slots: dict[int, float] = {}  # the buffer (slots per request) each S's figures were measured at
        self._lru_per_slot = None  # microseconds per slot by batch (bookkeeping.json with two buffers), else None
        self.sources = [kit_path]
        if bookkeeping_path is not None:
            self._lru_from_bookkeeping(bookkeeping_path)
        else:
            bk = _field(kit, "bookkeeping_us_per_layer.batches", where)
            pts = [(int(b), _number(_field(v, "lru_step_us", f"{where} bookkeeping_us_per_layer.batches.{b}"),
                                    f"bookkeeping_us_per_layer.batches.{b}.lru_step_us", where)) for b, v in bk.items()]
            self._lru[1] = _points([b for b, _ in pts], [u for _, u in pts], "bookkeeping_us_per_layer", where)
        self.source = f"measured: {', '.join(self.sources)} ({self.device}, {self.date})"

    def _miss_kernel(self, kit: dict, where: str):
        """DA's added compute by misses per request from da_split.miss_kernel (None without it): (batch, misses,
        microseconds over one call)."""
        rows = kit.get("da_split", {}).get("miss_kernel") if isinstance(kit.get("da_split"), dict) else None
        if not rows:
            return None
        if not isinstance(rows, list):
            raise MeasuredError(f"{where}: 'da_split.miss_kernel' must be a list")
        one = _number(_field(kit, "da_split.unsplit_us", where), "da_split.unsplit_us", where)
        batch = _number(_field(kit, "da_split.batch", where), "da_split.batch", where)
        for i, r in enumerate(rows):
            _number(_field(r, "misses_per_request", f"{where} da_split.miss_kernel[{i}]"),
                    f"da_split.miss_kernel[{i}].misses_per_request", where, positive=False)
            _number(_field(r, "total_us", f"{where} da_split.miss_kernel[{i}]"), f"da_split.miss_kernel[{i}].total_us", where)
        pts = _points([r["misses_per_request"] for r in rows], [max(0.0, r["total_us"] - one) for r in rows],
                      "da_split.miss_kernel", where)
        return batch, pts

    def _lru_from_bookkeeping(self, path: str) -> None:
        where = f"--measured {path}"
        doc = _read(path)
        cases = _field(doc, "cases", where)
        if not isinstance(cases, list) or not cases:
            raise MeasuredError(f"{where}: 'cases' must be a non-empty list (benchmark/bookkeeping.py writes it)")
        for i, c in enumerate(cases):
            for key in ("batch", "rows_per_step", "buffer_tokens", "fused_us"):
                _number(_field(c, key, f"{where} cases[{i}]"), f"cases[{i}].{key}", where)
        widest = None  # (slot range, S, C_lo, C_hi): the cases that measure the cost of a slot
        for S in sorted({int(c["rows_per_step"]) for c in cases}):
            mine = [c for c in cases if c["rows_per_step"] == S]
            Cs = sorted({c["buffer_tokens"] for c in mine})
            C = Cs[-1]  # the larger buffer: the kernel's cost grows with slots
            at = [c for c in mine if c["buffer_tokens"] == C]
            self._lru[S] = _points([c["batch"] for c in at], [_serving_us(c) for c in at], f"cases (S = {S})", where)
            self._lru_slots[S] = C
            if len(Cs) > 1 and (widest is None or Cs[-1] - Cs[0] > widest[0]):
                widest = (Cs[-1] - Cs[0], S, Cs[0], Cs[-1])
        if widest is not None:  # microseconds per slot by batch, between the smallest and the largest buffer
            _, S, lo, hi = widest
            us = {(c["batch"], c["buffer_tokens"]): _serving_us(c) for c in cases if c["rows_per_step"] == S}
            both = sorted(b for b, C in us if C == lo and (b, hi) in us)
            if both:
                self._lru_per_slot = _points(both, [(us[b, hi] - us[b, lo]) / (hi - lo) for b in both],
                                             f"cases (S = {S}, buffers {lo} and {hi})", where)
                self._lru_per_slot_from = (S, lo, hi)
        if doc.get("device") not in (None, self.device):
            self.assumed.append(f"the LRU step measured on {doc['device']}, the rest on {self.device}")
        self.sources.append(path)

    def h2d(self, rows: float) -> float:
        if rows <= 0:
            return 0.0
        gbps = max(1e-3, _interp(math.log(rows), *self._h2d))
        return rows * layout.LATENT_ROW_BYTES / (gbps * 1e9)

    def d2h(self, rows: float) -> float:
        if rows <= 0:
            return 0.0
        return rows * layout.LATENT_ROW_BYTES / (max(1e-3, _interp(math.log(rows), *self._d2h)) * 1e9)

    def lru(self, batch: float, rows_per_step: int, slots: float | None = None) -> float:
        have = sorted(self._lru)
        S = min(have, key=lambda s: (abs(s - rows_per_step), s))
        us = max(0.0, _interp(batch, *self._lru[S]))
        C = self._lru_slots.get(S)
        if slots is not None and C is not None and self._lru_per_slot is not None and slots != C:
            # the kernel scans each request's slots (victim search, hit flags): linear in slots, at the slope the
            # widest pair of buffers measured, whatever S (assumed), never below zero
            per = max(0.0, _interp(batch, *self._lru_per_slot))
            us = max(0.0, us + per * (slots - C))
            S0, lo, hi = self._lru_per_slot_from
            note = (f"LRU step linear in slots per request, at the slope measured between buffers of {lo} and {hi} "
                    f"slots ({S0} query row{'s' if S0 > 1 else ''}), applied to every query-row count")
            if note not in self.assumed:
                self.assumed.append(note)
        if S != rows_per_step:  # scaled by query rows: assumed
            note = f"LRU step for {rows_per_step} query rows scaled from the {S}-row measurement (x {rows_per_step / S:g})"
            if note not in self.assumed:
                self.assumed.append(note)
            us *= rows_per_step / S
        return us * 1e-6

    def attention(self, batch: float) -> float:
        return max(0.0, _interp(batch, *self._attn)) * 1e-6

    def split(self, mode: str, batch: float, misses: float = 0.0) -> float:
        if mode == "none":
            return 0.0
        if self._da_miss is not None:
            at, pts = self._da_miss
            da = max(0.0, _interp(misses, *pts)) * 1e-6 * self.attention(batch) / self.attention(at)
        else:
            da = self.da_us_at * 1e-6 * self.attention(batch) / self.attention(self.split_batch)
        if mode == "da":
            return da
        if mode == "dba":
            return da + self.dba_extra_us * 1e-6
        raise ValueError(f"overlap mode must be one of none, da, dba; got {mode!r}")

    def describe(self) -> dict:
        return {"source": self.source, "device": self.device, "date": self.date, "da_cost": self.da_cost,
                "rest": None if self.rest is None else self.rest.source,
                "indexer": None if self.indexer is None else self.indexer.source, "assumed": list(self.assumed)}


class MeasuredRest:
    """The rest of a layer after attention, measured on a GPU by the decode stack (decode.json's rows' `rest_ms`,
    docs/gpu.md "The whole layer"), by the tokens a layer runs (a row's batch x query rows; a two-batch-overlap row's
    parts are micro-batch A's): post(tokens, moe) the compute, the MoE layer's less its all-to-all wait (which the
    simulator models as the layer's comm) or the dense layer's; lm_head(tokens). Linear between the measured token
    counts and past them (the two nearest); the same count measured twice (several modes of one stack) is averaged."""

    def __init__(self, path: str):
        where = f"--measured {path}"
        doc = _read(path)
        if doc.get("whole_layer") is not True:
            raise MeasuredError(f"{where}: a decode.json with 'whole_layer' true expected (benchmark/decode_gpu.py "
                                "--rest measured)")
        pts: dict[float, list[tuple[float, float, float]]] = {}
        for i, r in enumerate(_field(doc, "rows", where)):
            rest = r.get("rest_ms") if isinstance(r, dict) else None
            if not rest:
                continue
            tokens = (r["batch"] // 2 if r.get("tbo") else r["batch"]) * r.get("query_rows", 1)
            moe = _number(rest.get("moe_layer"), f"rows[{i}].rest_ms.moe_layer", where)
            wait = _number(rest.get("comm_wait"), f"rows[{i}].rest_ms.comm_wait", where, positive=False)
            dense = _number(rest.get("dense_layer"), f"rows[{i}].rest_ms.dense_layer", where)
            head = _number(rest.get("lm_head"), f"rows[{i}].rest_ms.lm_head", where)
            pts.setdefault(float(tokens), []).append((max(0.0, moe - wait), dense, head))
        if not pts:
            raise MeasuredError(f"{where}: no row has 'rest_ms' (benchmark/decode_gpu.py --rest measured writes it)")
        xs = sorted(pts)
        mean = [np.mean(pts[x], axis=0) for x in xs]
        self._moe, self._dense, self._head = (_points(xs, [m[k] for m in mean], "rows.rest_ms", where) for k in range(3))
        self.ep, self.machine = doc.get("ep"), str(doc.get("machine", "unknown"))
        self.source = f"{path} ({self.machine}, EP {self.ep}, {len(xs)} token counts)"

    def post(self, tokens: float, moe: bool) -> float:
        return max(0.0, _interp(tokens, *(self._moe if moe else self._dense))) * 1e-3

    def lm_head(self, tokens: float) -> float:
        return max(0.0, _interp(tokens, *self._head)) * 1e-3


class MeasuredIndexer:
    """The indexer's logits and top-k measured on a GPU by benchmark/indexer_kernels.py (indexer.json's `cases`), by the
    index-K positions a layer scores (query rows x context: every query row reads its request's rows): time(tokens,
    context) in seconds. Per case the fastest path whose top-k equalled select_topk's (keys, radix or fused: what
    ess.core.kernels.indexer.SELECT would be set to), as the LRU step's fastest exact kernel; the indexer's projections
    stay the roofline's. Linear between the measured products and past them (the two nearest)."""

    PATHS = (("keys", "indexer_topk_us", "topk_exact"), ("radix", "indexer_radix_us", "radix_exact"),
             ("fused", "indexer_fused_us", "fused_exact"))

    def __init__(self, path: str):
        where = f"--measured {path}"
        doc = _read(path)
        xs, ys, served = [], [], set()
        for i, case in enumerate(_field(doc, "cases", where)):
            exact = [(_number(case[us], f"cases[{i}].{us}", where), name) for name, us, ok in self.PATHS
                     if us in case and case.get(ok) is True]
            if not exact:
                raise MeasuredError(f"{where}: cases[{i}] has no indexer path whose top-k was exact ('topk_exact')")
            best_us, name = min(exact)
            xs.append(_number(case.get("batch"), f"cases[{i}].batch", where)
                      * _number(case.get("context"), f"cases[{i}].context", where))
            ys.append(best_us)
            served.add(name)
        self._pts = _points(xs, ys, "cases", where)
        self.device = str(doc.get("device", "unknown"))
        self.source = f"{path} ({self.device}, {len(xs)} cases, fastest exact path: {'/'.join(sorted(served))})"

    def time(self, tokens: float, context: float) -> float:
        return max(0.0, _interp(tokens * context, *self._pts)) * 1e-6


def _kind(path: str) -> str:
    """A further --measured file's kind, by its content."""
    doc = _read(path)
    if "rows" in doc:
        return "decode"
    return "indexer" if "default_launch" in doc else "bookkeeping"


def load_measured(paths: list[str]) -> MeasuredCosts:
    """`--measured KIT [BOOKKEEPING] [DECODE] [INDEXER]`: a kit.json first, then a bookkeeping.json, a whole-layer
    decode.json and an indexer.json, each optional, told apart by their content."""
    if not 1 <= len(paths) <= 4:
        raise MeasuredError(f"--measured takes a kit.json and optionally a bookkeeping.json, a decode.json and an "
                            f"indexer.json, got {len(paths)} files")
    kinds = {"bookkeeping": None, "decode": None, "indexer": None}
    for path in paths[1:]:
        kind = _kind(path)
        if kinds[kind] is not None:
            raise MeasuredError(f"--measured {path}: a second {kind} file")
        kinds[kind] = path
    m = MeasuredCosts(paths[0], kinds["bookkeeping"])
    if kinds["decode"] is not None:
        m.rest = MeasuredRest(kinds["decode"])
        m.source += f"; the rest of a layer: {m.rest.source}"
    if kinds["indexer"] is not None:
        m.indexer = MeasuredIndexer(kinds["indexer"])
        m.source += f"; the indexer: {m.indexer.source}"
    return m
