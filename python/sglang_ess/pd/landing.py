"""Progressive PD transfer, the decode node (--ess-progressive-pd; docs/pd.md, "Progressive PD transfer"): its
requests' landing.

A request joins decode once its phase 1 (index-K rows, warm-up state and SGLang's metadata) and phase 2 (the warm-up
set's latent pages) have landed, while phase 3 streams on; a step that needs a row not landed yet waits for it
(`wait`, called by the runtime before each layer's LRU step). What has landed is `ess.core.landed_rows.LandingTracker`'s.

A receiver takes part when its engine reports its progress (sglang_ess.pd.engines.Engine, the decode node's half:
SGLang's Mooncake and NIXL through the prefill node's reports, or an engine a test plugs in): the events since the
last call, ("phase1",), ("pages", page indices [n], layers [m] or None) and ("phase2",). A receiver no engine
reports (a prefill node without ESS, a room several prefill ranks serve) lets its request join after its whole
transfer, as without the flag.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import torch
import torch.distributed as dist

from ess.core import settings
from ess.core.landed_rows import LandingTracker
from sglang_ess.pd.engines import Engine

logger = logging.getLogger("sglang_ess")

POLL_S = 0.0005  # between two polls of the receivers while a step waits for a row (host wait)


class JoinEarly:
    """Stands for a receiver in one `DecodeTransferQueue.pop_transferred` call: its poll says Success (phases 1 and
    2 landed), and SGLang's commit, which clears the receiver of a finished transfer, leaves the real one streaming."""

    def __init__(self, receiver):
        self.receiver = receiver
        self.committed = False

    def poll(self):
        from sglang.srt.disaggregation.base.conn import KVPoll

        state = self.receiver.poll()
        return KVPoll.Success if state != KVPoll.Failed else state

    def poll_pp_consensus(self):  # what SGLang's poll_and_all_reduce asks each receiver
        return self.poll()

    def clear(self) -> None:
        self.committed = True  # the transfer goes on: ProgressiveDecode clears the receiver when it has landed

    def __getattr__(self, name):
        return getattr(self.receiver, name)


@dataclasses.dataclass
class Stream:
    req: object  # SGLang's Req, decoding
    receiver: object  # its transfer, phase 3 still landing
    engine: Engine  # the receiver's
    stalled: bool = False  # a step of this rank gave up waiting for its rows (PROGRESSIVE_WAIT_S)
    drain: tuple | None = None  # once aborted: (deadline, prefill drain acks to await) before its KV may be freed


