"""One DeepSeek-V3.2 attention layer with an ESS cache, at any dimensions, ready for a decode step: the overlap
benchmark and the overlap tests build it the same way."""

from __future__ import annotations

import dataclasses

import torch

from ess.core import layout
from ess.analysis import timing
from ess.reference.ess_cache import EssLatentCache
from ess.core.settings import EssConfig
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

    def live_state(self) -> list[torch.Tensor]:
        """state() without the sinks (the tables' last column, the GPU pool's sink slot and page padding, the host
        pool's sink row): padded writes land there, several per step, so on a GPU their contents are whichever write
        came last, and nothing reads them."""
        slot_pos, slot_stamp, pos_slot, gpu, host = self.state()
        return [slot_pos[..., :-1], slot_stamp[..., :-1], pos_slot[..., :-1], gpu[:, : self.cache.serving.sink_slot],
                host[:, :-1]]


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


STATE_NAMES = ("slot_pos", "slot_stamp", "pos_slot", "gpu_pool", "host_pool")  # Layer.live_state(), in order


def graph_replay_check(layer: Layer, snapshot: list[torch.Tensor], mode: str, attention: str = "reference") -> dict:
    """Capture one ESS layer step (indexer, LRU step, the misses' H2D on the copy stream, own row, attention) in a
    CUDA graph, replay it with two inputs and compare with eager runs of the same inputs from the same state.
    Returns {"topk_equal", "state_equal", "max_abs_err", "differing_rows"}: differing_rows counts, per state tensor,
    the rows where a replay's state differs from eager's; max_abs_err is the attention output's largest difference."""
    from ess.reference.overlap import ess_layer_attention  # the overlap engine builds on this module's layer

    L = layer
    h_in, q_in = L.h.clone(), L.q_lora.clone()
    h2 = L.h + 0.5 * torch.randn_like(L.h)
    inputs = [(L.h.clone(), L.q_lora.clone()), (h2, A.q_lora_of(L.w, h2))]

    def step(h, q):
        return ess_layer_attention(mode, L.w, L.cfg, h, q, L.pos, L.index_k, L.cache, 0, attention)

    def start():
        restore(L, snapshot)
        L.cache.set_step(7)

    def eager(h, q):
        start()
        o, t = step(h, q)
        torch.cuda.synchronize()
        return o.clone(), t.clone(), [s.clone() for s in L.live_state()]

    refs = [eager(h, q) for h, q in inputs]
    out = {"topk_equal": True, "state_equal": True, "max_abs_err": 0.0, "differing_rows": dict.fromkeys(STATE_NAMES, 0)}
    captured = {}
    graph = timing.capture(lambda: captured.update(zip(("o", "topk"), step(h_in, q_in))), start)
    for (h, q), (o_ref, t_ref, state_ref) in zip(inputs, refs):
        start()
        h_in.copy_(h)
        q_in.copy_(q)
        graph.replay()
        torch.cuda.synchronize()
        out["topk_equal"] &= bool(torch.equal(captured["topk"], t_ref))
        for name, a, b in zip(STATE_NAMES, L.live_state(), state_ref):
            out["differing_rows"][name] += int((a != b).any(-1).sum())  # pool rows, or (layer, request) table rows
        out["max_abs_err"] = max(out["max_abs_err"], float((captured["o"] - o_ref).abs().max()))
    out["state_equal"] = not any(out["differing_rows"].values())
    return out
