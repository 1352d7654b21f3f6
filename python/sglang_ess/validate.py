"""Checks of --enable-ess against the model and the rest of the launch, run inside SGLang's own argument resolution
(`resolution_step`, wrapped around its `handle_other_validations` step, after the DSA KV dtype and backends are
resolved). What they resolve, EssFacts, rides on the launch's EssArgs into every process (sglang_ess.args)."""

from __future__ import annotations

import logging
from typing import Any

from ess.core.disk_tier import PAGE_BYTES
from ess.core.plan import PlanError, load_plan
from ess.core import settings
from ess.core.settings import GIB
from sglang_ess.args import FLAGS, EssArgs, EssArgsError, EssFacts, attach_facts, ess_args
from sglang_ess.pd import warmup as pd_warmup

logger = logging.getLogger("sglang_ess")


# The decode backend whose indices address the latent cache as flat 656-byte FP8 rows, which is what ESS translates
# top-k positions into (FlashMLA's sparse FP8 decode).
ESS_DECODE_BACKENDS = ("flashmla_kv",)
LATENT_KV_DTYPE = "fp8_e4m3"
# The prefill backend whose (paged) page table SGLang translates through the pool's sparse-offload hook, which is how
# prefill reads ESS's staging buffer.
ESS_PREFILL_BACKENDS = ("flashmla_kv",)
# Launch features whose cache handling ESS does not cover yet (why, for the message).
UNSUPPORTED_WITH_ESS = {
    "enable_mixed_chunk": "a mixed batch is prefill and decode in one forward, and ESS stages them differently",
    "enable_hierarchical_cache": "HiCache copies the device latent buffer, which ESS keeps in host memory already",
    "disaggregation_decode_enable_offload_kvcache": "it offloads and frees requests' KV outside SGLang's release path, "
                                                    "from the device latent buffer that ESS keeps in host memory",
    "speculative_adaptive": "it changes the number of verify rows per step, which sizes ESS's GPU slots",
    # The flags SGLang 0.5.23 refuses with --enable-hisparse for reasons that hold for ESS too (docs/plugin.md, the
    # enable_hisparse audit):
    "disaggregation_decode_enable_radix_cache": "a decode-side prefix cache shares KV rows across requests, and "
                                                "ESS's GPU slots belong to one request",
}


def query_rows_per_request(cfg: Any) -> int:
    """Query rows a decode step gives each request: 1, or the draft tokens verified at once with speculative decoding."""
    algo = cfg.speculative_algorithm
    if algo is None or str(algo).upper() == "NONE":
        return 1
    return int(cfg.speculative_num_draft_tokens or 1)


def gpu_slots(ess: EssArgs, context: int, topk: int, rows: int) -> int:
    """C, the GPU latent slots of each (request, layer): the rule of ess.core.settings.capacity (--ess-buffer-tokens,
    or --ess-sparse-ratio x the longest context served, at least what one step reads, rows x (top-k + 1)), at most the
    context (more slots than tokens buy nothing)."""
    try:
        return min(settings.capacity(ess.buffer_tokens, ess.sparse_ratio, context, topk, FLAGS, rows), context)
    except settings.KnobError as e:
        raise EssArgsError(str(e)) from e


