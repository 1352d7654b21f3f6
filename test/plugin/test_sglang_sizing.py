"""The plugin's sizing of a launch against SGLang's real KVCacheConfigurator and pool configurator (CPU): what ESS
charges to the device (index-K of every token, C slots per request slot, staging, scratch) and to the host (the
latent cache, a disk tier's frames, a PD decode node's warm-up metadata) within the budget SGLang profiled."""

import pytest

sglang = pytest.importorskip("sglang")
from sglang_ess.args import EssArgs, EssFacts  # noqa: E402


def charged(layers, tokens, rows, cap, ctx):
    """What ESS allocates for these sizes (sglang_ess.sizing.ess_device_bytes), the scratch as sizing charges it
    (the most requests SGLang allows) and the table width SGLang gives (context + 4)."""
    from sglang_ess import sizing

    return sizing.ess_device_bytes(layers, tokens + 64, rows, cap, ctx + 4, sizing.MAX_REQUESTS, ctx).total


def configurator(monkeypatch, layers, avail):
    """SGLang's real KVCacheConfigurator (a slots dataclass: no attribute beyond its fields can be set on it) and its
    real DefaultPoolConfigurator (DSA FP8 cell, no draft), with the schedule and PD settings sizing reads, for a node
    of 8 ranks with `avail` bytes of device budget each. Built without its constructor, which profiles a loaded
    model's memory: the fields sizing reads are set, and the two profiling methods answer `avail` and pass tokens."""
    import types

    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor import pool_configurator as pc

    stock = pc.DefaultPoolConfigurator.__new__(pc.DefaultPoolConfigurator)
    stock._cell_size, stock._fixed_overhead_bytes = layers * (656 + 132), 0  # SGLang's DSA FP8 cell, no draft
    monkeypatch.setattr(pc, "create_memory_pool_configurator", lambda kvc: stock)
    schedule = types.SimpleNamespace(max_running_requests=None, page_size=64, mem_fraction_static=0.9)
    monkeypatch.setattr("sglang.srt.runtime_context.get_schedule", lambda: schedule)
    disagg = types.SimpleNamespace(disaggregation_mode="null", enable_pd_role_switch=False,
                                   disaggregation_decode_extra_slots=None)
    monkeypatch.setattr("sglang.srt.runtime_context.get_disagg", lambda: disagg)
    monkeypatch.setattr(KVCacheConfigurator, "_profile_available_bytes", lambda self, pre: avail)
    monkeypatch.setattr(KVCacheConfigurator, "_apply_token_constraints", lambda self, tokens: tokens)
    # the request table's extra positions (no speculative decoding): SGLang's rule reads its published settings
    monkeypatch.setattr("sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len", lambda: 4)
    # and the batch padding (no two-batch overlap, no DP attention: none), which reads them too
    from sglang_ess import sizing

    monkeypatch.setattr(sizing, "scratch_requests", lambda rows: rows)
    kvc = object.__new__(KVCacheConfigurator)
    kvc.layer_info = types.SimpleNamespace(num_effective_layers=layers)
    kvc.attn_dp_size = 1
    kvc.server_args = types.SimpleNamespace(tp_size=8, pp_size=1, nnodes=1)
    return kvc, stock, schedule, disagg


def resolve(kvc, ess, facts):
    """The plugin's sizing of this launch: SGLang's MemoryPoolConfig (the disk tier's spec goes to the pool)."""
    from sglang_ess import sizing

    return sizing.resolve_memory_pool_config(kvc, 0, ess, facts)[0]


