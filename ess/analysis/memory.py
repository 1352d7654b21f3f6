"""Device-memory arithmetic of the reference model's decode caches, with and without ESS."""

from __future__ import annotations

from ess.core import layout
from ess.core.memory import cache_bytes
from ess.reference.config import ModelConfig


def device_cache_bytes(cfg: ModelConfig, tokens: int, ess_capacity: int | None = None) -> int:
    return cache_bytes(cfg.num_layers, tokens, layout.LATENT_ROW_BYTES, layout.INDEX_ROW_BYTES, ess_capacity)


def max_batch(budget_bytes: int, per_request_bytes: int) -> int:
    return int(budget_bytes // per_request_bytes)