def validate_model(ess: EssArgs, cfg: Any, hf_config: Any) -> EssFacts:
    """Model-dependent checks. cfg: the resolving view of ServerArgs; hf_config: the model's config.
    Returns the derived facts the runtime needs (top-k, layers, buffer, plan modes)."""
    from sglang.srt.configs.model_config import get_dsa_index_kpool, is_deepseek_dsa

    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if not is_deepseek_dsa(hf_config):
        raise EssArgsError(f"--enable-ess needs a model with DeepSeek Sparse Attention (e.g. DeepSeek-V3.2); {arch} has none")
    if get_dsa_index_kpool(hf_config) > 1:  # pooled index keys add tail tokens to every top-k list
        raise EssArgsError(f"--enable-ess supports one index key per token; {arch} pools them (index_kpool {get_dsa_index_kpool(hf_config)})")
    if cfg.kv_cache_dtype != LATENT_KV_DTYPE:
        raise EssArgsError(
            f"--enable-ess keeps FlashMLA's 656-byte FP8 latent rows; launch with --kv-cache-dtype {LATENT_KV_DTYPE} "
            f"(got --kv-cache-dtype {cfg.kv_cache_dtype})"
        )
    if (getattr(cfg, "pp_size", 1) or 1) > 1:
        raise EssArgsError(f"--enable-ess does not support --pp-size {cfg.pp_size} yet: its runtime holds every layer")
    if ess.progressive_pd:
        _check_progressive_pd(cfg)
    if cfg.disaggregation_mode == "prefill":
        return validate_prefill_node(ess, cfg, hf_config)
    for field, why in UNSUPPORTED_WITH_ESS.items():
        if getattr(cfg, field, False):
            raise EssArgsError(f"--enable-ess does not support --{field.replace('_', '-')} yet: {why}")
    if (getattr(cfg, "dcp_size", 1) or 1) > 1:
        raise EssArgsError(f"--enable-ess does not support --dcp-size {cfg.dcp_size} yet: ESS's host pool has no "
                           "decode-context-parallel translation")
    if cfg.disaggregation_mode == "decode" and (getattr(cfg, "disaggregation_decode_host_receive_threshold", 1.0) < 1):
        raise EssArgsError("--enable-ess does not support --disaggregation-decode-host-receive-threshold below 1 yet: "
                           "it receives KV into SGLang's retraction host pool, and ESS's host pool is the KV itself")
    if cfg.dsa_decode_backend not in ESS_DECODE_BACKENDS:
        raise EssArgsError(f"--enable-ess supports --dsa-decode-backend {' or '.join(ESS_DECODE_BACKENDS)}, got {cfg.dsa_decode_backend}")
    if cfg.dsa_prefill_backend not in ESS_PREFILL_BACKENDS:
        raise EssArgsError(
            f"--enable-ess stages prefill rows behind the paged prefill route; launch with --dsa-prefill-backend "
            f"{' or '.join(ESS_PREFILL_BACKENDS)} (got {cfg.dsa_prefill_backend})"
        )
    if ess.disk_dir is not None:
        _check_disk_tier(cfg)
    if query_rows_per_request(cfg) > 1 and (getattr(cfg, "speculative_eagle_topk", 1) or 1) > 1:
        raise EssArgsError(f"--enable-ess supports --speculative-eagle-topk 1 (got {cfg.speculative_eagle_topk}): a "
                           "tree verify repeats own positions across branches")

    topk = int(hf_config.index_topk)
    if ess.buffer_tokens is None and not cfg.context_length:
        ratio = "--ess-sparse-ratio" if ess.sparse_ratio is not None else \
            f"--ess-sparse-ratio (default {settings.DEFAULT_SPARSE_RATIO})"
        raise EssArgsError(
            f"{ratio} is a share of the context length: give --context-length (without it, the model's "
            f"{hf_config.max_position_embeddings} positions), or --ess-buffer-tokens"
        )
    context = int(cfg.context_length or hf_config.max_position_embeddings)
    rows = query_rows_per_request(cfg)
    buffer = gpu_slots(ess, context, topk, rows)

    if cfg.disaggregation_mode == "decode":  # the prefill node sends the warm-up state
        _check_pd_warmup(ess, context)
    layers = int(hf_config.num_hidden_layers)
    _check_bounds(ess, cfg, topk, context)
    _check_host_and_disk(ess, cfg, layers, topk, context, buffer, rows)
    # DBA in the plugin is DA under SGLang's two-batch overlap (docs/plugin.md, "Overlap"): each micro-batch's H2D
    # starts at its own indexer and runs under the other micro-batch's work; one batch has no halves to overlap
    tbo = bool(getattr(cfg, "enable_two_batch_overlap", False))
    if ess.overlap == "dba" and not tbo:
        raise EssArgsError("--ess-overlap dba overlaps one micro-batch's H2D with the other's indexer, over SGLang's "
                           "two-batch overlap: add --enable-two-batch-overlap, or use --ess-overlap da")
    modes = None
    if ess.layer_plan is not None:
        try:
            modes = load_plan(ess.layer_plan, layers, mtp_layer=rows > 1)
        except PlanError as e:
            raise EssArgsError(f"--ess-layer-plan: {e}") from e
        if not tbo and "dba" in modes:
            logger.warning("--ess-layer-plan: its %d dba layer(s) run as da (DBA needs --enable-two-batch-overlap)",
                           modes.count("dba"))
            modes = ["da" if m == "dba" else m for m in modes]
    role = "pd-decode" if cfg.disaggregation_mode == "decode" else "co-located"
    supported = ess.disk_dir is None and not ess.progressive_pd
    if ess.residency == "on" and not supported:
        raise EssArgsError("--ess-residency on: a disk tier (--ess-disk-dir) and --ess-progressive-pd keep every request "
                           "offloaded (their rows page through, or land in, the host pool over time): use auto or off")
    residency = ess.residency == "on" or (ess.residency == "auto" and supported)
    return EssFacts(role, topk, layers, context, buffer, rows, None if modes is None else tuple(modes),
                    residency=residency, fixed_step=_decode_graphs(cfg),
                    relabelled_decodes=bool(getattr(cfg, "enable_dp_attention", False)))


