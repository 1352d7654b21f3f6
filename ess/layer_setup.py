"""One DeepSeek-V3.2 attention layer with an ESS cache, at any dimensions, ready for a decode step: the overlap
benchmark and the overlap tests build it the same way."""

from __future__ import annotations

import dataclasses

import torch

from ess import layout
from ess.cache import EssLatentCache
from ess.config import EssConfig
from ess.reference import attention as A
from ess.reference.config import ModelConfig


@dataclasses.dataclass
class Layer:
    cfg: ModelConfig
    w: A.AttentionWeights
    h: torch.Tensor  # [B, hidden] the step's normed hidden states
    q_lora: torch.Tensor
    pos: torch.Tensor  # [B] the step's positions (= context)
    index_k: torch.Tensor  # [B, context + 1, 132], the step's own key included
    cache: EssLatentCache  # one layer; every prompt row in the host pool, the GPU buffer empty
    topk: torch.Tensor  # [B, K] what the step's indexer selects

    def state(self) -> list[torch.Tensor]:
        """Everything a decode step changes: LRU tables, GPU pool rows, host pool rows."""
        return [*self.cache.sparse.layer_state(0), self.cache.serving.gpu, self.cache.host.data]


def build_layer(cfg: ModelConfig, batch: int, context: int, buffer: int, device: torch.device | str, seed: int = 0) -> Layer:
    g = torch.Generator().manual_seed(seed)
    w = A.AttentionWeights.random(cfg, g, device)
    h = torch.randn(batch, cfg.hidden, generator=g).to(device)
    pos = torch.full((batch,), context, dtype=torch.int64, device=device)
    index_k = layout.quantize_index_k(torch.randn(batch, context + 1, cfg.index_head_dim, generator=g).to(device))
    cache = EssLatentCache(EssConfig(topk=cfg.index_topk, buffer_tokens=buffer), 1, [context] * batch, context + 1, device)
    for b in range(batch):
        rows = layout.quantize_latent(torch.randn(context, 512, generator=g), torch.randn(context, 64, generator=g))
        cache.prefill(0, b, rows.to(device), None)
    q_lora = A.q_lora_of(w, h)
    return Layer(cfg, w, h, q_lora, pos, index_k, cache, A.indexer_topk(w, cfg, h, q_lora, pos, index_k))


def preload(layer: Layer, misses: int) -> list[torch.Tensor]:
    """Make all but `misses` of each request's selected positions (own token excluded) resident, through the real
    warm-up path; returns a snapshot of layer.state() to restore before each run."""
    sp, st, ps = layer.cache.sparse.layer_state(0)
    sp.fill_(-1), st.zero_(), ps.fill_(-1)
    sel = torch.where(layer.topk == layer.pos.unsqueeze(1), -1, layer.topk).long()
    sel, _ = torch.sort(sel, dim=1, descending=True)  # valid entries first
    keep = torch.arange(sel.shape[1], device=sel.device) >= misses
    resident = torch.where(keep & (sel >= 0), sel, -1).to(torch.int32)
    layer.cache.warmup_layer(0, resident.unsqueeze(1))
    return [t.clone() for t in layer.state()]


def restore(layer: Layer, snapshot: list[torch.Tensor]) -> None:
    for t, s in zip(layer.state(), snapshot):
        t.copy_(s)
