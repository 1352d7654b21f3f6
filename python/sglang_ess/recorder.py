"""--ess-record-trace DIR: the top-k sets a server really selects, written as trace files (ess-design.md section 6)
that `ess profile` reads, one file per finished request.

Recording copies every layer's top-k to the host each step (a host sync): it is for profiling runs, not for
serving at full speed, and the README says so.
"""

from __future__ import annotations

import os

import numpy as np

from ess.trace import Trace, save_trace


class TraceRecorder:
    def __init__(self, directory: str, num_layers: int, model: str):
        os.makedirs(directory, exist_ok=True)
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
        topk = np.stack([np.stack(s) for s in steps])[None]  # [1, steps, layers, K]
        trace = Trace(topk=topk, context_len=np.array([context], dtype=np.int64),
                      meta={"source": "sglang --ess-record-trace", "model": self.model, "rid": rid})
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in rid)[:64]
        path = os.path.join(self.directory, f"{self._written:06d}-{safe}.npz")
        save_trace(path, trace)
        self._written += 1
        return path
