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
        self._held: dict[int, tuple] = {}  # under graph capture: id(event) -> (event, tensors the copy work reads)

    def recorded(self):
        """An event recorded now on the current stream."""
        ev = torch.cuda.Event() if self.cuda else _Done()
        ev.record()
        return ev

    def host_wait(self, ev) -> None:
        """The host waits for ev (a host read of memory the device wrote before ev)."""
        if self.cuda and ev is not None:
            ev.synchronize()

    def on_copy(self):
        """Run the block on the copy stream (CPU: in place)."""
        return torch.cuda.stream(self.copy) if self.cuda else contextlib.nullcontext()

    def wait(self, ev) -> None:
        """The current stream waits for ev. The copy stream runs in order, so the tensors held for copy work up to ev
        (in the order copy_after recorded them) may then be reused."""
        if self.cuda and ev is not None:
            torch.cuda.current_stream().wait_event(ev)
            if id(ev) in self._held:
                for key in list(self._held):
                    del self._held[key]
                    if key == id(ev):
                        break

    def copy_after(self, work, *tensors: torch.Tensor):
        """Run work() on the copy stream once the current stream's work so far is done; returns an event recorded
        after it on the copy stream, for `wait`. tensors: made on the current stream and read by work."""
        ready = self.recorded()
        with self.on_copy():
            self.wait(ready)
            work()
            done = self.recorded()
        self._keep(done, tensors)
        return done

    def _keep(self, done, tensors: tuple) -> None:
        """Tensors made on the compute stream and read on the copy stream must not be reused before the compute stream
        waits for `done`. Eager: record_stream. Under CUDA graph capture (no record_stream there) the allocator would
        hand a freed block to a later allocation of the same graph on the compute stream while the copy may still
        read it (seen on an H100 as an illegal address in a copy kernel), so the references are held until wait(done)."""
        if not self.cuda:
            return
        if torch.cuda.is_current_stream_capturing():
            self._held[id(done)] = (done, tensors)  # the event too: its id stays unique while held
        else:
            for t in tensors:
                t.record_stream(self.copy)