class ProgressiveDecode:
    """A decode node's requests under --ess-progressive-pd (one per rank, the runtime's `progressive`): their landings
    into the tracker, their early joins, their streams while phase 3 lands, their held releases, their steps' waits."""

    def __init__(self, tracker: LandingTracker, engines: tuple[Engine, ...]):
        """engines: those that report their receivers' progress (on a server sglang_ess.pd.engines.sglang_engines)."""
        self.tracker = tracker
        self.engines = engines
        self.streams: dict[int, Stream] = {}  # request row -> a joined request whose transfer goes on
        self.warm_done: set[int] = set()  # request rows whose phase 2 landed
        self.early: dict[int, JoinEarly] = {}  # request row -> its stand-in, during one pop_transferred call
        self.held: dict[int, Callable] = {}  # request row -> SGLang's release of its KV, run once the transfer ends
        self.waits = 0  # steps that waited for a row (a counter for the readout and the tests)

    # -- the transfer queue --------------------------------------------------------------------------------------------
    def _engine(self, receiver) -> Engine | None:
        """The engine that reports this receiver's progress, or None: its request joins after its whole transfer."""
        return next((e for e in self.engines if e.reports(receiver)), None)

    def _land(self, row: int, receiver, engine: Engine) -> None:
        for event in engine.events(receiver):
            if event[0] == "phase1":
                self.tracker.mark_base(row)
            elif event[0] == "pages":
                self.tracker.mark_landed(row, event[1], event[2])
            elif event[0] == "phase2":
                self.warm_done.add(row)

    def before_pop(self, queue, request_slot) -> list:
        """Before SGLang polls its transfer queue: the progress of each progressive receiver into the tracker, and a
        JoinEarly in place of each whose phases 1 and 2 have landed. Returns [(decode request, JoinEarly or None,
        engine)] of the tracked requests."""
        swapped = []
        for dr in queue.queue:
            receiver, row = dr.kv_receiver, request_slot(dr.req)
            engine = None if receiver is None or row is None else self._engine(receiver)
            if engine is None:
                continue
            if not self.tracker.tracked(row) and not self.tracker.open(row, len(dr.req.origin_input_ids)):
                engine.forget(receiver)  # every tracker slot taken: this one waits for its whole transfer
                continue
            self._land(row, receiver, engine)
            proxy = None
            if row in self.warm_done and self.tracker.complete_base(row):
                dr.kv_receiver = proxy = self.early[row] = JoinEarly(receiver)
            swapped.append((dr, proxy, engine))
        return swapped

    def after_pop(self, queue, swapped: list, request_slot) -> None:
        """After SGLang's poll: a request committed early decodes on while its receiver streams (and one SGLang's
        commit refused, its KV release held until the transfer ends); one still queued gets its receiver back; one
        that left the queue otherwise (its whole transfer landed, or it failed and SGLang released it) is no longer
        tracked."""
        queued = {id(dr) for dr in queue.queue}
        for dr, proxy, engine in swapped:
            row = request_slot(dr.req)
            if proxy is not None and proxy.committed:
                self.streams[row] = Stream(dr.req, proxy.receiver, engine)
            elif id(dr) in queued:
                if proxy is not None:
                    dr.kv_receiver = proxy.receiver
            elif row is not None and row not in self.streams:
                self.tracker.close(row)
                self.warm_done.discard(row)
                engine.forget(proxy.receiver if proxy is not None else dr.kv_receiver)
        self.early.clear()

    def streaming(self) -> bool:
        """A joined request's transfer is still landing: its steps may wait (host waits; no CUDA graph replay)."""
        return bool(self.streams)

    # -- a request's KV while its transfer lands -----------------------------------------------------------------------
    def landing(self, row: int) -> bool:
        """The prefill node may still write `row`'s pages: its request joined early (or SGLang is committing it now)
        and its transfer has not ended."""
        proxy = self.early.get(row)
        return row in self.streams or (proxy is not None and proxy.committed)

    def hold(self, row: int, release: Callable) -> None:
        """SGLang releases the KV of a request whose transfer still lands (it finished, was aborted or retracted):
        `release` runs once the transfer has ended, so no write lands in pages handed to another request, and no
        other request reads a page of it (SGLang's radix cache takes a finished request's pages) before it landed."""
        self.held[row] = release

    def holding(self) -> bool:
        return bool(self.held)

    # -- while requests decode -----------------------------------------------------------------------------------------
    def land(self) -> None:
        """The joined requests' landings into the tracker (this rank's; anywhere, inside a step too)."""
        for row, s in list(self.streams.items()):
            self._land(row, s.receiver, s.engine)

    def pump(self, queue) -> None:
        """Between forwards, on every rank of SGLang's decode transfer queue (`queue`, its resolve_deferred_releases):
        landings, then what becomes of each stream, agreed over the queue's gloo group as SGLang agrees its own
        commits and releases (attention-TP ranks must keep the same requests and free the same pages):
        - landed whole on every rank: the request goes untracked and a release held for it runs;
        - failed or stalled (a step gave up waiting) on any rank: the request is aborted everywhere; a rank whose
          transfer had not ended aborts it (SGLang's receiver abort: the prefill node is told to stop), then the KV
          release waits as SGLang's deferred release does, for the prefill ranks' drain acks or the deferred-release
          timeout (`_drained`)."""
        from sglang.srt.disaggregation.utils import all_reduce_flags

        self.land()
        rows = [row for row, s in self.streams.items() if s.drain is None]
        if rows:
            states = [self._state(row) for row in rows]
            done = all_reduce_flags([int(x == "landed") for x in states], queue.gloo_group, dist.ReduceOp.MIN)
            bad = all_reduce_flags([int(x == "bad") for x in states], queue.gloo_group, dist.ReduceOp.MAX)
            for row, d, b in zip(rows, done, bad):
                if b:
                    self._abort(row, queue)
                elif d:
                    self._end(row, failed=False)
        rows = [row for row, s in self.streams.items() if s.drain is not None]
        if rows:
            ready = all_reduce_flags([int(self._drained(row)) for row in rows], queue.gloo_group, dist.ReduceOp.MIN)
            for row, r in zip(rows, ready):
                if r:
                    self._end(row, failed=True)

    def _state(self, row: int) -> str:
        """This rank's view of a stream: "landed" (Success), "bad" (Failed, or a step gave up on it), "landing"."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        s = self.streams[row]
        state = s.receiver.poll()
        if state == KVPoll.Failed or s.stalled:
            return "bad"
        return "landed" if state == KVPoll.Success else "landing"

    def _abort(self, row: int, queue) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        s = self.streams[row]
        r, why = s.receiver, ("stalled" if s.stalled else "failed")
        if row not in self.held and s.req.finished_reason is None and s.req.to_finish is None:
            logger.error("ESS progressive PD: the transfer of request %s %s after it joined decode", s.req.rid, why)
            s.req.to_finish = FINISH_ABORT(f"KV transfer {why} after the request started decoding")
        mgr = getattr(r, "kv_mgr", None)
        deferrable = bool(getattr(queue, "enable_deferred_kv_release", False)) and \
            bool(getattr(mgr, "enable_deferred_decode_kv_release", False))
        state = r.poll()
        if state not in (KVPoll.Success, KVPoll.Failed):
            r.abort()  # the prefill node stops sending (and acks once drained)
        elif state == KVPoll.Failed and deferrable:
            r.ensure_abort_notified(force_arm=True)  # a failure this node did not start: writes may be in flight
        acks = len(r.bootstrap_infos) if deferrable and state != KVPoll.Success and r.abort_notified else 0
        timeout = getattr(queue, "deferred_kv_release_timeout", 0) if deferrable else 0
        s.drain = (time.monotonic() + timeout, acks)
        self.tracker.close(row)  # no step waits for it any more
        self.warm_done.discard(row)

    def _drained(self, row: int) -> bool:
        """An aborted stream's pages may be freed (this rank): its prefill ranks acked their drain, or the deferred
        release timed out; at once where SGLang would not defer."""
        s = self.streams[row]
        deadline, acks = s.drain
        if not acks:
            return True
        return s.receiver.kv_mgr.is_abort_release_safe(s.receiver.bootstrap_room, acks) or time.monotonic() >= deadline

    def _end(self, row: int, failed: bool) -> None:
        s = self.streams.pop(row)
        r = s.receiver
        mgr = getattr(r, "kv_mgr", None)
        if failed and mgr is not None:  # as SGLang's release of a failed transfer, and its failure_exception()
            mgr.clear_deferred_abort_state(r.bootstrap_room)
            with mgr.failure_lock:
                mgr.failure_records.pop(r.bootstrap_room, None)
        r.clear()
        s.engine.forget(r)
        self.release(row)
        release = self.held.pop(row, None)
        if release is not None:
            release()

    def release(self, row: int) -> None:
        """The request's tracker slot frees (its transfer has ended, or SGLang releases it while still queued)."""
        self.tracker.close(row)
        self.warm_done.discard(row)

    def wait(self, layer: int, req: torch.Tensor, sets: torch.Tensor) -> None:
        """Before a layer's LRU step of rows `req` selecting positions `sets` [B, X]: until every selected row has
        landed. A resident row has landed (warm-up loads phase 2, a miss loads after this wait), so asking for the
        whole set asks exactly for the misses' rows. Host wait: nothing to do while no request is tracked. The pages it
        waits for are asked of their senders once, ahead of the rest of phase 3. A request whose transfer failed, or
        whose rows have not come within PROGRESSIVE_WAIT_S, is waited for no more (`_give_up`); what becomes of it is
        agreed between forwards (`pump`)."""
        if not self.tracker.open_rows():
            return
        waited, start = False, time.monotonic()
        while not bool((ready := self.tracker.ready(req, sets, layer)).all()):
            if not waited:  # the pages this step waits for, named to their senders: they go ahead of the rest
                self._ask(layer, req, sets)
            waited = True
            self.land()
            stalled = time.monotonic() - start > settings.PROGRESSIVE_WAIT_S
            self._give_up(req[~ready].tolist(), layer, stalled)
            time.sleep(POLL_S)
        self.waits += waited

    def _give_up(self, rows: list, layer: int, stalled: bool) -> None:
        """This rank waits no more for these rows' requests if their transfer failed, or (`stalled`) for all of them:
        untracked, the step goes on (its output for them, read from rows not landed, is discarded: `pump` aborts them
        on every rank before the next forward). Their streams stay until the transfer is torn down: SGLang's release
        of their KV is held until then."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        for row in rows:
            s = self.streams.get(row)
            if s is None:
                continue
            if stalled and not s.stalled:
                logger.error("ESS progressive PD: request %s waited %.0f s for a row of layer %d", s.req.rid,
                             settings.PROGRESSIVE_WAIT_S, layer)
                s.stalled = True
            if s.stalled or s.receiver.poll() == KVPoll.Failed:
                self.tracker.close(row)

    def _ask(self, layer: int, req: torch.Tensor, sets: torch.Tensor) -> None:
        for i, row in enumerate(req.tolist()):
            s = self.streams.get(row)
            if s is not None:
                pages = self.tracker.unlanded_pages(row, sets[i], layer)
                if len(pages):
                    s.engine.ask(s.receiver, layer, pages)
