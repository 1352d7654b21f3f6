"""LRU-Warmup across PD disaggregation: the prefill node sends, with each request's KV, the state its warm-up sets
leave; the decode node loads it into the request's GPU slots (docs/design.md, LRU-Warmup).

What is sent. Warm-up inserts the sets P_0 .. P_{W-1} oldest first and evicts by (stamp, position) ascending; a
position's stamp is the newest window it appears in. With C slots (C > K) the resident set afterwards is exactly the
C largest positions of the union by (newest window, position): a row is only evicted when every other resident row
ranks above it or is in the current window, and a later window ranks above every earlier one. So instead of the
W x K raw sets, the prefill node sends per layer the union, each position once with its newest window, the N largest
in that order (N = 4 x top-k), sorted. A decode node with C <= N slots then holds exactly what a co-located
warm-up would (same rows, same stamps); with more slots it holds the N most recently used.

Wire format: one row of int32 per request in SGLang's PD metadata buffers (sent by Mooncake / NIXL with the other
metadata, in an extra buffer ESS appends on both nodes):
    header [8]          MAGIC, VERSION, layers, N, windows sent, bootstrap room (int64 as two int32), 0
    entries [layers, N] position * 32 + window (window 0..31, the newest 31), descending; -1 padded
The size depends on the model only (layers, top-k), so both nodes agree on it. The bootstrap room in the header ties a
row to its request: a stale row (a prefill node without ESS leaves the decode node's buffer untouched) is ignored.
Memory: about 2 MB per metadata slot for DeepSeek-V3.2 (61 layers x 8192 x 4 B); SGLang keeps 2 slots per request
slot on a decode node and per running request on a prefill node.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

import torch

from ess.core.serving import batch_tokens
from ess.core.settings import WARMUP_WINDOWS
from ess.core.warmup_plan import WarmupPlan

logger = logging.getLogger("sglang_ess")

WINDOWS = WARMUP_WINDOWS  # windows the wire can carry (the design's W; the wire packs position * 32 + window)
WINDOW_BITS = 5
MAX_POSITION = 1 << 26  # position * 32 + window must fit an int32
MAGIC = 0x45535357  # "ESSW"
VERSION = 1
HEADER = 8
_KEY_SHIFT = 40  # sort key: window << 40 | position


def entries_per_layer(topk: int) -> int:
    return 4 * topk


def row_ints(layers: int, topk: int) -> int:
    """int32 values of one request's metadata row."""
    return HEADER + layers * entries_per_layer(topk)


# -- the entries -------------------------------------------------------------------------------------------------------
def encode(sets: torch.Tensor) -> torch.Tensor:
    """Warm-up sets [R, W, K] (positions, -1: none; W <= 32, oldest first) -> wire values [R, W * K] int64, window
    w numbered so that the newest is 31."""
    W = sets.shape[1]
    if W > WINDOWS:
        raise ValueError(f"the PD wire carries {WINDOWS} warm-up windows, got {W}")
    frame = torch.arange(WINDOWS - W, WINDOWS, device=sets.device).view(1, W, 1)
    return torch.where(sets >= 0, (sets.long() << WINDOW_BITS) | frame, -1).reshape(sets.shape[0], -1)


def compact(values: torch.Tensor, n: int) -> torch.Tensor:
    """Wire values [R, X] (int64, -1 padded, positions repeated) -> [R, n] int32: each position once with its newest
    window, the n largest by (window, position), descending, -1 padded. compact(cat(compact(a), compact(b))) equals
    compact(cat(a, b)), so parts of a request's windows can be merged as they come (TBO micro-batches)."""
    v, _ = torch.sort(values, dim=1, descending=True)  # a position's entries are adjacent, newest window first
    pos = v >> WINDOW_BITS
    first = torch.ones_like(v, dtype=torch.bool)
    first[:, 1:] = pos[:, 1:] != pos[:, :-1]
    window = v & (WINDOWS - 1)
    key = torch.where(first & (v >= 0), (window << _KEY_SHIFT) | pos, -1)
    key, _ = torch.sort(key, dim=1, descending=True)
    if key.shape[1] < n:
        key = torch.cat([key, key.new_full((key.shape[0], n - key.shape[1]), -1)], dim=1)
    key = key[:, :n]
    out = ((key & ((1 << _KEY_SHIFT) - 1)) << WINDOW_BITS) | (key >> _KEY_SHIFT)
    return torch.where(key >= 0, out, -1).to(torch.int32)


