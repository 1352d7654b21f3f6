"""`ess demo`: prefill a batch of long prompts on the mini model and greedy-decode, with or without ESS."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from ess.reference.ess_cache import EssLatentCache
from ess.core import settings
from ess.core.settings import GIB, TIER_PLACEMENTS, WARMUP_WINDOWS, EssConfig, KnobError, sparse_ratio_in_effect
from ess.reference.config import get_config
from ess.reference.dense_cache import DenseLatentCache
from ess.reference.model import GenerateResult, MiniModel, random_prompts


@dataclasses.dataclass
class DemoOptions:
    config: str = "mini"
    layers: int | None = None
    topk: int | None = None
    batch: int = 4
    context: int = 2048
    steps: int = 32
    seed: int = 0
    device: str = "auto"
    ess: bool = False
    buffer_tokens: int | None = None
    sparse_ratio: float | None = None
    warmup: bool = True
    device_mem_gib: float | None = None
    overlap: str = "none"  # none | da | dba | plan (plan: per layer, from layer_plan)
    layer_plan: str | None = None
    host_budget_mib: float | None = None  # with disk_dir: the host frames of a disk tier (ess.reference.tiered_host_pool)
    disk_dir: str | None = None
    disk_gib: float | None = None
    tier_placement: str = TIER_PLACEMENTS[0]  # which page full host frames give up (ess.core.disk_tier)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(name)


def check_fits(cfg, device: torch.device, batch: int, tokens: int) -> None:
    """The weights (float32) and the baseline's caches of `batch` requests of `tokens` positions fit in 0.8 of the
    device's free memory (the CPU's, or the GPU's), checked before anything is allocated."""
    weights = cfg.weight_bytes()
    caches = batch * (cfg.latent_bytes(tokens) + cfg.index_k_bytes(tokens))
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
    else:
        import os

        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if weights > 0.8 * have:
        raise ValueError(
            f"--config {cfg.name}: {cfg.num_layers} layers need {weights / GIB:.1f} GiB of float32 weights, "
            f"{have / GIB:.1f} GiB free on {device}; use fewer --layers"
        )
    if weights + caches > 0.8 * have:
        raise ValueError(f"--batch {batch} x {tokens} positions (--context + --steps): {caches / GIB:.1f} GiB of caches "
                         f"beside {weights / GIB:.1f} GiB of weights, {have / GIB:.1f} GiB free on {device}")


def _run(model: MiniModel, prompts, steps: int, make_cache, progress, label: str, modes=None) -> tuple[GenerateResult, object]:
    tagged = (lambda phase, done, total: progress(f"{label} {phase}", done, total)) if progress else None
    return model.generate(prompts, steps, make_cache, progress=tagged, modes=modes)


def layer_modes(opt: DemoOptions, num_layers: int) -> list[str]:
    """One overlap mode per layer: the same for all, or a plan file's (`ess plan`, or written by hand)."""
    from ess.core.plan import load_plan

    if opt.overlap == "plan":
        if not opt.layer_plan:
            raise ValueError("--overlap plan needs --layer-plan PLAN.json (from `ess plan`, one mode per layer)")
        return load_plan(opt.layer_plan, num_layers)
    if opt.layer_plan:
        raise ValueError("--layer-plan is read only with --overlap plan")
    if opt.overlap not in ("none", "da", "dba"):
        raise ValueError(f"--overlap must be none, da, dba or plan, got {opt.overlap!r}")
    return [opt.overlap] * num_layers


def _setup(opt: DemoOptions):
    """The configuration, device, seeded model and prompts that the demo and the trace recorder share."""
    overrides = {k: v for k, v in (("num_layers", opt.layers), ("index_topk", opt.topk)) if v is not None}
    cfg = get_config(opt.config, **overrides)
    if opt.batch < 1 or opt.context < 1 or opt.steps < 0:
        raise ValueError("--batch and --context must be positive and --steps non-negative")
    device = resolve_device(opt.device)
    check_fits(cfg, device, opt.batch, opt.context + opt.steps)
    return cfg, device, MiniModel(cfg, seed=opt.seed, device=device), random_prompts(opt.batch, opt.context, cfg.vocab, opt.seed)


ESS_ONLY = {"buffer_tokens": "--ess-buffer-tokens", "sparse_ratio": "--ess-sparse-ratio", "layer_plan": "--layer-plan",
            "host_budget_mib": "--host-budget-mib", "disk_dir": "--disk-dir", "disk_gib": "--disk-gib"}


