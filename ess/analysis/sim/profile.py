"""Miss profiles for the simulator: per layer, mean misses per request and decode step at several Sparse Memory
Ratios. `ess profile` writes them from traces (format below); until one is given, a synthetic default stands in.

Profile JSON (the part the simulator reads):
    {"format": "ess-miss-profile/1", "num_layers": N, "ratios": [r, ...], "mean_misses": [[m_layer, ...] per ratio],
     "mean_prefetched": [[...] per ratio] (optional: rows a prefetching policy fetched ahead, docs/policies.md),
     "context_len": L (optional: the traces' mean context; `ess sim paper --profile` picks by it),
     "page_access": {"disk_share": [0 .. 1], "access_share": [...]} (optional: the accesses the coldest pages
                    receive, ess.analysis.profiling.page_access; the disk tier's model reads it)}
The simulator charges every row a layer moves, misses and prefetched rows alike, on that layer's copy: for prefetched
rows, which could move anywhere in the step, an upper bound on their cost.
"""

from __future__ import annotations

import json
import math

import numpy as np

FORMAT = "ess-miss-profile/1"


class ProfileError(ValueError):
    """A miss profile that is unreadable, of another format, or of another layer count."""


def synthetic_profile(num_layers: int = 62) -> dict:
    """SYNTHETIC, not a measurement: at ratio 0.2 the layers' mean misses per request-step spread log-uniformly over
    16.66 .. 605 (the range the ESS paper reports at ratio 0.2 and 32K context), in a fixed shuffled order; other
    ratios scale by (0.2 / r) * ((1 - r) / 0.8), which is 0 at r = 1."""
    rng = np.random.default_rng(20260)
    at_02 = np.exp(np.linspace(math.log(16.66), math.log(605.0), num_layers))[rng.permutation(num_layers)]
    ratios = [0.1, 0.2, 0.3, 0.5, 0.8]
    rows = [(at_02 * (0.2 / r) * ((1 - r) / 0.8)).round(3).tolist() for r in ratios]
    return {"format": FORMAT, "source": "synthetic default (ess.analysis.sim.profile.synthetic_profile)", "num_layers": num_layers,
            "ratios": ratios, "mean_misses": rows}


def _numbers(value, field: str, where: str, ndim: int) -> np.ndarray:
    """A JSON field of numbers, `ndim` nested lists deep (not strings, not ragged)."""
    shape = "a list of numbers" if ndim == 1 else "a list of lists of numbers (one row per ratio)"
    try:
        a = np.asarray(value, dtype=float)
    except (TypeError, ValueError) as e:
        raise ProfileError(f"{where}: {field!r} must be {shape} ({e})") from e
    if a.ndim != ndim or any(isinstance(x, str) for x in np.asarray(value, dtype=object).flat):
        raise ProfileError(f"{where}: {field!r} must be {shape}")
    return a


def validate_profile(p: dict, where: str = "profile") -> dict:
    if not isinstance(p, dict) or p.get("format") != FORMAT:
        raise ProfileError(f"{where}: not an ESS miss profile (expected format {FORMAT!r})")
    for field in ("num_layers", "ratios", "mean_misses"):
        if field not in p:
            raise ProfileError(f"{where}: no {field!r} field")
    n = p["num_layers"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ProfileError(f"{where}: 'num_layers' must be a positive integer, got {n!r}")
    ratios, rows = _numbers(p["ratios"], "ratios", where, 1).tolist(), _numbers(p["mean_misses"], "mean_misses", where, 2)
    if rows.shape != (len(ratios), n):
        raise ProfileError(f"{where}: 'mean_misses' must be [{len(ratios)} ratios][{n} layers], got {list(rows.shape)}")
    if sorted(ratios) != ratios or not all(0 < r <= 1 for r in ratios):
        raise ProfileError(f"{where}: 'ratios' must be increasing, within (0, 1]")
    if (rows < 0).any() or not np.isfinite(rows).all():
        raise ProfileError(f"{where}: 'mean_misses' must be finite and non-negative")
    if "page_access" in p:
        pa = p["page_access"]
        if not isinstance(pa, dict) or "disk_share" not in pa or "access_share" not in pa:
            raise ProfileError(f"{where}: 'page_access' must hold 'disk_share' and 'access_share' lists")
        x, y = _numbers(pa["disk_share"], "page_access.disk_share", where, 1), \
            _numbers(pa["access_share"], "page_access.access_share", where, 1)
        if x.shape != y.shape or len(x) < 2 or (np.diff(x) <= 0).any() or (np.diff(y) < 0).any() or \
                x[0] != 0 or x[-1] != 1 or not ((0 <= y) & (y <= 1)).all():
            raise ProfileError(f"{where}: 'page_access' must map page shares 0 .. 1 (increasing) to access shares "
                               "in [0, 1] (non-decreasing), one each")
    if "mean_prefetched" in p:
        pre = np.asarray(p["mean_prefetched"], dtype=float)
        if pre.shape != rows.shape or (pre < 0).any() or not np.isfinite(pre).all():
            raise ProfileError(f"{where}: 'mean_prefetched' must be finite, non-negative, shaped like 'mean_misses'")
    return p


def load_profile(path) -> dict:
    try:
        with open(path) as f:
            p = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not UTF-8 (a trace given as --profile, say), or not JSON
        raise ProfileError(f"{path}: not a readable miss profile ({type(e).__name__}: {e})") from e
    return validate_profile(p, str(path))


def misses_at(profile: dict, ratio: float, field: str = "mean_misses") -> list[float]:
    """Per-layer mean misses (or another per-ratio field) per request-step at `ratio`: linear between profiled
    ratios, 0 at ratio 1, and proportional to 1 / ratio below the smallest profiled ratio."""
    ratios = list(profile["ratios"])
    rows = np.asarray(profile[field], dtype=float)
    if ratio <= ratios[0]:
        return (rows[0] * ratios[0] / ratio).tolist()
    xs = ratios + ([1.0] if ratios[-1] < 1.0 else [])
    ys = np.vstack([rows, np.zeros((1, rows.shape[1]))]) if ratios[-1] < 1.0 else rows
    return [float(np.interp(ratio, xs, ys[:, i])) for i in range(rows.shape[1])]


def moved_rows_at(profile: dict, ratio: float) -> list[float]:
    """Per-layer rows moved per request-step at `ratio`: the misses, plus the prefetched rows where the profile has
    them."""
    misses = misses_at(profile, ratio)
    if "mean_prefetched" not in profile:
        return misses
    return [m + p for m, p in zip(misses, misses_at(profile, ratio, "mean_prefetched"))]
