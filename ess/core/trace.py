"""Trace files (docs/design.md, Formats): top-k positions per request, decode step and layer, as .npz.

    topk          int32 [R, steps, layers, K]   decode top-k, -1 padded
    prefill_topk  int32 [R, W, layers, K]       the last W prefill query positions, oldest first (optional)
    topk_ext      int32 [R, steps, layers, K+d] the indexer's best K + d positions, best first: the top-k (the same
                                                set as topk) and then the d ranked just after it (optional)
    context_len   int64 [R]                     prompt lengths; decode step t processes position context_len + t
    meta          JSON string                   source, model, notes
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
import zlib

import numpy as np

TRACE_POSITIONS = 2**31 - 1  # positions are int32: a request's context_len + steps stays within it


class TraceError(ValueError):
    """A trace file that is missing a field, has the wrong shapes or dtypes, or holds impossible positions."""


@dataclasses.dataclass
class Trace:
    topk: np.ndarray
    context_len: np.ndarray
    prefill_topk: np.ndarray | None = None
    meta: dict = dataclasses.field(default_factory=dict)
    topk_ext: np.ndarray | None = None

    @property
    def lookahead(self) -> int:
        """d, the ranks past the top-k that topk_ext holds (0 without it)."""
        return 0 if self.topk_ext is None else self.topk_ext.shape[3] - self.topk.shape[3]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.topk.shape

    def validate(self, where: str = "trace") -> "Trace":
        t = self.topk
        if t.ndim != 4:
            raise TraceError(f"{where}: 'topk' must be [requests, steps, layers, K], got shape {t.shape}")
        if t.dtype != np.int32:
            raise TraceError(f"{where}: 'topk' must be int32, got {t.dtype}")
        R, steps, layers, K = t.shape
        empty = [name for name, n in (("requests", R), ("steps", steps), ("layers", layers), ("top-k entries", K)) if n == 0]
        if empty:
            raise TraceError(f"{where}: 'topk' holds no {' and no '.join(empty)} (shape {t.shape})")
        c = self.context_len
        if c.shape != (R,) or c.dtype != np.int64:
            raise TraceError(f"{where}: 'context_len' must be int64 [{R}], got {c.dtype} {c.shape}")
        if (c < 1).any():
            raise TraceError(f"{where}: 'context_len' must be >= 1")
        if (t < -1).any():
            raise TraceError(f"{where}: 'topk' holds entries below -1")
        if (t == -1).all():
            raise TraceError(f"{where}: 'topk' selects no position (every entry is the -1 padding)")
        limit = c[:, None, None, None] + np.arange(steps)[None, :, None, None]  # causal: position <= own position
        if (t > limit).any():
            raise TraceError(f"{where}: 'topk' selects a future position (beyond context_len + step)")
        p = self.prefill_topk
        if p is not None:
            if p.ndim != 4 or p.shape[0] != R or p.shape[2:] != (layers, K) or p.dtype != np.int32:
                raise TraceError(
                    f"{where}: 'prefill_topk' must be int32 [{R}, W, {layers}, {K}], got {p.dtype} {p.shape}"
                )
            if (p < -1).any() or (p >= c[:, None, None, None]).any():
                raise TraceError(f"{where}: 'prefill_topk' holds positions outside the prompt")
        e = self.topk_ext
        if e is not None:
            if e.ndim != 4 or e.shape[:3] != (R, steps, layers) or e.shape[3] <= K or e.dtype != np.int32:
                raise TraceError(f"{where}: 'topk_ext' must be int32 [{R}, {steps}, {layers}, more than {K}], "
                                 f"got {e.dtype} {e.shape}")
            if (e < -1).any() or (e > limit).any():
                raise TraceError(f"{where}: 'topk_ext' holds entries below -1 or future positions")
            if not np.array_equal(np.sort(e[..., :K], axis=-1), np.sort(t, axis=-1)):
                raise TraceError(f"{where}: the first K entries of 'topk_ext' are not the top-k set of 'topk'")
        return self


def save_trace(path, trace: Trace) -> None:
    """Writes exactly `path` (numpy would append .npz to a name without it)."""
    trace.validate(str(path))
    arrays = {"topk": trace.topk, "context_len": trace.context_len, "meta": np.array(json.dumps(trace.meta))}
    for key in ("prefill_topk", "topk_ext"):
        if getattr(trace, key) is not None:
            arrays[key] = getattr(trace, key)
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def load_trace(path) -> Trace:
    try:
        z = np.load(path, allow_pickle=False)
    except ValueError as e:  # numpy takes what is neither .npz nor .npy for a pickle, and says so
        raise TraceError(f"{path}: not a trace (an .npz archive of named fields)") from e
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        raise TraceError(f"{path}: not a readable trace file ({type(e).__name__}: {e})") from e
    if not isinstance(z, np.lib.npyio.NpzFile):  # a .npy file: one array
        raise TraceError(f"{path}: a single array, not a trace (an .npz archive of named fields)")
    try:
        with z:
            files = set(z.files)
            for key in ("topk", "context_len"):
                if key not in files:
                    raise TraceError(f"{path}: missing field '{key}' (has {sorted(files)})")
            meta = json.loads(str(z["meta"])) if "meta" in files else {}
            if not isinstance(meta, dict):
                raise TraceError(f"{path}: 'meta' must be a JSON object, got {type(meta).__name__}")
            trace = Trace(
                topk=z["topk"],
                context_len=z["context_len"],
                prefill_topk=z["prefill_topk"] if "prefill_topk" in files else None,
                meta=meta,
                topk_ext=z["topk_ext"] if "topk_ext" in files else None,
            )
    except TraceError:
        raise
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError) as e:  # ValueError: bad JSON in meta
        raise TraceError(f"{path}: not a readable trace file ({type(e).__name__}: {e})") from e
    return trace.validate(str(path))