def _graph_phases(cfg: Any) -> list[str]:
    """The phases (of GRAPH_PHASES) whose CUDA-graph backend SGLang's config leaves on."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    graphs = getattr(cfg, "cuda_graph_config", None)
    return [p for p in GRAPH_PHASES if graphs is not None and getattr(graphs, p).backend != Backend.DISABLED]


def _decode_graphs(cfg: Any) -> bool:
    """Decode runs as CUDA graphs (SGLang's decode graph backend is on, on a CUDA device)."""
    return str(getattr(cfg, "device", None)) != "cpu" and "decode" in _graph_phases(cfg)


# Flags that shape the decode node's cache; a PD prefill node only sends warm-up state (sglang_ess.pd.warmup).
DECODE_ONLY = ("buffer_tokens", "sparse_ratio", "host_pool_gib", "overlap", "layer_plan", "da_attn1", "record_trace",
               "disk_dir", "disk_gib")
GRAPH_PHASES = ("decode", "prefill")  # SGLang's cuda_graph_config phases


# Transfer backends over which a decode node hears of a request's KV as it lands, in the order the prefill node sent
# it: Mooncake and NIXL, through ESS's hooks on both nodes (sglang_ess.pd.sending: the prefill worker sends the
# last chunk in phases and reports each). mori and Ascend are not audited; "fake" transfers nothing.
PROGRESSIVE_BACKENDS: tuple[str, ...] = ("mooncake", "nixl")


def _check_progressive_pd(cfg: Any) -> None:
    """--ess-progressive-pd (docs/pd.md, "Progressive PD transfer"): a decode node's flag, over a backend whose
    prefill node sends in the progressive order and reports it (decode CUDA graphs may stay on: a batch holding a
    request still landing runs eagerly, sglang_ess.hooks.pd.after_can_run_graph)."""
    mode = cfg.disaggregation_mode
    if mode != "decode":
        node = "a co-located node (--disaggregation-mode null)" if mode in (None, "null") else \
            f"a {mode} node (--disaggregation-mode {mode})"
        raise EssArgsError(f"--ess-progressive-pd starts decode before a request's KV has all arrived: a PD decode "
                           f"node's flag (--disaggregation-mode decode), not {node}")
    backend = str(getattr(cfg, "disaggregation_transfer_backend", "") or "")
    if backend not in PROGRESSIVE_BACKENDS:
        raise EssArgsError(f"--ess-progressive-pd needs a transfer backend whose prefill node sends a request's KV in "
                           f"the progressive order and reports it as it lands: --disaggregation-transfer-backend "
                           f"{' or '.join(PROGRESSIVE_BACKENDS)}, not {backend} (docs/pd.md, \"Progressive PD "
                           f"transfer\")")


def _check_disk_tier(cfg: Any) -> None:
    """--ess-disk-dir faults pages in from disk on the host between layers (docs/plugin.md, "Disk tier"): no CUDA
    graph can hold that, and a PD decode node receives KV into host rows by location, which a tier moves."""
    if cfg.disaggregation_mode == "decode":
        raise EssArgsError("--ess-disk-dir is not supported on a PD decode node yet: the transfer engine writes received "
                           "KV into host memory by token location, and the disk tier keeps only some locations there")
    on = _graph_phases(cfg)
    if on:
        raise EssArgsError(f"--ess-disk-dir reads pages from disk between layers on the host, which a CUDA graph cannot "
                           f"hold ({' and '.join(on)} graphs are on): add "
                           + " ".join(f"--cuda-graph-backend-{p} disabled" for p in on))


def _check_bounds(ess: EssArgs, cfg: Any, topk: int, context: int) -> None:
    """Upper bounds that follow from the model and the launch."""
    ranked = context - topk  # the indexer ranks a request's positions; the top-k are selected, the rest can follow
    if ess.record_lookahead > ranked:
        raise EssArgsError(f"--ess-record-lookahead {ess.record_lookahead}: the indexer ranks at most the context's "
                           f"{context} positions, top-k {topk} of them selected: at most {ranked} can follow")
    chunk = cfg.chunked_prefill_size if (cfg.chunked_prefill_size or 0) > 0 else context
    rows = min(chunk, context)  # the query rows of one prefill forward
    if ess.warmup_windows > rows:
        raise EssArgsError(f"--ess-warmup-windows {ess.warmup_windows}: LRU-Warmup replays the last W query rows of a "
                           f"prefill forward, which holds at most {rows} (--chunked-prefill-size / --context-length)")


def _check_host_and_disk(ess: EssArgs, cfg: Any, layers: int, topk: int, context: int, buffer: int, rows: int) -> None:
    """What the host pool and a disk tier must hold, from the flags alone, before the weights load: one request of
    the full context (sizing then charges the rest against the device budget it profiles after the load)."""
    from sglang_ess import sizing

    ranks = sizing.node_ranks(cfg)
    disk = None
    if ess.disk_dir is not None:
        free = sizing.free_disk_bytes(ess.disk_dir) // ranks
        if ess.disk_gib is not None and ess.disk_gib * GIB > free:
            raise EssArgsError(f"--ess-disk-gib {ess.disk_gib}: more than this rank's share of the free space in "
                               f"{ess.disk_dir}, {free / GIB:.1f} GiB")
        disk = int(ess.disk_gib * GIB) if ess.disk_gib is not None else free
    try:
        sizing.ess_pool_sizes(layers, UNBOUNDED_DEVICE, ess.host_pool_gib, 1, context, buffer,
                              host_limit=sizing.host_limit_bytes(ranks), disk_budget_bytes=disk)
    except ValueError as e:
        raise EssArgsError(str(e)) from e
    if disk is not None:
        need = sizing.tier_min_frames(context, 1, topk, rows, context)
        if int(ess.host_pool_gib * GIB) // PAGE_BYTES < need:
            raise EssArgsError(f"--ess-host-pool-gib {ess.host_pool_gib}: a disk tier's frames must hold the {need} pages "
                               f"one layer's step of one request may need ({need * PAGE_BYTES / GIB:.3f} GiB)")


def rank_weight_bytes(cfg: Any, layers: int, with_mtp: bool) -> tuple[int | None, str]:
    """The checkpoint's weights over the tensor-parallel ranks (a lower bound of one rank's: nothing is split more
    ways), and where the figure comes from; None where the weights are not on this disk yet."""
    from sglang_ess.weights import CheckpointError, checkpoint_weight_bytes

    try:
        total = checkpoint_weight_bytes(cfg.model_path, layers, with_mtp)
    except (CheckpointError, OSError) as e:
        raise EssArgsError(f"--model-path: {e}") from e
    tp = max(1, cfg.tp_size or 1)
    if total is None:
        return None, f"{cfg.model_path} holds no safetensors files"
    return total // tp, f"{total / GIB:.2f} GiB in {cfg.model_path} over --tp-size {tp}"


def check_device(cfg: Any, facts: EssFacts, memory_bytes: float, source: str) -> None:
    """SGLang's static budget (memory_bytes x --mem-fraction-static) less the checkpoint's weights on this rank must
    hold one ESS request (sglang_ess.sizing.check_device_budget). cfg: the resolved record."""
    from sglang_ess import sizing

    weights, where = rank_weight_bytes(cfg, facts.layers, facts.query_rows > 1)
    sizing.check_device_budget(memory_bytes, source, float(cfg.mem_fraction_static), weights, where,
                               sizing.one_request_device_bytes(facts.layers, facts.context, facts.buffer, facts.query_rows),
                               facts.context, facts.buffer)


def check_device_capacity(cfg: Any, facts: EssFacts) -> None:
    """At launch, before any weight loads: check_device on the device's capacity as SGLang reads it. Each scheduler
    checks again with the free memory it measures before its load (sglang_ess.hooks.startup.before_load_model)."""
    from sglang.srt.utils.common import get_device_memory_capacity

    capacity_mib = get_device_memory_capacity(cfg.device)
    if capacity_mib is None or cfg.mem_fraction_static is None:
        logger.info("ESS: the device memory is checked in the scheduler, before its load: SGLang reads no capacity "
                    "for --device %s here", cfg.device)
        return
    check_device(cfg, facts, capacity_mib * MIB, f"the {cfg.device} device's capacity")


MIB = 1 << 20
UNBOUNDED_DEVICE = 1 << 62  # the device budget is profiled after the weights load; these checks need the host only


def _check_pd_warmup(ess: EssArgs, context: int) -> None:
    if ess.warmup_windows > pd_warmup.WINDOWS:
        raise EssArgsError(f"--ess-warmup-windows {ess.warmup_windows}: PD nodes exchange at most {pd_warmup.WINDOWS} windows")
    if context > pd_warmup.MAX_POSITION:
        raise EssArgsError(f"--enable-ess with PD: context {context} exceeds the warm-up wire's {pd_warmup.MAX_POSITION} positions")


def validate_prefill_node(ess: EssArgs, cfg: Any, hf_config: Any) -> EssFacts:
    """--enable-ess on a PD prefill node: the node keeps SGLang's own KV cache and sends each request's warm-up state
    to the decode node with its metadata; only --ess-warmup-windows applies."""
    given = [FLAGS[f] for f in DECODE_ONLY if getattr(ess, f) != EssArgs.__dataclass_fields__[f].default]
    if given:
        raise EssArgsError(f"{', '.join(given)} shape(s) the decode node's cache; on a prefill node (--disaggregation-mode "
                           "prefill) --enable-ess only sends warm-up state (--ess-warmup-windows)")
    context = int(cfg.context_length or hf_config.max_position_embeddings)
    _check_pd_warmup(ess, context)
    return EssFacts("pd-prefill", int(hf_config.index_topk), int(hf_config.num_hidden_layers), context,
                    windows=ess.warmup_windows)


def validate_server_args(server_args: Any) -> EssFacts | None:
    """The launch checks of a record, against its model and its resolved settings; None when ESS is off."""
    ess = ess_args(server_args)
    if not ess.enable:
        return None
    from sglang.srt.arg_groups.overrides import model_config_of, resolving_view

    return validate_model(ess, resolving_view(server_args), model_config_of(server_args).hf_config)


def resolution_step(server_args: Any, previous) -> None:
    """Registered around SGLang's `handle_other_validations`: the launch's checks, once, in the launcher; their facts
    ride on the record from here on."""
    previous(server_args)
    facts = validate_server_args(server_args)
    if facts is None:
        return
    attach_facts(server_args, facts)
    if facts.role != "pd-prefill":
        from sglang.srt.arg_groups.overrides import resolving_view

        check_device_capacity(resolving_view(server_args), facts)