def test_memory_pool_config_charges_the_latent_cache_to_the_host(monkeypatch):
    """SGLang's configurator hands ESS its profiled budget and per-token cell (latent + index-K); ESS sizes tokens and
    requests so that index-K of every token, C slots per request slot, staging and scratch fit the budget."""
    from sglang_ess import sizing

    layers, ctx, cap, avail = 61, 32768, 6554, 70 << 30
    kvc, stock, schedule, disagg = configurator(monkeypatch, layers, avail)
    monkeypatch.setattr(sizing, "host_limit_bytes", lambda ranks: (2 << 40) * 8 // 10 // ranks)  # a 2 TiB node
    facts = EssFacts("co-located", 2048, 61, ctx, cap)
    config = resolve(kvc, EssArgs(enable=True, buffer_tokens=cap), facts)
    R, T = config.max_running_requests, config.max_total_num_tokens
    used = charged(layers, T, R + 1, cap, ctx)
    assert used <= avail and T >= R * ctx - 64  # every request can reach full context
    baseline_requests = avail // (stock._cell_size * ctx)
    # past the memory wall: 139 request slots of 0.25 GiB sparse pool + 0.25 GiB index-K each, against 47 full caches
    assert (baseline_requests, R) == (47, 138)
    schedule.max_running_requests = 40  # a requested count is kept, and tokens fill the rest of the device
    config = resolve(kvc, EssArgs(enable=True, buffer_tokens=cap), facts)
    assert config.max_running_requests == 40 and config.max_total_num_tokens > 40 * ctx
    # a PD decode node: SGLang's table has size + extra slots + 1 rows (DecodeReqToTokenPool), each with C slots
    disagg.disaggregation_mode, disagg.disaggregation_decode_extra_slots = "decode", 80
    config = resolve(kvc, EssArgs(enable=True, buffer_tokens=cap), facts)
    R, T = config.max_running_requests, config.max_total_num_tokens
    used = charged(layers, T, R + 80 + 1, cap, ctx)
    assert R == 40 and used <= avail
    schedule.max_running_requests = None  # sized to fit: the in-transfer rows are charged before the requests
    config = resolve(kvc, EssArgs(enable=True, buffer_tokens=cap), facts)
    assert config.max_running_requests == 138 - 80
    disagg.disaggregation_mode = "null"
    with pytest.raises(ValueError, match="--ess-host-pool-gib 1"):
        resolve(kvc, EssArgs(enable=True, buffer_tokens=cap, host_pool_gib=1), facts)
    # the host wall: a rank's share of the node's pinnable memory (2 TiB x 0.8 / 8 = 204.8 GiB) is found at start-up
    with pytest.raises(ValueError, match="--ess-host-pool-gib 300: more than this rank may pin, 204.8 GiB"):
        resolve(kvc, EssArgs(enable=True, buffer_tokens=cap, host_pool_gib=300), facts)
    # on a 1 TiB node (102.4 GiB per rank) the host pool, not the device, caps the rows: 83 of 32K tokens, one of
    # them SGLang's padding row
    monkeypatch.setattr(sizing, "host_limit_bytes", lambda ranks: (1 << 40) * 8 // 10 // ranks)
    config = resolve(kvc, EssArgs(enable=True, buffer_tokens=cap), facts)
    assert config.max_total_num_tokens * layers * 656 <= 102.4 * (1 << 30) and config.max_running_requests == 82


def test_a_disk_tier_moves_the_host_wall_to_the_disk(monkeypatch, tmp_path):
    """With --ess-disk-dir the tokens are capped by the page file's budget and the host holds --ess-host-pool-gib of
    frames, which must hold one layer's worst-case step; on a 1 TiB node (102.4 GiB per rank) the host pool alone
    capped ESS at 82 requests of 32K, the tier lets the device decide."""
    from ess.core.disk_tier import PAGE_BYTES
    from ess.core.settings import DISK_PAGE_BYTES
    from sglang_ess import sizing

    layers, ctx, cap, avail = 61, 32768, 6554, 70 << 30
    kvc, _, schedule, _ = configurator(monkeypatch, layers, avail)
    monkeypatch.setattr(sizing, "host_limit_bytes", lambda ranks: (1 << 40) * 8 // 10 // ranks)
    facts = EssFacts("co-located", 2048, 61, ctx, cap)
    tiered = dict(enable=True, buffer_tokens=cap, disk_dir=str(tmp_path), disk_gib=1000)
    config, spec = sizing.resolve_memory_pool_config(kvc, 0, EssArgs(**tiered, host_pool_gib=64), facts)
    assert config.max_running_requests == 138  # the device's count, as on a 2 TiB node without a tier
    assert (spec.host_bytes, spec.disk_dir, spec.disk_bytes) == (64 << 30, str(tmp_path), 1000 << 30)
    assert config.max_total_num_tokens * layers * DISK_PAGE_BYTES // 64 <= spec.disk_bytes
    # a small disk caps the tokens (2.5M, below 100 requests x 32K)
    s = sizing.ess_pool_sizes(layers, avail, 64, 100, ctx, cap, host_limit=102 << 30, disk_budget_bytes=100 << 30)
    assert s.limited_by == "disk" and s.tokens == (100 << 30) // (layers * DISK_PAGE_BYTES) * 64
    assert s.host_bytes == 64 << 30 and s.disk_bytes <= 100 << 30
    with pytest.raises(ValueError, match="--ess-disk-gib: 1.0 GiB of disk hold 24960 tokens, below one request of 32768"):
        sizing.ess_pool_sizes(layers, avail, 64, None, ctx, cap, disk_budget_bytes=1 << 30)
    # frames below one layer's worst-case step are refused at start-up: 138 requests x 2049 rows, each in a page of
    # its own, capped by one layer of the token pool (its pages)
    need = min(138 * 2049, config.max_total_num_tokens // 64 + 1)
    assert need * PAGE_BYTES > 2 << 30
    with pytest.raises(ValueError, match=f"--ess-host-pool-gib 2: a disk tier's frames must hold the {need} pages"):
        resolve(kvc, EssArgs(**tiered, host_pool_gib=2), facts)
    schedule.max_running_requests = 16  # fewer requests need fewer frames (16 x 2049 pages: 1.3 GiB)
    resolve(kvc, EssArgs(**tiered, host_pool_gib=2), facts)
    # without --ess-disk-gib: this rank's share of the directory's free space
    monkeypatch.setattr(sizing, "free_disk_bytes", lambda d: 8 << 40)
    assert sizing.disk_tier_spec(EssArgs(enable=True, host_pool_gib=8, disk_dir=str(tmp_path)), 8).disk_bytes == 1 << 40


def test_a_pd_decode_node_charges_its_warmup_metadata_to_the_host(monkeypatch):
    """A PD decode node's metadata buffers (two slots per request-table row, in host memory) each carry ESS's
    warm-up row (about 2 MB for DeepSeek-V3.2): sizing charges them to the same host budget as the latent rows."""
    from sglang_ess import sizing
    from sglang_ess.pd import warmup as pd_warmup

    layers, ctx, cap, avail = 61, 32768, 6554, 70 << 30
    kvc, _, schedule, disagg = configurator(monkeypatch, layers, avail)
    monkeypatch.setattr(sizing, "host_limit_bytes", lambda ranks: (2 << 40) * 8 // 10 // ranks)
    disagg.disaggregation_mode, disagg.disaggregation_decode_extra_slots = "decode", 8
    schedule.max_running_requests = 40
    facts = EssFacts("pd-decode", 2048, layers, ctx, cap)
    rows = 40 + 8 + 1  # SGLang's decode request table: running + in-transfer + padding
    row_bytes = pd_warmup.row_ints(layers, 2048) * 4
    assert sizing.warmup_metadata_bytes(facts, EssArgs(enable=True)) == 2 * row_bytes and row_bytes > 1.9e6
    latent = 40 * ctx * layers * 656
    host_gib = (latent + rows * 2 * row_bytes // 2) / (1 << 30)  # room for the requests' tokens, not for all metadata
    config = resolve(kvc, EssArgs(enable=True, buffer_tokens=cap, host_pool_gib=host_gib), facts)
    assert config.max_total_num_tokens * layers * 656 + rows * 2 * row_bytes <= host_gib * (1 << 30)
    assert config.max_total_num_tokens < 40 * ctx  # the metadata took what the last request's tokens needed
    config = resolve(kvc, EssArgs(enable=True, buffer_tokens=cap, host_pool_gib=host_gib, warmup_windows=0), facts)
    assert config.max_total_num_tokens >= 40 * ctx  # no warm-up rows, no metadata of ESS's: every token fits