def ess_config(opt: DemoOptions, topk: int, tokens: int) -> EssConfig:
    """The ESS settings of a demo run, checked before any work; errors name the demo's flags."""
    ratio = None if opt.buffer_tokens is not None else sparse_ratio_in_effect(opt.sparse_ratio)
    names = {"buffer_tokens": "--ess-buffer-tokens", "sparse_ratio": "--ess-sparse-ratio", "warmup_windows": "--no-warmup",
             "host_pool_gib": "--host-pool-gib"}
    warmup = WARMUP_WINDOWS if opt.warmup else 0
    try:
        settings.check_knobs(opt.buffer_tokens, ratio, warmup, names=names)
        settings.capacity(opt.buffer_tokens, ratio, tokens, topk, names)
    except KnobError as e:
        raise ValueError(str(e)) from e
    return EssConfig(topk=topk, buffer_tokens=opt.buffer_tokens, sparse_ratio=ratio, warmup_windows=warmup)


def check_options(opt: DemoOptions) -> None:
    """What a demo run can refuse before any work."""
    if not opt.ess:
        given = [flag for field, flag in ESS_ONLY.items() if getattr(opt, field) is not None]
        given += ["--no-warmup"] if not opt.warmup else []
        given += [f"--overlap {opt.overlap}"] if opt.overlap != "none" else []
        if given:
            raise ValueError(f"{', '.join(given)}: ESS settings, used only with --ess")
    if opt.device_mem_gib is not None and not opt.device_mem_gib > 0:
        raise ValueError(f"--device-mem-gib must be positive, got {opt.device_mem_gib}")
    if (opt.host_budget_mib is None) != (opt.disk_dir is None):
        raise ValueError("--host-budget-mib and --disk-dir go together: the host frames and the disk under them")
    if opt.tier_placement != TIER_PLACEMENTS[0] and opt.disk_dir is None:
        raise ValueError(f"--tier-placement {opt.tier_placement}: the disk tier's placement; give --disk-dir (and "
                         "--host-budget-mib) too")
    if opt.tier_placement not in TIER_PLACEMENTS:
        raise ValueError(f"--tier-placement {opt.tier_placement!r}: one of {', '.join(TIER_PLACEMENTS)}")
    if opt.disk_gib is not None and opt.disk_dir is None:
        raise ValueError("--disk-gib bounds the disk tier: give --disk-dir (and --host-budget-mib) too")
    for flag, v in (("--host-budget-mib", opt.host_budget_mib), ("--disk-gib", opt.disk_gib)):
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{flag} must be a positive, finite number, got {v}")
    if opt.host_budget_mib is not None:
        _check_disk_tier_sizes(opt)


def _check_disk_tier_sizes(opt: DemoOptions) -> None:
    """The disk tier's frames and page file, as ess.reference.tiered_host_pool sizes them, before the baseline runs."""
    import os

    from ess.core.page_file import DISK_PAGE, PAGE_BYTES
    from ess.reference.tiered_host_pool import page_file_bytes

    host = int(opt.host_budget_mib * 2**20)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if host < PAGE_BYTES:
        raise ValueError(f"--host-budget-mib {opt.host_budget_mib}: {host} bytes hold no {PAGE_BYTES}-byte page")
    if host > physical:
        raise ValueError(f"--host-budget-mib {opt.host_budget_mib}: more than this machine's {physical / 2**20:.0f} MiB")
    if opt.disk_gib is not None:
        layers = opt.layers or get_config(opt.config).num_layers
        need = page_file_bytes(layers, opt.batch, opt.context + opt.steps)
        if need > opt.disk_gib * GIB:
            raise ValueError(f"--disk-gib {opt.disk_gib}: the batch needs {need / GIB:.3g} GiB on disk ({layers} layers "
                             f"x {opt.batch} requests x {opt.context + opt.steps} positions in {DISK_PAGE}-byte pages)")


