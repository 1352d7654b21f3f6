"""Device-memory arithmetic of the decode caches, with and without ESS, per request."""

from __future__ import annotations

from ess import layout
from ess.reference.config import ModelConfig


def device_cache_bytes(cfg: ModelConfig, tokens: int, ess_capacity: int | None = None) -> int:
    """Device bytes of one request's caches at `tokens` tokens.

    Without ESS: latent rows and index-K rows of every token. With ESS: index-K of every token (it stays on the GPU),
    `ess_capacity` latent slots, and the LRU tables (slot -> position and stamp, int32 each, and a position -> slot
    map of int32 per token), per layer, as ess.sparse_pool allocates them.
    """
    index_k = cfg.index_k_bytes(tokens)
    if ess_capacity is None:
        return cfg.latent_bytes(tokens) + index_k
    per_layer = ess_capacity * layout.LATENT_ROW_BYTES + (ess_capacity + 1) * 8 + (tokens + 1) * 4
    return index_k + cfg.num_layers * per_layer


def max_batch(budget_bytes: int, per_request_bytes: int) -> int:
    return int(budget_bytes // per_request_bytes)
