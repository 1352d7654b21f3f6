"""What ESS's PD code of one process shares (one PdState, the process state's `pd`: sglang_ess.hooks).

SGLang's threads hand each other these, and `lock` guards every store they share (each access takes a few dict
operations, none waits while holding it):
    prefill node  the scheduler records the warm-up state (`sender`); each transfer worker holds back a room's phase-1
                  conclusion (`held`) and takes the pages decode steps wait for (`needs`), which the bootstrap thread
                  notes (sglang_ess.pd.sending)
    decode node   the engine's listener thread files the prefill node's progress reports (`inbox`), the scheduler
                  reads them (sglang_ess.pd.engines)
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import field
from typing import Callable

import numpy as np
import torch

from sglang_ess.pd.warmup import WarmupSender


@dataclasses.dataclass
class PdState:
    # LRU-Warmup over the wire (sglang_ess.pd.warmup)
    sender: WarmupSender | None = None  # a PD prefill node's, instead of a runtime
    sender_pool: object = None  # the target model's KV pool on that node (its MTP draft worker has another)
    wire: tuple[int, int] | None = None  # (layers, top-k) of the PD warm-up rows, once this process has ESS
    warmup_rows: torch.Tensor | None = None  # the PD metadata buffers' warm-up rows [slots, ints]
    # progressive sends, prefill node (sglang_ess.pd.sending)
    held: dict[int, list] = field(default_factory=dict)  # room -> its decode endpoints, its phase-1 Success held
    needs: dict[int, dict[int, set]] = field(default_factory=dict)  # room -> {layer: pages} decode steps wait for
    warned: set = field(default_factory=set)  # decode peers told that their rooms go whole
    worker: threading.local = field(default_factory=threading.local)  # .part: what the calling worker sends
    # progress reports, decode node (sglang_ess.pd.engines)
    inbox: dict[int, list] = field(default_factory=dict)  # room -> its events not read yet
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards held, needs, warned and inbox

    # -- held conclusions ----------------------------------------------------------------------------------------------
    def hold(self, room: int, targets: list) -> None:
        with self.lock:
            self.held[room] = targets

    def unhold(self, room: int) -> list | None:
        """The decode endpoints of a room held until now, or None."""
        with self.lock:
            return self.held.pop(room, None)

    # -- pages decode steps wait for -----------------------------------------------------------------------------------
    def note_need(self, room: int, layer: int, pages: list[int], sending: Callable[[], bool]) -> None:
        """`sending()` is asked under the lock: a room that has concluded had its notes taken (take_need) after its
        status changed, and must get no new one."""
        with self.lock:
            if sending():
                self.needs.setdefault(room, {}).setdefault(layer, set()).update(pages)

    def take_need(self, room: int) -> dict | None:
        """{layer: pages int64, ascending} asked for `room` since the last call, or None."""
        with self.lock:
            got = self.needs.pop(room, None)
        return None if not got else {layer: np.fromiter(sorted(p), dtype=np.int64) for layer, p in got.items()}

    def first_warning(self, peers: set) -> set:
        """Those of `peers` not warned of before (now they are)."""
        with self.lock:
            new = set(peers) - self.warned
            self.warned |= new
        return new

    # -- progress reports ----------------------------------------------------------------------------------------------
    def file(self, room: int, events: list, reading: Callable[[], bool]) -> None:
        """`reading()` is asked under the lock: forget() runs after SGLang's clear() of the room."""
        with self.lock:
            if reading():
                self.inbox.setdefault(room, []).extend(events)

    def events(self, room: int) -> list:
        """The room's progress events since the last call."""
        with self.lock:
            return self.inbox.pop(room, [])

    def forget(self, room) -> None:
        with self.lock:
            self.inbox.pop(room, None)
