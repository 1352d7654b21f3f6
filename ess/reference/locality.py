"""A tiny DeepSeek-V3.2 checkpoint whose Lightning Indexer has a real model's locality (issue 57, item 4).

With random weights the indexer's top-k sets of consecutive decode steps are unrelated. `apply(tensors, cfg, knob)`
rebuilds the tensors that decide the indexer's ranking so that they are sticky:

- the token embeddings share one direction e (about SHARED of each row; a few tokens, cubed uniform draws, down to
  SHARED * (1 - DIP): their steps' queries are noisier, the long-range re-entries a real trace has), rows EMBED_NORM
  long so that e outlasts layer 0's outputs into layer 1: every query sees it;
- the index keys: wk's rows of the RoPE dims are zeroed and k_norm's bias carries a fixed vector there, so the RoPE
  part of q.k is a function of the distance alone (a recency kernel, RECENCY strong); wk loses its response to e and
  the bias adds OFFSET along the heads' mean query so that q.k stays positive (ReLU);
- the index queries (wq_b): a shared part, per head a fixed direction (static key importance, the same every step),
  plus a noise part, wq_b's own random response to q_lora outside its shared direction;
- weights_proj reads e alone: every head's gate is positive and about the same at every step.

The ONE knob is the noise share rho in [0, 1]: q_h = sqrt(1 - rho^2) * shared_h + rho * noise_h (each calibrated to
unit length on the embeddings). rho = 1: a fresh random query every step; rho = 0: static importance and recency only.

The CPU top-k (`indexer_trace`) runs the checkpoint's own tensors teacher-forced on random token ids through the
reference DSA math (ess.reference.attention: the indexer with its LayerNorm, halves-layout RoPE, Hadamard and FP8
round trips, select_topk; sparse MLA and the dense MLP between layers), the same ranking SGLang's dsa_indexer computes.
`fit` searches rho so that the LRU miss curve (ess.analysis.synth_fit.curve, warm-up on) as a share of the top-k
matches the real trace mapped to DeepSeek-V3.2 (benchmark/results/policies/real_profile_dsv32.json).
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

# the checkpoint's tensors, not its writer (ess.reference.checkpoint), which imports this module
from ess.reference import checkpoint_weights

SHARED = 0.8  # share of each embedding row along the shared direction e
RECENCY = 5.0  # the RoPE recency kernel's value at distance 0, in units of the static importance's spread
EMBED_NORM = 100.0  # the embedding rows' length (the random checkpoint's are about 1)
DIP = 0.6  # how far a token's share along e may fall below SHARED (cubed uniform draws)
OFFSET = 3.0  # constant q.k offset along the heads' mean query, so that ReLU keeps (almost) every key
SEED_SALT = 0x10CA1  # the construction's generator: seed + SEED_SALT (the weights' own draws are untouched)
REAL_PROFILE = "benchmark/results/policies/real_profile_dsv32.json"
FIT_CONTEXT, FIT_STEPS, FIT_REQUESTS = 1984, 256, 2  # context / top-k = 31, as the real trace's 7936 / 256
FIT_SEEDS, HELD_OUT_SEEDS = (0, 1, 2, 3), (4, 5, 6, 7)  # checkpoint seeds whose mean curve is fitted / checked
FITTED = 0.125  # the fitted noise share (benchmark/results/locality/fit.json)
EMBED_CHUNK = 8192  # embedding rows rebuilt at a time


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def apply(w: dict[str, torch.Tensor], cfg: dict, knob: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors `w` (by name) with the locality construction at noise share `knob` (new dict; the
    tensors not named above are the same objects). Deterministic in seed."""
    if not 0.0 <= knob <= 1.0:
        raise ValueError(f"locality knob (noise share) must be in [0, 1], got {knob}")
    gen = torch.Generator().manual_seed(seed + SEED_SALT)
    hid, ih, D, R = cfg["hidden_size"], cfg["index_n_heads"], cfg["index_head_dim"], cfg["qk_rope_head_dim"]
    device = w["model.embed_tokens.weight"].device  # weights drawn on a GPU come back there; the construction's on the CPU
    out = dict(w)
    e = _unit(torch.randn(hid, generator=gen))
    emb = w["model.embed_tokens.weight"]
    scale = EMBED_NORM  # long rows: the residual stream keeps e past the layers' outputs (norm ~10-20 at hidden 256)
    s = SHARED * (1 - DIP * torch.rand(emb.shape[0], 1, generator=gen) ** 3)  # a few tokens far off e: noisy steps
    rows = torch.empty(emb.shape, dtype=torch.bfloat16)
    for i in range(0, emb.shape[0], EMBED_CHUNK):  # in chunks: a full-width vocabulary is 3.7 GB in fp32
        x = emb[i:i + EMBED_CHUNK].cpu().float()
        n = _unit(x - (x @ e)[:, None] * e)
        si = s[i:i + EMBED_CHUNK]
        rows[i:i + EMBED_CHUNK] = (scale * (si * e + (1 - si**2).sqrt() * n)).bfloat16()
    out["model.embed_tokens.weight"] = rows
    calib = out["model.embed_tokens.weight"][:4096].float()  # calibration inputs (a full-width vocabulary's first rows)
    x = torch.nn.functional.rms_norm(calib, (hid,), eps=1e-6)
    rope_dir = torch.cat([torch.ones(R // 2), torch.ones(R // 2)]) / math.sqrt(R)  # equal weight on every frequency
    for i in range(cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]):
        a = f"model.layers.{i}.self_attn."
        q_a = w[f"{a}q_a_proj.weight"].cpu().float()
        c = _unit(q_a @ e)  # q_lora's shared direction
        q_lora = torch.nn.functional.rms_norm(x @ q_a.T, (q_a.shape[0],), w[f"{a}q_a_layernorm.weight"].cpu().float(), 1e-6)
        # shared part: per head a random unit direction over the non-RoPE dims, the RoPE dims along rope_dir
        v = torch.randn(ih, D - R, generator=gen)
        v = _unit(v - v.mean(0, keepdim=True) * 0.5)  # heads related but distinct
        shared = torch.cat([rope_dir.expand(ih, R), v], dim=1) / (q_lora @ c).mean()  # [ih, D], unit at the mean
        wq = w[f"{a}indexer.wq_b.weight"].cpu().float().view(ih, D, -1)
        noise = wq - (wq @ c)[..., None] * c  # wq_b's response outside c
        noise[:, :R] = 0  # the RoPE dims: recency only
        noise = noise / torch.einsum("hdq,nq->nhd", noise, q_lora).norm(dim=-1).mean(0)[:, None, None]
        wq_b = math.sqrt(1 - knob**2) * shared[..., None] * c + knob * noise
        out[f"{a}indexer.wq_b.weight"] = wq_b.reshape(ih * D, -1).bfloat16()
        wk = w[f"{a}indexer.wk.weight"].cpu().float().clone()
        wk = wk - (wk @ e)[:, None] * e  # keys independent of the shared direction
        wk[:R] = 0
        out[f"{a}indexer.wk.weight"] = wk.bfloat16()
        vm = _unit(v.mean(0))
        bias = torch.cat([RECENCY * rope_dir, OFFSET * vm])  # the RoPE part of q.k at distance 0: RECENCY
        out[f"{a}indexer.k_norm.bias"] = bias.bfloat16()
        out[f"{a}indexer.k_norm.weight"] = torch.ones(D).bfloat16()
        out[f"{a}indexer.weights_proj.weight"] = (e.expand(ih, hid) / hid**0.5).contiguous().bfloat16()
    return {k: v if v is w.get(k) else v.to(device) for k, v in out.items()}


# -- the CPU top-k --------------------------------------------------------------------------------------------------

def _attention_weights(w: dict, cfg: dict, i: int):
    from ess.reference.attention import AttentionWeights

    a, f = f"model.layers.{i}.self_attn.", lambda name: w[name].float()
    H, nope, vd, kvl = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    kv_b = f(f"{a}kv_b_proj.weight").view(H, nope + vd, kvl)
    return AttentionWeights(
        q_a=f(f"{a}q_a_proj.weight"), q_a_norm=f(f"{a}q_a_layernorm.weight"), q_b=f(f"{a}q_b_proj.weight"),
        kv_a=f(f"{a}kv_a_proj_with_mqa.weight"), kv_a_norm=f(f"{a}kv_a_layernorm.weight"),
        w_kc=kv_b[:, :nope].contiguous(), w_vc=kv_b[:, nope:].transpose(1, 2).contiguous(), o_proj=f(f"{a}o_proj.weight"),
        idx_wq_b=f(f"{a}indexer.wq_b.weight"), idx_wk=f(f"{a}indexer.wk.weight"),
        idx_k_norm=f(f"{a}indexer.k_norm.weight"), idx_k_norm_bias=f(f"{a}indexer.k_norm.bias"),
        idx_weights_proj=f(f"{a}indexer.weights_proj.weight"))


def indexer_trace(w: dict, cfg: dict, context: int = FIT_CONTEXT, steps: int = FIT_STEPS, requests: int = FIT_REQUESTS,
                  seed: int = 0, windows: int = 32):
    """An ESS trace of the checkpoint's decode top-k: per request, `context` random token ids then `steps` more,
    teacher-forced (one causal pass; decode step t is position context + t), every decoder layer's indexer, and the
    last `windows` prompt positions' top-k (LRU-Warmup)."""
    from ess.core.trace import Trace
    from ess.reference import attention as A
    from ess.reference.config import from_hf

    mc = from_hf(cfg)
    L, K, T = cfg["num_hidden_layers"], cfg["index_topk"], context + steps
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, cfg["vocab_size"], (requests, T), generator=gen)
    layers = [_attention_weights(w, cfg, i) for i in range(L)]
    topk = np.zeros((requests, steps, L, K), np.int32)
    pre = np.zeros((requests, windows, L, K), np.int32)
    pos = torch.arange(T)
    with torch.no_grad():
        for r in range(requests):
            x = w["model.embed_tokens.weight"].float()[tokens[r]]
            for i, aw in enumerate(layers):
                p = f"model.layers.{i}."
                h = A.rms_norm(x, w[f"{p}input_layernorm.weight"].float())
                q_lora = A.q_lora_of(aw, h)
                q, gate = A.index_query(aw, mc, h, q_lora, pos)
                sel = A.prefill_topk(q, gate, A.index_key_rows(aw, mc, h, pos), K)  # [T, K]
                topk[r, :, i] = sel[context:].numpy()
                pre[r, :, i] = sel[context - windows:context].numpy()
                if i == L - 1:
                    break  # the last layer's output feeds no indexer
                if i >= cfg["first_k_dense_replace"]:
                    raise NotImplementedError("a MoE layer before the last: only dense layers are run between indexers")
                q_nope, q_pe = A.pre_attn(aw, mc, q_lora, pos)
                o = A.prefill_attention(q_nope, q_pe, A.kv_latent_rows(aw, mc, h, pos), sel, mc.softmax_scale)
                x = x + A.attn_output(aw, o)
                m = A.rms_norm(x, w[f"{p}post_attention_layernorm.weight"].float())
                g, u, d = (w[f"{p}mlp.{n}_proj.weight"].float() for n in ("gate", "up", "down"))
                x = x + (torch.nn.functional.silu(m @ g.T) * (m @ u.T)) @ d.T
    meta = {"source": "ess.reference.locality.indexer_trace (teacher-forced random tokens)", "model": "tiny dsv32"}
    return Trace(topk=topk, context_len=np.full(requests, context, np.int64), prefill_topk=pre, meta=meta).validate()


# -- the curve and the fit ------------------------------------------------------------------------------------------

def share_curve(trace, ratios: list[float]) -> np.ndarray:
    """LRU misses per request-layer-step as a share of the top-k, at each ratio (warm-up on)."""
    from ess.analysis.synth_fit import curve

    return curve(trace, ratios) / trace.topk.shape[3]


def real_share_curve(path: str = REAL_PROFILE) -> tuple[list[float], np.ndarray]:
    """The real trace's curve mapped to DeepSeek-V3.2 (`ess profile --for-model dsv32`): layer-mean misses / top-k."""
    with open(path) as f:
        prof = json.load(f)
    return prof["ratios"], np.asarray(prof["mean_misses"]).mean(1) / prof["topk"]


def model_curve(knob: float | None, seed: int = 0, ratios: list[float] | None = None, **trace_kw) -> np.ndarray:
    """The CPU checkpoint's (seed `seed`, no MTP) share curve at `knob` (None: the random checkpoint); prompts seed + 1."""
    ratios = ratios or real_share_curve()[0]
    cfg = checkpoint_weights.config(mtp=False)
    w = checkpoint_weights.weights(cfg, seed)
    w = w if knob is None else apply(w, cfg, knob, seed)
    return share_curve(indexer_trace(w, cfg, seed=seed + 1, **trace_kw), ratios)


def mean_curve(knob: float | None, seeds=FIT_SEEDS, ratios: list[float] | None = None) -> np.ndarray:
    """model_curve's mean over checkpoint seeds (one seed's 2 layers x 2 requests vary by ~10% at a ratio)."""
    return np.mean([model_curve(knob, s, ratios) for s in seeds], axis=0)


def fit(lo: float = 0.0, hi: float = 1.0, iters: int = 8, log=print) -> dict:
    """Bisection on rho over the mean log-ratio of the model's curve (FIT_SEEDS' mean) to the real one (more noise,
    more misses), then the best of the points tried by the worst ratio's relative error."""
    ratios, target = real_share_curve()
    tried = {}

    def evaluate(k: float) -> np.ndarray:
        t = time.time()
        tried[k] = mean_curve(k, FIT_SEEDS, ratios)
        log(f"knob {k:.4f}: {np.round(tried[k] * 100, 2)}% of top-k, worst error "
            f"{np.abs(tried[k] / target - 1).max():.1%} ({time.time() - t:.0f} s)")
        return tried[k]

    for _ in range(iters):
        mid = (lo + hi) / 2
        if np.log(evaluate(mid) / target).mean() > 0:
            hi = mid
        else:
            lo = mid
    best = min(tried, key=lambda k: np.abs(tried[k] / target - 1).max())
    err = tried[best] / target - 1
    held = mean_curve(best, HELD_OUT_SEEDS, ratios)  # other weights' draws and other prompts, the same knob
    seed0 = model_curve(best, 0, ratios)  # `ess tiny-checkpoint --locality`'s default seed alone
    random = mean_curve(None, FIT_SEEDS, ratios)
    log(f"held-out seeds: {np.round(held * 100, 2)}%; seed 0: {np.round(seed0 * 100, 2)}%; "
        f"random checkpoint: {np.round(random * 100, 2)}%")
    return {"fit_seeds": list(FIT_SEEDS), "held_out_seeds": list(HELD_OUT_SEEDS), "held_out_share": held.round(5).tolist(),
            "seed0_share": seed0.round(5).tolist(), "seed0_rel_error": (seed0 / target - 1).round(4).tolist(),
            "held_out_rel_error": (held / target - 1).round(4).tolist(), "random_checkpoint_share": random.round(5).tolist(),
            "knob": round(best, 6), "ratios": ratios, "real_share": target.round(5).tolist(),
            "model_share": tried[best].round(5).tolist(), "rel_error": err.round(4).tolist(),
            "worst_abs_error": round(float(np.abs(err).max()), 4), "within_15pct": bool(np.abs(err).max() <= 0.15),
            "tried": {f"{k:.6f}": v.round(5).tolist() for k, v in sorted(tried.items())}}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "fit":
        print("usage: python -m ess.reference.locality fit OUT_DIR", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    t0 = time.time()
    res = fit()
    res.update({"fit_seconds": round(time.time() - t0, 1), "command": "python -m ess.reference.locality fit " + argv[1],
                "machine": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, 1 thread)",
                "date": subprocess.run(["date"], capture_output=True, text=True).stdout.strip(),
                "real_curve": f"{REAL_PROFILE}: layer-mean LRU misses / top-k 2048 (ess profile --for-model dsv32)",
                "model": "ess tiny-checkpoint (2 layers, hidden 256, 4 indexer heads, top-k 64), no MTP; curves are "
                         "the mean over the checkpoint seeds listed (each with its own random prompts, seed + 1)",
                "share": "LRU misses per request-layer-step / top-k, warm-up on (ess.analysis.synth_fit.curve)",
                "trace": f"{FIT_REQUESTS} requests x {FIT_CONTEXT} random prompt tokens + {FIT_STEPS} teacher-forced "
                         "random tokens, 32 warm-up windows",
                "constants": {"SHARED": SHARED, "DIP": DIP, "EMBED_NORM": EMBED_NORM, "RECENCY": RECENCY,
                              "OFFSET": OFFSET}})
    os.makedirs(argv[1], exist_ok=True)
    with open(os.path.join(argv[1], "fit.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("knob", "real_share", "model_share", "rel_error", "fit_seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
