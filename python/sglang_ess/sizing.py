"""How many tokens and requests an ESS decode node holds: the device keeps index-K for every token, C latent slots
per request and the LRU tables; the pinned host pool keeps the latent row of every token.

`resolve_memory_pool_config` is what SGLang's KV cache configurator runs instead of its own sizing when ESS is on:
SGLang charges every token its full cell (latent + index-K); ESS charges the latent only to the host, or with
--ess-disk-dir to the disk tier's page file, the host then holding --ess-host-pool-gib of frames."""

from __future__ import annotations

import dataclasses
import logging
import os

from ess.core import layout
from ess.core.disk_tier import PAGE_BYTES, free_disk_bytes
from ess.core.settings import DISK_PAGE_BYTES, GIB, HOST_PINNABLE_FRACTION, PAGE_TOKENS
from ess.core.memory import cache_bytes, table_bytes
from ess.core.serving import whole_pages

logger = logging.getLogger("sglang_ess")

# SGLang's MLA row writer (`_write_mla_kv_buffer`, its Triton and torch scatters alike) never writes destination row 0,
# the location it reserves for CUDA-graph padding; ESS hands it rows of its own buffers, so row 0 of the decode
# scratch and of the prefill staging buffer is left unused and the rows it writes start at FIRST_ROW (sglang_ess.pool).
FIRST_ROW = 1


@dataclasses.dataclass(frozen=True)
class EssPoolSizes:
    tokens: int  # token pool size (locations): the host pool's rows, and index-K rows on the device
    max_requests: int
    device_bytes: int  # index-K of every token + the sparse pool + its tables
    host_bytes: int  # the host pool, or a disk tier's frames
    limited_by: str  # "device", "host", "disk" or "requests" (max_requests x context_len fit all)
    disk_bytes: int = 0  # a disk tier's page file


@dataclasses.dataclass(frozen=True)
class DeviceBytes:
    """ESS's device memory, buffer by buffer, as its KV pool and runtime allocate it (`ess_device_bytes`); what they
    hold is measured from their tensors (sglang_ess.device_bytes) and the two agree to the byte (a test)."""

    index_k: int  # SGLang's index-K buffer: every location of every layer
    slots: int  # the latent slots: C per request-table row (or residency's pool of as many rows) + a sink, whole pages
    tables: int  # the LRU tables of every request-table row (slot -> position and stamp, position -> slot)
    step_state: int  # per request-table row: region start (int64, int32), residency flag, the step tally; counters
    scratch: int  # the decode scratch (its reserved row 0, the rows one step writes) and its row index
    staging: int  # the prefill staging buffer (row 0 reserved), whole pages
    location_map: int  # token location -> staging row (int32, every location and a sink)

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))


# the runtime's step state (sglang_ess.runtime, ess.core.serving): per request-table row a region start as int64 and
# int32, a residency flag and three int32 tally entries; once: the LRU stamp and the batch size (int32), the counters
STEP_STATE_ROW_BYTES = 8 + 4 + 1 + 3 * 4
STEP_STATE_BYTES = 4 + 4 + 8 * 5  # (5: sglang_ess.readout.COUNTERS)


def ess_device_bytes(layers: int, locations: int, rows: int, capacity: int, width: int, scratch_rows: int,
                     stage_rows: int) -> DeviceBytes:
    """What ESS allocates on the device for `locations` token locations (SGLang's pool size + a page), `rows`
    request-table rows of `width` positions with `capacity` slots each, a decode scratch of `scratch_rows` rows and
    a staging buffer of `stage_rows` rows."""
    return DeviceBytes(
        index_k=layers * locations * layout.INDEX_ROW_BYTES,
        slots=layers * whole_pages(rows * capacity + 1) * layout.LATENT_ROW_BYTES,
        tables=layers * rows * table_bytes(capacity, width),
        step_state=rows * STEP_STATE_ROW_BYTES + STEP_STATE_BYTES,
        scratch=(FIRST_ROW + scratch_rows) * layout.LATENT_ROW_BYTES + scratch_rows * 8,
        staging=whole_pages(FIRST_ROW + stage_rows) * layout.LATENT_ROW_BYTES,
        location_map=(locations + 1) * 4,
    )


def stock_device_bytes(layers: int, locations: int) -> int:
    """What stock SGLang's DSA pool allocates on the device for the same locations: latent and index-K rows."""
    return layers * locations * (layout.LATENT_ROW_BYTES + layout.INDEX_ROW_BYTES)


