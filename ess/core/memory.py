"""Device bytes of one request's decode caches, with and without ESS (the plugin sizes its pools with it)."""

from __future__ import annotations



def cache_bytes(layers: int, tokens: int, latent_row: int, index_row: int, ess_capacity: int | None = None) -> int:
    """Device bytes of one request's caches at `tokens` tokens.

    Without ESS: latent rows and index-K rows of every token. With ESS: index-K of every token (it stays on the GPU),
    `ess_capacity` latent slots, and the LRU tables as ess.core.sparse_pool allocates them (slot -> position and stamp,
    int32 each, per slot plus one sink; a position -> slot int32 per token plus one sink), per layer."""
    if ess_capacity is None:
        return layers * tokens * (latent_row + index_row)
    per_layer = tokens * index_row + ess_capacity * latent_row + (ess_capacity + 1) * 8 + (tokens + 1) * 4
    return layers * per_layer
