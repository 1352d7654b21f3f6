"""ESS configuration, validated up front so that a bad setting fails with a message naming it."""

from __future__ import annotations

import dataclasses
import math

from ess import layout

GIB = 1 << 30


class EssConfigError(ValueError):
    """A bad ESS setting; the message names the field."""


@dataclasses.dataclass(frozen=True)
class EssConfig:
    """buffer_tokens: the GPU Sparse Memory Pool's slots per (request, layer); or sparse_ratio: the same as a share of
    the request's context (the Sparse Memory Ratio). Exactly one of the two. host_pool_gib: size of the pinned
    Total Memory Pool (None: sized to the live requests). warmup_windows: LRU-Warmup windows W (0 turns it off)."""

    topk: int
    buffer_tokens: int | None = None
    sparse_ratio: float | None = None
    warmup_windows: int = 32
    host_pool_gib: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.topk, int) or self.topk < 1:
            raise EssConfigError(f"topk must be a positive integer, got {self.topk!r}")
        if (self.buffer_tokens is None) == (self.sparse_ratio is None):
            raise EssConfigError("give exactly one of buffer_tokens (--ess-buffer-tokens) and sparse_ratio (--ess-sparse-ratio)")
        if self.buffer_tokens is not None:
            if not isinstance(self.buffer_tokens, int) or self.buffer_tokens < 0:
                raise EssConfigError(f"buffer_tokens must be a non-negative integer, got {self.buffer_tokens!r}")
            self._check_capacity(self.buffer_tokens, "buffer_tokens")
        if self.sparse_ratio is not None and not (0.0 < self.sparse_ratio <= 1.0):
            raise EssConfigError(f"sparse_ratio must be in (0, 1], got {self.sparse_ratio!r}")
        if not isinstance(self.warmup_windows, int) or self.warmup_windows < 0:
            raise EssConfigError(f"warmup_windows must be a non-negative integer, got {self.warmup_windows!r}")
        if self.host_pool_gib is not None and not self.host_pool_gib > 0:
            raise EssConfigError(f"host_pool_gib must be positive, got {self.host_pool_gib!r}")

    def _check_capacity(self, capacity: int, field: str) -> None:
        if capacity < self.topk + 1:
            raise EssConfigError(
                f"{field}: a GPU buffer of {capacity} tokens per request is below top-k + 1 = {self.topk + 1} "
                "(the step's top-k set and its own token must fit)"
            )

    def capacity(self, context_tokens: int) -> int:
        """Slots per (request, layer) for requests of up to context_tokens tokens."""
        if self.buffer_tokens is not None:
            return self.buffer_tokens
        cap = math.ceil(self.sparse_ratio * context_tokens)
        self._check_capacity(cap, f"sparse_ratio {self.sparse_ratio} of {context_tokens} tokens")
        return cap

    def host_pool_tokens(self, num_layers: int) -> int | None:
        if self.host_pool_gib is None:
            return None
        return int(self.host_pool_gib * GIB) // (num_layers * layout.LATENT_ROW_BYTES)

    @staticmethod
    def from_dict(d: dict) -> "EssConfig":
        names = {f.name for f in dataclasses.fields(EssConfig)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise EssConfigError(f"unknown ESS config field(s) {unknown}; known: {sorted(names)}")
        return EssConfig(**d)