@dataclasses.dataclass(frozen=True)
class DiskTierSpec:
    """A disk tier under the host pool, as `disk_tier_spec` resolved it for the pool (sglang_ess.pool)."""

    host_bytes: int  # the pinned frames (--ess-host-pool-gib)
    disk_dir: str
    disk_bytes: int  # the page file's budget (--ess-disk-gib, or this rank's share of the free space)


def host_limit_bytes(ranks_on_node: int) -> int:
    """This rank's share of the pinned host memory the machine allows (HOST_PINNABLE_FRACTION of its physical memory,
    split over the ranks of the node, each of which pins its own pool)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * HOST_PINNABLE_FRACTION) // max(1, ranks_on_node)


def ess_pool_sizes(num_layers: int, device_budget_bytes: int, host_budget_gib: float | None, max_requests: int | None,
                   context_len: int, capacity: int, per_token_bytes: int | None = None,
                   host_limit: int | None = None, disk_budget_bytes: int | None = None,
                   host_per_request: int = 0, device_per_request: int = 0) -> EssPoolSizes:
    """Sizes for `max_requests` requests of up to `context_len` tokens with `capacity` GPU slots each. Tokens are what
    the device budget leaves after the per-request sparse pools, capped by the host pool (default: no cap beyond
    max_requests x context_len). max_requests None: as many requests as fit at full context on the device and in
    the host budget. per_token_bytes: device bytes per token (default index-K of every layer; SGLang adds an MTP
    draft layer's share). host_limit: the pinned host bytes this rank may take (host_limit_bytes): a larger
    --ess-host-pool-gib is refused, and without it the pool is capped there, so the host wall is found at start-up,
    never by running out. disk_budget_bytes: a disk tier's page file budget, which then caps the tokens, the host
    budget being its frames. host_per_request: host bytes each request row takes besides its tokens' rows (a PD
    decode node's warm-up metadata), charged to the same host budget. Raises ValueError naming the flag when nothing
    fits. device_per_request: device bytes each request row takes besides its slots and tables (staging rows)."""
    L = num_layers
    # slots + slot tables + the position -> slot table (sized by context, per request); then index-K per token
    per_request = cache_bytes(L, context_len, layout.LATENT_ROW_BYTES, 0, capacity) + device_per_request
    per_token = L * layout.INDEX_ROW_BYTES if per_token_bytes is None else per_token_bytes
    # tokens whose latent rows the host pool (or a disk tier) holds
    latent_tokens = None if host_budget_gib is None else int(host_budget_gib * GIB) // (L * layout.LATENT_ROW_BYTES)
    cap_name = "host"
    if disk_budget_bytes is not None:  # the tokens live on disk; the host budget is the tier's frames
        latent_tokens = disk_budget_bytes // (L * DISK_PAGE_BYTES) * PAGE_TOKENS
        cap_name = "disk"
        if latent_tokens < context_len:
            raise ValueError(f"--ess-disk-gib: {disk_budget_bytes / GIB:.1f} GiB of disk hold {latent_tokens} tokens, below "
                             f"one request of {context_len}")
    if host_limit is not None:
        if host_budget_gib is not None and host_budget_gib * GIB > host_limit:
            raise ValueError(f"--ess-host-pool-gib {host_budget_gib}: more than this rank may pin, {host_limit / GIB:.1f} GiB "
                             f"({HOST_PINNABLE_FRACTION:.0%} of the machine's memory over its ranks)")
        if latent_tokens is None:  # no budget given (a disk tier gives one): the pinnable share
            latent_tokens = host_limit // (L * layout.LATENT_ROW_BYTES)
            if latent_tokens < context_len:
                raise ValueError(f"--ess-host-pool-gib: this rank may pin {host_limit / GIB:.1f} GiB, room for {latent_tokens} "
                                 f"tokens, below one request of {context_len}")
    if latent_tokens is not None and latent_tokens < context_len:
        raise ValueError(f"--ess-host-pool-gib {host_budget_gib}: room for {latent_tokens} tokens, below one request of {context_len}")
    # the host bytes the latent rows and the per-request host state share (without a disk tier)
    host_total = None if latent_tokens is None or disk_budget_bytes is not None else latent_tokens * L * layout.LATENT_ROW_BYTES
    if max_requests is None:
        max_requests = device_budget_bytes // (per_request + context_len * per_token)
        if latent_tokens is not None:
            row_host = context_len * L * layout.LATENT_ROW_BYTES + (host_per_request if host_total is not None else 0)
            max_requests = min(max_requests, (latent_tokens * L * layout.LATENT_ROW_BYTES) // row_host)
        if max_requests < 1:
            raise ValueError(f"--ess-buffer-tokens/--ess-sparse-ratio: one request of {context_len} tokens with {capacity} slots does not fit the device budget")
    if host_total is not None and host_per_request:
        latent_tokens = (host_total - max_requests * host_per_request) // (L * layout.LATENT_ROW_BYTES)
        if latent_tokens < context_len:
            raise ValueError(f"--ess-host-pool-gib: the host memory left after {max_requests} request rows' PD warm-up "
                             f"metadata ({max_requests * host_per_request / GIB:.2f} GiB) holds {max(0, latent_tokens)} "
                             f"tokens, below one request of {context_len}")
    device_tokens = (device_budget_bytes - max_requests * per_request) // per_token
    if device_tokens < 1:
        raise ValueError(f"--ess-buffer-tokens/--ess-sparse-ratio: {max_requests} requests x {capacity} slots do not fit the device budget")
    want = max_requests * context_len
    tokens = min(device_tokens, want if latent_tokens is None else latent_tokens, want)
    limited_by = "requests" if tokens == want else "device" if tokens == device_tokens else cap_name
    tiered = disk_budget_bytes is not None
    return EssPoolSizes(
        tokens=int(tokens),
        max_requests=int(max_requests),
        device_bytes=int(max_requests * per_request + tokens * per_token),
        host_bytes=int(host_budget_gib * GIB) if tiered else int(tokens * L * layout.LATENT_ROW_BYTES),
        limited_by=limited_by,
        disk_bytes=int(-(-tokens // PAGE_TOKENS) * L * DISK_PAGE_BYTES) if tiered else 0,
    )


def disk_tier_spec(ess, ranks_on_node: int) -> DiskTierSpec | None:
    """--ess-disk-dir's tier for one rank: --ess-host-pool-gib of frames, a page file of --ess-disk-gib or, without
    it, the rank's share of the directory's free space (each rank of the node writes its own file there)."""
    if ess.disk_dir is None:
        return None
    disk = int(ess.disk_gib * GIB) if ess.disk_gib is not None else free_disk_bytes(ess.disk_dir) // max(1, ranks_on_node)
    return DiskTierSpec(int(ess.host_pool_gib * GIB), ess.disk_dir, disk)


def tier_min_frames(tokens: int, max_requests: int, topk: int, query_rows: int, context_len: int) -> int:
    """Host frames a disk tier needs at least: one layer's pages that a decode step may fetch (every selected row
    and own row in a page of its own) or a prefill batch may stage (one context over the batch's requests), never
    more than a layer of the token pool holds."""
    step = max_requests * query_rows * (topk + 1)
    stage = -(-context_len // PAGE_TOKENS) + max_requests
    return min(max(step, stage), -(-tokens // PAGE_TOKENS) + 1)


def resolve_memory_pool_config(kvc, pre_model_load_memory: int, ess, facts) -> tuple[object, DiskTierSpec | None]:
    """SGLang's `KVCacheConfigurator._resolve_memory_pool_config` for an ESS target worker: the same profiled
    budget and constraints, ESS's arithmetic in between. Returns SGLang's MemoryPoolConfig and the disk tier the pool
    is to build (None without --ess-disk-dir; the configurator, a slots dataclass, takes no attribute of ESS's, so
    the plugin keeps it). The MTP draft worker receives this config, and its own (stock) pool's per-token bytes are in
    SGLang's cell size, which ESS keeps."""
    from sglang.srt.model_executor.pool_configurator import (
        DefaultPoolConfigurator,
        MemoryPoolConfig,
        create_memory_pool_configurator,
    )
    from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len
    from sglang.srt.runtime_context import get_schedule
    from sglang_ess.args import EssArgsError

    configurator = create_memory_pool_configurator(kvc)
    if not isinstance(configurator, DefaultPoolConfigurator):
        raise EssArgsError(f"--enable-ess sizes SGLang's standard DSA pool; this launch uses {type(configurator).__name__}")
    layers = kvc.layer_info.num_effective_layers
    page = get_schedule().page_size
    width = facts.context + get_req_to_token_extra_context_len()  # SGLang's request table: positions per row
    # Every device byte ESS allocates (ess_device_bytes) is charged: per token index-K (+ the draft layer's share,
    # in SGLang's cell) and its staging-map entry; per request-table row its slots, LRU tables and step state (and
    # with DP attention the staging rows of its relabelled decode); once the staging buffer, the decode scratch of
    # the most requests SGLang allows, a page of index-K and map entries, and a page of slot rounding.
    per_token = configurator._cell_size - layers * layout.LATENT_ROW_BYTES + 4
    fixed = ess_device_bytes(layers, page, 0, facts.buffer, width, MAX_REQUESTS * facts.query_rows, facts.context).total
    per_row = (layers * (facts.buffer * layout.LATENT_ROW_BYTES + table_bytes(facts.buffer, width))
               + STEP_STATE_ROW_BYTES + relabel_stage_rows(kvc.server_args, 1, facts) * layout.LATENT_ROW_BYTES)
    budget = kvc._profile_available_bytes(pre_model_load_memory) - configurator._fixed_overhead_bytes - fixed
    requested = get_schedule().max_running_requests
    r = None if requested is None else max(1, requested // kvc.attn_dp_size)
    # ESS gives every row of SGLang's request table its sparse pool: the requests', the padding row, and on a PD
    # decode node the rows reserved for requests still in transfer
    extra = extra_request_rows()
    ranks_on_node = node_ranks(kvc.server_args)  # each rank of the node pins its own host pool
    spec = disk_tier_spec(ess, ranks_on_node)
    per_request_host = warmup_metadata_bytes(facts, ess)
    sizes = ess_pool_sizes(layers, budget, ess.host_pool_gib,
                           None if r is None else r + extra, facts.context, facts.buffer, per_token,
                           host_limit=host_limit_bytes(ranks_on_node),
                           disk_budget_bytes=None if spec is None else spec.disk_bytes, host_per_request=per_request_host,
                           device_per_request=per_row - cache_bytes(layers, facts.context, layout.LATENT_ROW_BYTES, 0,
                                                                    facts.buffer))
    max_requests = min(max(1, sizes.max_requests - extra), MAX_REQUESTS)
    tokens = kvc._apply_token_constraints(sizes.tokens) // page * page  # SGLang's own caps (--max-total-tokens)
    rows = max_requests + extra
    if spec is not None:
        need = tier_min_frames(tokens, max_requests, facts.topk, facts.query_rows, facts.context)
        if spec.host_bytes // PAGE_BYTES < need:
            raise EssArgsError(f"--ess-host-pool-gib {ess.host_pool_gib}: a disk tier's frames must hold the {need} pages "
                               f"one layer's step may need ({need * PAGE_BYTES / GIB:.2f} GiB) for {max_requests} requests")
        logger.info("ESS disk tier: %.3g GiB of host frames over %.3g GiB of pages in %s", spec.host_bytes / GIB,
                    -(-tokens // PAGE_TOKENS) * layers * DISK_PAGE_BYTES / GIB, spec.disk_dir)
    host = spec.host_bytes if spec is not None else tokens * layers * layout.LATENT_ROW_BYTES
    device = ess_device_bytes(layers, tokens + page, rows, facts.buffer, width,
                              scratch_requests(rows) * facts.query_rows,
                              stage_rows(kvc.server_args, rows, facts)).total
    logger.info(
        "ESS pool: %d tokens (index-K on the device, latent rows in %.2f GiB of host memory%s), %d requests x %d "
        "device slots (%d request-table rows), %.2f GiB device, limited by %s", tokens, host / GIB,
        f" and {rows * per_request_host / GIB:.2f} GiB of PD warm-up metadata" if per_request_host else "",
        max_requests, facts.buffer, rows, device / GIB,
        sizes.limited_by if tokens == sizes.tokens else "--max-total-tokens / SGLang's token limits",
    )
    config = MemoryPoolConfig(max_total_num_tokens=tokens, max_running_requests=max_requests)
    config = configurator.finalize_with_max_running_requests(config)
    config.mem_fraction_static = get_schedule().mem_fraction_static
    return config, spec


MAX_REQUESTS = 4096  # SGLang's own ceiling on requests per worker; bounds the decode scratch charged up front


def node_ranks(server_args) -> int:
    """The ranks (processes, one host pool each) of this node: tensor x pipeline parallel ranks, times the data-
    parallel replicas unless DP attention keeps them inside the tensor-parallel ranks, over the nodes."""
    sa = server_args
    replicas = 1 if getattr(sa, "enable_dp_attention", False) else max(1, getattr(sa, "dp_size", 1) or 1)
    return max(1, (sa.tp_size or 1) * (sa.pp_size or 1) * replicas // max(1, sa.nnodes or 1))


def warmup_metadata_bytes(facts, ess) -> int:
    """Host bytes per request-table row of a PD decode node's warm-up metadata: SGLang keeps two metadata slots per
    row (scheduler.py: buffer_size = req_to_token_pool.size * 2), and the plugin appends one warm-up row to each
    (sglang_ess.pd.warmup); 0 elsewhere."""
    from sglang_ess.pd import warmup as pd_warmup

    if facts.role != "pd-decode" or not ess.warmup_windows:
        return 0
    return METADATA_SLOTS_PER_ROW * pd_warmup.row_ints(facts.layers, facts.topk) * 4


METADATA_SLOTS_PER_ROW = 2


def relabel_stage_rows(server_args, requests: int, facts) -> int:
    """Staging rows a decode step of `requests` requests takes when DP attention relabels it as one-token extends
    (each layer stages every selected row and own row: sglang_ess.pool.stage_selected); 0 without DP attention."""
    if not getattr(server_args, "enable_dp_attention", False):
        return 0
    return requests * facts.query_rows * (facts.topk + 1)


def stage_rows(server_args, max_running_requests: int, facts) -> int:
    """The prefill staging buffer's rows: one context (the admission hook keeps every prefill batch within it), or
    with DP attention the rows of the largest relabelled decode if more."""
    return max(facts.context, relabel_stage_rows(server_args, max_running_requests, facts))


def scratch_requests(table_rows: int) -> int:
    """The most requests one forward may hold, padding included: the request table's rows (the running requests and
    extra_request_rows), padded as SGLang pads a batch, to its CUDA-graph capture alignment (even sizes with
    two-batch overlap, multiples of the attention-TP size where gathered buffers are needed) and in eager mode with
    DP attention (multiples of the attention-TP size): SGLang's own functions (utils/common.py)."""
    from sglang.srt.utils.common import get_cuda_graph_max_batch_size, get_eager_max_batch_size

    return max(get_cuda_graph_max_batch_size(table_rows), get_eager_max_batch_size(table_rows))


def extra_request_rows() -> int:
    """Rows of SGLang's request table beyond the running requests: the padding row, plus on a PD decode node (or one
    that may switch to decode) the --disaggregation-decode-extra-slots rows for requests still in transfer
    (DecodeReqToTokenPool: size + pre_alloc_size + 1)."""
    from sglang.srt.runtime_context import get_disagg

    disagg = get_disagg()
    if disagg.disaggregation_mode == "decode" or disagg.enable_pd_role_switch:
        return 1 + (disagg.disaggregation_decode_extra_slots or 0)
    return 1


def one_request_device_bytes(layers: int, context_len: int, capacity: int, query_rows: int) -> int:
    """Device bytes ESS takes before a second request fits: the prefill staging buffer and the decode scratch that
    resolve_memory_pool_config charges first, and one request at full context (its slots, tables and step state,
    index-K of its tokens): a lower bound of ess_device_bytes (SGLang's request table is a few positions wider).
    SGLang's fixed overheads and an MTP draft layer's cells come on top."""
    return ess_device_bytes(layers, context_len, 1, capacity, context_len, MAX_REQUESTS * query_rows, context_len).total


def check_device_budget(memory_bytes: float, memory_source: str, mem_fraction_static: float, weight_bytes: int | None,
                        weights_source: str, need_bytes: int, context_len: int, capacity: int) -> None:
    """Before the weights load: SGLang's static budget (weights and KV cache: memory_bytes x --mem-fraction-static)
    less the checkpoint's weights on this rank must hold one ESS request (one_request_device_bytes), or no request
    ever fits and the launch would fail only after the load. The weights are a lower bound (replicated layers and
    converted copies add to them), so a launch refused here cannot fit. Raises EssArgsError naming the flags."""
    from sglang_ess.args import EssArgsError

    weights = weight_bytes or 0
    left = memory_bytes * mem_fraction_static - weights
    counted = (f" less the weights' {weights / GIB:.2f} GiB on this rank ({weights_source})" if weight_bytes is not None
               else f" (weights not counted: {weights_source})")
    if left >= need_bytes:
        logger.info("ESS device check before the load: %s %.2f GiB x %s%s leaves %.2f GiB; one request needs %.3f GiB",
                    memory_source, memory_bytes / GIB, mem_fraction_static, counted, left / GIB, need_bytes / GIB)
        return
    raise EssArgsError(
        f"--enable-ess: one request of {context_len} tokens with {capacity} GPU slots needs {need_bytes / GIB:.3f} GiB of "
        f"device memory (slots, index-K, staging, scratch), and SGLang's static budget leaves {max(0.0, left) / GIB:.3f} GiB: "
        f"{memory_source} {memory_bytes / GIB:.2f} GiB x --mem-fraction-static {mem_fraction_static}{counted}. Lower "
        "--context-length or --ess-buffer-tokens / --ess-sparse-ratio, or raise --mem-fraction-static or --tp-size")