def unpack(entries: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries [layers, N] -> (positions, windows) [layers, min(N, capacity)]: the rows C slots keep."""
    e = entries[:, :capacity].long()
    return torch.where(e >= 0, e >> WINDOW_BITS, -1), torch.where(e >= 0, e & (WINDOWS - 1), 0)


def check_entries(entries: torch.Tensor, positions: int) -> str | None:
    """Why a received row's entries [layers, N] cannot be loaded for a request of `positions` tokens, or None: every
    entry -1 or a position below `positions` (its window in the low bits), each position at most once per layer."""
    e = entries.long()
    if (e < -1).any():
        return "a negative entry other than -1"
    pos = torch.where(e >= 0, e >> WINDOW_BITS, -1)
    if (pos >= positions).any():
        return f"position {int(pos.max())} beyond the request's {positions} tokens"
    s, _ = torch.sort(pos, dim=1)
    if ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any():
        return "a position twice in one layer"
    return None


# -- the metadata row --------------------------------------------------------------------------------------------------
def _room_ints(room) -> list[int]:
    """A bootstrap room (an unsigned 64-bit id) as two int32."""
    r = int(room or 0) & (2**64 - 1)
    return torch.tensor([r - 2**64 if r >= 2**63 else r], dtype=torch.int64).view(torch.int32).tolist()


def write_row(row: torch.Tensor, layers: int, n: int, entries: torch.Tensor | None, windows: int, room) -> None:
    """Fill one metadata row [row_ints] (int32, host) for the request with bootstrap room `room`: entries [layers, n],
    or None (no warm-up recorded for it: zero windows)."""
    sent = windows if entries is not None else 0
    row[:HEADER] = torch.tensor([MAGIC, VERSION, layers, n, sent, *_room_ints(room), 0], dtype=torch.int32)
    if entries is not None:
        row[HEADER:].copy_(entries.reshape(-1))


def read_row(row: torch.Tensor, room, layers: int, topk: int) -> torch.Tensor | None:
    """The entries [layers, N] of a received metadata row, or None when it holds no warm-up for this request."""
    h = row[:HEADER].tolist()
    n = entries_per_layer(topk)
    if h[0] != MAGIC:
        return None  # the prefill node did not write it (ESS off there, or no warm-up windows)
    if h[1] != VERSION or h[2] != layers or h[3] != n:
        logger.warning("ESS warm-up from the prefill node ignored: wire v%s, %s layers x %s entries, expected v%s, %s x %s",
                       h[1], h[2], h[3], VERSION, layers, n)
        return None
    if h[5:7] != _room_ints(room) or h[4] == 0:
        return None  # another request's row (stale), or nothing recorded
    return row[HEADER:].view(layers, n)


# -- the prefill node --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class PrefillForward:
    """One prefill forward's warm-up record on a PD prefill node."""

    plan: WarmupPlan  # its requests and their warm-up windows
    entries: torch.Tensor  # [layers, requests, N] the compacted state, filled as the layers run
    fused: bool  # SGLang's top-k holds token locations (mapped back to positions)
    done: object  # a CUDA event recorded after each layer's record (None on the CPU)


class WarmupSender:
    """On a PD prefill node: records, per prefill forward, each request's warm-up state (compacted per layer on the
    GPU as the layers run) and writes it into the request's metadata row when SGLang sends the request's last chunk."""

    KEEP_FORWARDS = 4  # a request's last chunk is sent one or two forwards after it ran (overlap scheduling)

    def __init__(self, layers: int, topk: int, windows: int, token_table: torch.Tensor, locations: int,
                 start_layer: int = 0):
        self.layers, self.windows = layers, windows  # windows: 1 .. WINDOWS (checked at launch; encode checks too)
        self.n = entries_per_layer(topk)
        self.start_layer = start_layer
        self.token_table = token_table
        self._pos_of_loc = torch.full((locations,), -1, dtype=torch.int64, device=token_table.device)
        self._forwards: collections.deque = collections.deque(maxlen=self.KEEP_FORWARDS)

    def plan(self, req: torch.Tensor, seq_lens: list[int], extend_lens: list[int], fused: bool) -> None:
        """Before layer 0 of a prefill forward (host lengths). fused: SGLang's top-k holds token locations, mapped
        back to positions through this forward's requests' token table rows."""
        if req.shape[0] == 0:
            return
        if fused:
            locs, pos, _ = batch_tokens(self.token_table, req, seq_lens)
            self._pos_of_loc.fill_(-1)
            self._pos_of_loc[locs] = pos
        staging = torch.full((self.layers, req.shape[0], self.n), -1, dtype=torch.int32, device=req.device)
        done = torch.cuda.Event() if req.is_cuda else None  # recorded after each layer's record
        self._forwards.append(PrefillForward(WarmupPlan(req, extend_lens, self.windows), staging, fused, done))

    def _to_positions(self, loc: torch.Tensor) -> torch.Tensor:
        return torch.where(loc >= 0, self._pos_of_loc[loc.clamp(min=0)], -1)

    def record(self, layer_id: int, top_k: torch.Tensor, token_range=None, positions: bool = False) -> None:
        """After layer layer_id's prefill attention of the newest planned forward (or one TBO micro-batch of it).
        positions: top_k holds positions already (the plugin mapped SGLang's ragged offsets), whatever the plan's."""
        layer = layer_id - self.start_layer
        if not self._forwards or not 0 <= layer < self.layers:
            return
        fwd = self._forwards[-1]
        got = fwd.plan.sets(top_k, token_range, self._to_positions if fwd.fused and not positions else None)
        if got is None:
            return
        _, sets, keep = got
        staged = fwd.entries[layer, keep].long()
        fwd.entries[layer, keep] = compact(torch.cat([staged, encode(sets)], dim=1), self.n)
        if fwd.done is not None:
            fwd.done.record()

    def write(self, row: torch.Tensor, req_slot: int, room) -> None:
        """SGLang is sending request req_slot's last chunk: its metadata row gets the newest forward's state for it.
        Host-side, after the forward (the host waits for the recorded work, which has finished by then)."""
        for fwd in reversed(self._forwards):
            hit = torch.nonzero(fwd.plan.req == req_slot).flatten()
            if hit.numel():
                if fwd.done is not None:
                    fwd.done.synchronize()
                write_row(row, self.layers, self.n, fwd.entries[:, hit[0]].cpu(), self.windows, room)
                return
        write_row(row, self.layers, self.n, None, 0, room)
