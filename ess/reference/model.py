"""A mini DeepSeek-V3.2-style decoder (embedding, N DSA attention layers with a small MLP, LM head; seeded random
weights) that prefills a batch of prompts and greedy-decodes deterministically. A test and benchmark reference,
not a serving engine: clarity over cleverness.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Callable

import torch

from ess.core import layout
from ess.core.settings import WARMUP_WINDOWS  # prefill query positions whose top-k sets LRU-Warmup replays
from ess.reference import attention as A
from ess.reference.config import ModelConfig



@dataclasses.dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    attn: A.AttentionWeights
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


@dataclasses.dataclass
class GenerateResult:
    tokens: torch.Tensor  # [B, steps + 1] int64: the prefill's token, then one per decode step
    prefill_s: float
    decode_s: float
    decode_topk: torch.Tensor  # [B, steps, layers, K] int32: decode top-k per request, step and layer
    prefill_topk: torch.Tensor  # [B, W, layers, K] int32: the last W prefill query positions, oldest first
    context_len: torch.Tensor  # [B] int64
    decode_topk_ext: torch.Tensor | None = None  # [B, steps, layers, K + d]: with lookahead d, the best K + d, best first

    @property
    def tokens_sha256(self) -> str:
        return hashlib.sha256(self.tokens.cpu().numpy().astype("<i8").tobytes()).hexdigest()


class MiniModel:
    def __init__(self, cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.lookahead = 0  # d > 0: the baseline decode also returns the d positions ranked after each top-k
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        h = cfg.hidden

        def lin(o: int, i: int) -> torch.Tensor:
            return (torch.randn(o, i, generator=gen) * i**-0.5).to(self.device)

        self.embed = torch.randn(cfg.vocab, h, generator=gen).to(self.device)
        self.layers = [
            LayerWeights(
                attn_norm=torch.ones(h, device=self.device),
                attn=A.AttentionWeights.random(cfg, gen, self.device),
                mlp_norm=torch.ones(h, device=self.device),
                w_gate=lin(cfg.mlp_hidden, h),
                w_up=lin(cfg.mlp_hidden, h),
                w_down=lin(h, cfg.mlp_hidden),
            )
            for _ in range(cfg.num_layers)
        ]
        self.final_norm = torch.ones(h, device=self.device)
        self.lm_head = lin(cfg.vocab, h)

    def _mlp(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        h = A.rms_norm(x, lw.mlp_norm)
        return (torch.nn.functional.silu(h @ lw.w_gate.T) * (h @ lw.w_up.T)) @ lw.w_down.T

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return A.rms_norm(x, self.final_norm) @ self.lm_head.T

    def _prefill_one(self, b: int, prompt: torch.Tensor, cache, index_k: torch.Tensor, warm: torch.Tensor) -> int:
        cfg = self.cfg
        L = prompt.shape[0]
        pos = torch.arange(L, device=self.device)
        x = self.embed[prompt]
        for li, lw in enumerate(self.layers):
            w = lw.attn
            h = A.rms_norm(x, lw.attn_norm)
            q_lora = A.q_lora_of(w, h)
            k_rows = A.index_key_rows(w, cfg, h, pos)
            index_k[li, b, :L] = k_rows
            q_idx, weights = A.index_query(w, cfg, h, q_lora, pos)
            topk = A.prefill_topk(q_idx, weights, k_rows, cfg.index_topk)
            n_warm = min(L, WARMUP_WINDOWS)
            warm[b, WARMUP_WINDOWS - n_warm :, li] = topk[L - n_warm :]
            rows = A.kv_latent_rows(w, cfg, h, pos)
            cache.prefill(li, b, rows, warm[b, :, li])
            q_nope_abs, q_pe = A.pre_attn(w, cfg, q_lora, pos)
            o = A.prefill_attention(q_nope_abs, q_pe, rows, topk, cfg.softmax_scale)
            x = x + A.attn_output(w, o)
            x = x + self._mlp(lw, x)
        return int(self._logits(x[-1:]).argmax(-1))

    def decode_step(self, step: int, tokens: torch.Tensor, pos: torch.Tensor, cache, index_k: torch.Tensor, attend=None,
                    modes: list[str] | None = None):
        """One greedy decode step for the batch: tokens [B] at positions pos [B]. Returns (next tokens, top-k [B, layers, K];
        K + lookahead wide, best first, on the baseline path with a lookahead).

        With an ESS cache and `modes` (one overlap mode per layer), each layer runs ess.reference.overlap's schedule. Otherwise
        the cache's serial `decode` serves the rows and `attend(layer, q_nope_abs, q_pe, decode_rows)` computes the
        attention (default: one sparse_attention call over all selected rows).
        """
        from ess.reference.overlap import ess_layer_attention  # the reference does not depend on ESS otherwise

        cfg = self.cfg
        batch = torch.arange(tokens.shape[0], device=self.device)
        x = self.embed[tokens]
        topks = []
        if modes is not None:
            cache.set_step(step)
        for li, lw in enumerate(self.layers):
            w = lw.attn
            h = A.rms_norm(x, lw.attn_norm)
            q_lora = A.q_lora_of(w, h)
            index_k[li, batch, pos] = A.index_key_rows(w, cfg, h, pos)
            if modes is not None:
                o, topk = ess_layer_attention(modes[li], w, cfg, h, q_lora, pos, index_k[li], cache, li)
            else:
                ranked = A.indexer_topk(w, cfg, h, q_lora, pos, index_k[li], lookahead=self.lookahead)
                topk = ranked[:, : cfg.index_topk]  # the same top-k as without lookahead: a stable sort's head
                own_rows = A.kv_latent_rows(w, cfg, h, pos)
                q_nope_abs, q_pe = A.pre_attn(w, cfg, q_lora, pos)
                dr = cache.decode(li, step, topk, pos, own_rows)
                if attend is None:
                    o, _ = A.sparse_attention(q_nope_abs, q_pe, dr.rows, dr.valid, cfg.softmax_scale)
                else:
                    o = attend(li, q_nope_abs, q_pe, dr)
            topks.append(topk if modes is not None else ranked)
            x = x + A.attn_output(w, o)
            x = x + self._mlp(lw, x)
        return self._logits(x).argmax(-1), torch.stack(topks, dim=1)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[torch.Tensor],
        steps: int,
        make_cache: Callable[[list[int], int], object],
        progress: Callable[[str, int, int], None] | None = None,
        attend=None,
        modes: list[str] | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> tuple[GenerateResult, object]:
        """Prefill every prompt, then greedy-decode `steps` steps for the whole batch.

        make_cache(context_lens, max_len) builds the latent cache (dense baseline or ESS); on_step(t), if given, runs
        before decode step t (e.g. a cache's residency changing mid-decode)."""
        cfg = self.cfg
        B = len(prompts)
        ctx = [int(p.shape[0]) for p in prompts]
        if min(ctx) < 1:
            raise ValueError("prompts must hold at least one token")
        max_len = max(ctx) + steps
        if max_len > cfg.max_positions:
            raise ValueError(f"context + decode steps = {max_len} exceeds max_positions {cfg.max_positions}")
        cache = make_cache(ctx, max_len)
        index_k = torch.zeros(cfg.num_layers, B, max_len, layout.INDEX_ROW_BYTES, dtype=torch.uint8, device=self.device)
        warm = torch.full((B, WARMUP_WINDOWS, cfg.num_layers, cfg.index_topk), -1, dtype=torch.int32, device=self.device)

        t0 = time.perf_counter()
        first = []
        for b, prompt in enumerate(prompts):
            first.append(self._prefill_one(b, prompt.to(self.device), cache, index_k, warm))
            if progress:
                progress("prefill", b + 1, B)
        cache.start_decode()
        t1 = time.perf_counter()

        tokens = torch.tensor(first, device=self.device)
        pos = torch.tensor(ctx, device=self.device)
        out = [tokens]
        topks = []
        for t in range(steps):
            if on_step:
                on_step(t)
            tokens, topk = self.decode_step(t, tokens, pos + t, cache, index_k, attend, modes)
            out.append(tokens)
            topks.append(topk)
            if progress:
                progress("decode", t + 1, steps)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        decode_topk = (
            torch.stack(topks, dim=1)
            if topks
            else torch.empty(B, 0, cfg.num_layers, cfg.index_topk, dtype=torch.int32, device=self.device)
        )
        result = GenerateResult(
            tokens=torch.stack(out, dim=1).cpu(),
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            decode_topk=decode_topk[..., : cfg.index_topk].cpu(),
            prefill_topk=warm.cpu(),
            context_len=torch.tensor(ctx, dtype=torch.int64),
            decode_topk_ext=decode_topk.cpu() if decode_topk.shape[-1] > cfg.index_topk else None,
        )
        return result, cache


def random_prompts(batch: int, context: int, vocab: int, seed: int, vary: int = 0) -> list[torch.Tensor]:
    """Seeded random prompts; request b has context - b * vary tokens (vary > 0 gives unequal lengths)."""
    gen = torch.Generator().manual_seed(seed + 1_000_003)
    return [torch.randint(0, vocab, (max(1, context - b * vary),), generator=gen) for b in range(batch)]
