"""--ess-record-trace DIR: the top-k sets a server really selects, written as trace files (docs/design.md, Formats)
that `ess profile` reads, one file per finished request.

The decode step only appends its top-k rows to a fixed device buffer (StepRing: a device write pointer, no host
sync, so CUDA graphs capture it); after each forward, outside any graph, the plugin drains the buffer to the host
(one sync per forward) and the recorder groups the rows into traces. Still a profiling mode: the drain costs a sync
and a copy per forward.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ess.core.trace import Trace, save_trace


def lookahead(logits: torch.Tensor, lengths: torch.Tensor, topk: torch.Tensor, d: int) -> torch.Tensor:
    """--ess-record-lookahead d: the d positions [rows, d] an indexer call ranks after its top-k (-1 past the valid
    ones; logits [rows, positions], positions >= lengths [rows] invalid; topk [rows, K] the positions it selected),
    device ops only."""
    col = torch.arange(logits.shape[1], device=logits.device)
    scores = torch.where(col < lengths.reshape(-1, 1), logits.float(), -torch.inf)
    scores = scores.scatter(1, topk.long().clamp(min=0), -torch.inf)  # the top-k itself is not ranked again
    # (a -1 entry clamps to column 0, which a short row then loses from the ranks: the top-k held every position)
    vals, idx = torch.topk(scores, min(d, scores.shape[1]), dim=1)
    ext = torch.where(vals > -torch.inf, idx, -1)
    if ext.shape[1] < d:
        ext = torch.nn.functional.pad(ext, (0, d - ext.shape[1]), value=-1)
    return ext


class StepRing:
    """The rows (layer, request slot, own position, top-k [K]) that one forward's decode steps select, in the order the
    steps ran, in fixed device buffers of `rows` rows (the tables' last row is a sink once they are full)."""

    def __init__(self, rows: int, topk: int, device, lookahead: int = 0):
        """lookahead d > 0: each row also keeps the d positions ranked after its top-k (topk_ext's tail)."""
        self.rows = rows
        self.layer = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.req = torch.zeros(rows + 1, dtype=torch.int64, device=device)
        self.own = torch.zeros(rows + 1, dtype=torch.int64, device=device)
        self.topk = torch.full((rows + 1, topk), -1, dtype=torch.int32, device=device)
        self.ext = torch.full((rows + 1, lookahead), -1, dtype=torch.int32, device=device) if lookahead else None
        self.head = torch.zeros((), dtype=torch.int64, device=device)

    def append(self, layer: int, req: torch.Tensor, topk: torch.Tensor, own: torch.Tensor,
               ext: torch.Tensor | None = None) -> None:
        """Device ops only: the step's rows go to the next free rows (ext [B, d]: their next-ranked positions)."""
        idx = self.head + torch.arange(req.shape[0], device=req.device)
        idx = torch.where(idx < self.rows, idx, self.rows)
        self.layer.index_fill_(0, idx, layer)
        self.req.index_copy_(0, idx, req.long())
        self.own.index_copy_(0, idx, own.long())
        self.topk.index_copy_(0, idx, topk.to(torch.int32))
        if self.ext is not None:
            self.ext.index_copy_(0, idx, ext.to(torch.int32) if ext is not None
                                 else torch.full((req.shape[0], self.ext.shape[1]), -1, dtype=torch.int32, device=req.device))
        self.head.add_(req.shape[0]).clamp_(max=self.rows)

    def reset(self) -> None:
        self.head.zero_()

    def drain(self) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """The rows appended since the last reset, as one (layer, request slots, top-k, own positions) per run of
        consecutive rows of one layer (a step), top-k followed by the next-ranked positions where the ring keeps them;
        then empty. Host sync: call it outside the graphs, after a forward."""
        n = int(self.head)
        self.head.zero_()
        topk = self.topk if self.ext is None else torch.cat([self.topk, self.ext], dim=1)
        layer, req, topk, own = (t[:n].cpu().numpy() for t in (self.layer, self.req, topk, self.own))
        cuts = np.flatnonzero(np.diff(layer)) + 1
        return [(int(layer[a]), req[a:b], topk[a:b], own[a:b]) for a, b in zip([0, *cuts], [*cuts, n]) if b > a]


class TraceRecorder:
    def __init__(self, directory: str, num_layers: int, model: str, topk: int | None = None):
        """topk K: rows wider than K hold the next-ranked positions after the top-k (written as topk_ext)."""
        os.makedirs(directory, exist_ok=True)
        self.topk = topk
        self.directory = directory
        self.num_layers = num_layers
        self.model = model
        self._steps: dict[int, list[list[np.ndarray | None]]] = {}  # request slot -> steps -> layers -> [K]
        self._context: dict[int, int] = {}
        self._written = 0

    def start(self, req_slot: int, context_len: int) -> None:
        """A request enters decode; context_len = its prompt length (the first decode step's position)."""
        self._steps[req_slot] = []
        self._context[req_slot] = context_len

    def record(self, layer: int, req_slots: np.ndarray, topk: np.ndarray, own_pos: np.ndarray) -> None:
        """One layer of one decode step: topk [B, K] positions (-1 padded) of the batch's request slots, whose own
        positions are own_pos [B]. A request seen for the first time starts at this step (context = own position)."""
        for slot, row, own in zip(req_slots.tolist(), topk, own_pos.tolist()):
            if slot not in self._steps:
                self.start(slot, own)
            steps = self._steps[slot]
            if not steps or steps[-1][layer] is not None:
                steps.append([None] * self.num_layers)
            steps[-1][layer] = row.astype(np.int32)

    def finish(self, req_slot: int, rid: str) -> str | None:
        """Write the request's trace (complete steps only) and forget it. Returns the file written, if any."""
        steps = self._steps.pop(req_slot, None)
        context = self._context.pop(req_slot, None)
        steps = [s for s in (steps or []) if all(x is not None for x in s)]
        if not steps:
            return None
        rows = np.stack([np.stack(s) for s in steps])[None]  # [1, steps, layers, K (+ d)]
        K = self.topk or rows.shape[3]
        trace = Trace(topk=np.ascontiguousarray(rows[..., :K]), context_len=np.array([context], dtype=np.int64),
                      meta={"source": "sglang --ess-record-trace", "model": self.model, "rid": rid},
                      topk_ext=rows if rows.shape[3] > K else None)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in rid)[:64]
        while True:  # never over a file already there (a server restarted on the same directory)
            path = os.path.join(self.directory, f"{self._written:06d}-{safe}.npz")
            self._written += 1
            if not os.path.exists(path):
                break
        save_trace(path, trace)
        return path
