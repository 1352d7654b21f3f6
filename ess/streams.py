"""Compute and copy streams: CUDA streams and events on a GPU; on the CPU the same calls run in program order."""

from __future__ import annotations

import contextlib

import torch


class _Done:
    """An event that is always complete (CPU)."""

    def record(self, stream=None) -> None:
        pass


class Streams:
    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.copy = torch.cuda.Stream(device=device) if self.cuda else None

    def recorded(self):
        """An event recorded now on the current stream."""
        ev = torch.cuda.Event() if self.cuda else _Done()
        ev.record()
        return ev

    def on_copy(self):
        """Run the block on the copy stream (CPU: in place)."""
        return torch.cuda.stream(self.copy) if self.cuda else contextlib.nullcontext()

    def wait(self, ev) -> None:
        """The current stream waits for ev."""
        if self.cuda and ev is not None:
            torch.cuda.current_stream().wait_event(ev)

    def copy_after(self, work, *tensors: torch.Tensor):
        """Run work() on the copy stream once the current stream's work so far is done; returns an event recorded
        after it on the copy stream. tensors: made on the current stream and read by work (kept alive for it)."""
        ready = self.recorded()
        self.keep(*tensors)
        with self.on_copy():
            self.wait(ready)
            work()
            return self.recorded()

    def keep(self, *tensors: torch.Tensor) -> None:
        """Tensors made on the compute stream and used on the copy stream stay alive until the copy stream is done."""
        if self.cuda and not torch.cuda.is_current_stream_capturing():  # a graph's pool outlives its replays anyway
            for t in tensors:
                t.record_stream(self.copy)