def run_demo(opt: DemoOptions, progress: Callable[[str, int, int], None] | None = None) -> dict:
    check_options(opt)
    modes = layer_modes(opt, opt.layers or get_config(opt.config).num_layers) if opt.ess else None
    tokens = opt.context + opt.steps
    topk = opt.topk or get_config(opt.config).index_topk
    ess_cfg = ess_config(opt, topk, tokens) if opt.ess else None
    cfg, device, model, prompts = _setup(opt)

    base, base_cache = _run(
        model, prompts, opt.steps, lambda ctx, max_len: DenseLatentCache(cfg.num_layers, len(ctx), max_len, device), progress, "baseline"
    )
    report = {
        "config": dataclasses.asdict(cfg),
        "device": str(device),
        "seed": opt.seed,
        "batch": opt.batch,
        "context": opt.context,
        "decode_steps": opt.steps,
        "prefill_s": round(base.prefill_s, 4),
        "decode_s": round(base.decode_s, 4),
        "tokens_per_s": round(opt.batch * opt.steps / base.decode_s, 2) if opt.steps else 0.0,
        "latent_cache_bytes": opt.batch * cfg.latent_bytes(tokens),
        "index_k_cache_bytes": opt.batch * cfg.index_k_bytes(tokens),
        "tokens_sha256": base.tokens_sha256,
    }
    budget = int(opt.device_mem_gib * GIB) if opt.device_mem_gib is not None else None
    if budget is not None:
        report["device_mem_gib"] = opt.device_mem_gib
        report["max_batch"] = {"baseline": budget // cfg.device_cache_bytes(tokens)}
    if not opt.ess:
        return report

    def ess_cache(ctx, max_len):
        tier = None
        if opt.disk_dir is not None:
            from ess.reference.tiered_host_pool import TieredHostPool

            disk = None if opt.disk_gib is None else int(opt.disk_gib * GIB)
            tier = TieredHostPool(cfg.num_layers, len(ctx), max_len, int(opt.host_budget_mib * 2**20), opt.disk_dir,
                                  disk, device, placement=opt.tier_placement)
        return EssLatentCache(ess_cfg, cfg.num_layers, ctx, max_len, device, tier=tier)

    res, cache = _run(model, prompts, opt.steps, ess_cache, progress, "ess", modes)
    misses = cache.miss_counts().double()  # [B, steps, layers]
    sets = cache.set_size_counts().double()
    per_layer = [
        {
            "layer": li,
            "mean_misses_per_request_step": round(float(misses[:, :, li].mean()), 3) if opt.steps else 0.0,
            "hit_rate": round(1.0 - float(misses[:, :, li].sum() / sets[:, :, li].sum().clamp(min=1)), 4),
        }
        for li in range(cfg.num_layers)
    ]
    C = cache.capacity
    report["ess"] = {
        "buffer_tokens": C,
        "sparse_ratio": round(C / tokens, 4),
        "warmup": opt.warmup,
        "overlap": opt.overlap,
        "layer_modes": modes,
        "decode_s": round(res.decode_s, 4),
        "tokens_per_s": round(opt.batch * opt.steps / res.decode_s, 2) if opt.steps else 0.0,
        "tokens_sha256": res.tokens_sha256,
        "total_misses": int(misses.sum()),
        "per_layer": per_layer,
        "gpu_latent_bytes": {"baseline": base_cache.device_bytes(), "ess": cache.device_bytes()},
        "host_latent_bytes": cache.host.data.numel() if cache.tier is None else cache.tier.frame_rows.numel(),
    }
    if cache.tier is not None:
        report["ess"]["tier"] = cache.tier.report()
        cache.tier.check()
        cache.tier.close()
    report["tokens_identical"] = bool(torch.equal(res.tokens, base.tokens))
    if budget is not None:
        report["max_batch"]["ess"] = budget // cfg.device_cache_bytes(tokens, C)
    return report


def record_trace(opt: DemoOptions, progress: Callable[[str, int, int], None] | None = None, lookahead: int = 0):
    """Run the reference model (baseline cache) and return its trace: decode top-k per step and layer and the last
    32 prefill top-k sets (ess.core.trace format); lookahead d > 0 adds topk_ext, the best K + d of each decode step."""
    from ess.core.trace import Trace

    cfg, device, model, prompts = _setup(opt)
    model.lookahead = lookahead
    res, _ = _run(model, prompts, opt.steps,
                  lambda ctx, max_len: DenseLatentCache(cfg.num_layers, len(ctx), max_len, device), progress, "record")
    meta = {"source": f"reference {cfg.name} model, random weights (ess trace record)", "model": dataclasses.asdict(cfg),
            "seed": opt.seed}
    ext = None if res.decode_topk_ext is None else res.decode_topk_ext.numpy()
    return Trace(res.decode_topk.numpy(), res.context_len.numpy(), res.prefill_topk.numpy(), meta, topk_ext=ext)
