"""Device bytes of one request's decode caches, with and without ESS (the plugin sizes its pools with it), and how
many requests a device cache budget holds: the memory wall of each arm (benchmark/decode_gpu.py,
benchmark/gpu/server.py)."""

from __future__ import annotations

from ess.core import layout
from ess.core.settings import PAGE_TOKENS

HISPARSE_HOST_RATIO = 2  # HiSparse's logical space: host_to_device_ratio x its device pool (SGLang's default)


def cache_bytes(layers: int, tokens: int, latent_row: int, index_row: int, ess_capacity: int | None = None) -> int:
    """Device bytes of one request's caches at `tokens` tokens.

    Without ESS: latent rows and index-K rows of every token. With ESS: index-K of every token (it stays on the GPU),
    `ess_capacity` latent slots, and the LRU tables as ess.core.sparse_pool allocates them (slot -> position and stamp,
    int32 each, per slot plus one sink; a position -> slot int32 per token plus one sink), per layer."""
    if ess_capacity is None:
        return layers * tokens * (latent_row + index_row)
    return layers * (tokens * index_row + ess_capacity * latent_row + table_bytes(ess_capacity, tokens))


def table_bytes(capacity: int, positions: int) -> int:
    """One request's LRU tables on one layer, as ess.core.sparse_pool allocates them: slot -> position and stamp (int32
    each, per slot plus a sink), position -> slot (int32, per position plus a sink)."""
    return (capacity + 1) * 8 + (positions + 1) * 4


def requests_in(budget: float, per_request: int, cap: int | None = None) -> int:
    b = int(budget // per_request)
    return min(b, cap) if cap else b


def largest_batch(budget: float, layers: int, context: int, buffer: int | None, cap: int | None = None) -> int:
    """The most requests whose device caches (latent and index-K, or with ESS index-K and `buffer` slots) fit the
    budget."""
    return requests_in(budget, cache_bytes(layers, context, layout.LATENT_ROW_BYTES, layout.INDEX_ROW_BYTES, buffer), cap)


def hisparse_largest_batch(budget: float, layers: int, context: int, buffer: int, cap: int | None = None) -> int:
    """HiSparse's most requests in the budget: index-K of every token, and device latent rows for half the tokens
    (its logical space is host_to_device_ratio x the device pool) but at least its buffer and reserved page each."""
    device_tokens = max(-(-context // HISPARSE_HOST_RATIO), buffer + PAGE_TOKENS)
    return requests_in(budget, layers * (device_tokens * layout.LATENT_ROW_BYTES + context * layout.INDEX_ROW_BYTES), cap)


def ess_device_rows(budget: float, layers: int, batch: int, context: int, capacity: int, positions: int) -> int:
    """Residency first (ess.core.residency): the latent rows per layer a device cache budget leaves ESS beside `batch`
    requests' index-K (`context` tokens each) and LRU tables (C = `capacity` slots, `positions` positions each), for
    the requests' regions: resident requests take `positions` rows, offloaded ones C."""
    per_request = context * layout.INDEX_ROW_BYTES + table_bytes(capacity, positions)
    return max(0, int((budget - batch * layers * per_request) // (layers * layout.LATENT_ROW_BYTES)))
