"""How many tokens and requests an ESS decode node holds: the device keeps index-K for every token, C latent slots
per request and the LRU tables; the pinned host pool keeps the latent row of every token."""

from __future__ import annotations

import dataclasses

from ess import layout
from ess.config import GIB
from ess.memory import cache_bytes


@dataclasses.dataclass(frozen=True)
class EssPoolSizes:
    tokens: int  # token pool size (locations): the host pool's rows, and index-K rows on the device
    max_requests: int
    device_bytes: int  # index-K of every token + the sparse pool + its tables
    host_bytes: int
    limited_by: str  # "device", "host" or "requests" (max_requests x context_len fit both)


def ess_pool_sizes(num_layers: int, device_budget_bytes: int, host_budget_gib: float | None, max_requests: int,
                   context_len: int, capacity: int) -> EssPoolSizes:
    """Sizes for `max_requests` requests of up to `context_len` tokens with `capacity` GPU slots each. Tokens are what
    the device budget leaves after the per-request sparse pools, capped by the host pool (default: no cap beyond
    max_requests x context_len). Raises ValueError naming the flag when nothing fits."""
    L = num_layers
    # slots + slot tables + the position -> slot table (sized by context, per request); then index-K per token
    per_request = cache_bytes(L, context_len, layout.LATENT_ROW_BYTES, 0, capacity)
    per_token = L * layout.INDEX_ROW_BYTES
    device_tokens = (device_budget_bytes - max_requests * per_request) // per_token
    if device_tokens < 1:
        raise ValueError(f"--ess-buffer-tokens/--ess-sparse-ratio: {max_requests} requests x {capacity} slots do not fit the device budget")
    want = max_requests * context_len
    host_tokens = want if host_budget_gib is None else int(host_budget_gib * GIB) // (L * layout.LATENT_ROW_BYTES)
    if host_tokens < context_len:
        raise ValueError(f"--ess-host-pool-gib {host_budget_gib}: room for {host_tokens} tokens, below one request of {context_len}")
    tokens = min(device_tokens, host_tokens, want)
    limited_by = "requests" if tokens == want else "device" if tokens == device_tokens else "host"
    return EssPoolSizes(
        tokens=int(tokens),
        max_requests=max_requests,
        device_bytes=int(max_requests * per_request + tokens * per_token),
        host_bytes=int(tokens * L * layout.LATENT_ROW_BYTES),
        limited_by=limited_by,
    )
