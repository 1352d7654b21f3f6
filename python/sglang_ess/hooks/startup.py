"""ESS's hooks as a server starts: its flags, the KV pool and its sizing, the device check before the weights load,
and the runtime that answers the DSA backend. Each reads ESS's settings of the launch through
sglang_ess.args.ess_args (the launch's checks run inside SGLang's argument resolution: validate.resolution_step)."""

from __future__ import annotations

import logging
import sys

from ess.core.landed_rows import LandingTracker
from ess.core.settings import GIB, PROGRESSIVE_REQUESTS
from sglang_ess import sizing
from sglang_ess.args import EssArgs, EssArgsError, add_cli_args, attach_flags, ess_args
from sglang_ess.hooks.shared import state
from sglang_ess.pd.engines import sglang_engines
from sglang_ess.pd.landing import ProgressiveDecode
from sglang_ess.pd.warmup import WarmupSender
from sglang_ess.pool import EssDSATokenToKVPool, pool_class
from sglang_ess.runtime import EssRuntime
from sglang_ess.validate import MIB, check_device

logger = logging.getLogger("sglang_ess")


# -- flags -------------------------------------------------------------------------------------------------------------
def after_add_cli_args(result, parser, *a, **kw):
    add_cli_args(parser)


def after_from_cli_args(server_args, cls, namespace, *a, **kw):
    attach_flags(server_args, namespace)


def launch_error_hook(previous):
    """sys.excepthook for the launcher: a refused ESS launch ends with its message alone, one line, as SGLang's
    argument errors do, not as the last line of a traceback; every other exception goes to `previous`."""

    def hook(kind, value, tb):
        if isinstance(value, EssArgsError):
            print(f"sglang: error: {value}", file=sys.stderr)
            return
        previous(kind, value, tb)

    hook.ess = True
    return hook


# -- pool: ESS's DSA pool class and its sizing -------------------------------------------------------------------------
def _ess_target(kvc) -> EssArgs | None:
    """ESS's settings when this configurator builds an ESS target pool (not the MTP draft worker's; a PD prefill node
    keeps SGLang's pool)."""
    ess = ess_args(kvc.server_args)
    if not ess.enable or getattr(kvc, "is_draft_worker", False) or ess.facts.role == "pd-prefill":
        return None
    return ess


def around_resolve_memory_pool_config(original, kvc, pre_model_load_memory, *a, **kw):
    ess = _ess_target(kvc)
    if ess is None:
        return original(kvc, pre_model_load_memory, *a, **kw)
    config, state.tier_spec = sizing.resolve_memory_pool_config(kvc, pre_model_load_memory, ess, ess.facts)
    return config


def around_build_dsa_kv_pool(original, kvc, *a, max_running_requests, dsa_pool_class, **kw):
    ess = _ess_target(kvc)
    if ess is not None:
        facts = ess.facts
        rows = max_running_requests  # SGLang passes its request table's rows here (requests, padding, PD transfers)
        dsa_pool_class = pool_class(
            scratch_rows=sizing.scratch_requests(rows) * facts.query_rows,
            stage_rows=sizing.stage_rows(kvc.server_args, rows, facts),
            tier=state.tier_spec,
        )
    return original(kvc, *a, max_running_requests=max_running_requests, dsa_pool_class=dsa_pool_class, **kw)


# -- runtime -----------------------------------------------------------------------------------------------------------
def before_load_model(model_runner, *a, **kw):
    """In each scheduler, before its weights load: the ess's device check (sglang_ess.validate.check_device) again
    with the free memory SGLang measured after its own start-up (`pre_model_load_memory`, what its KV budget is taken
    from), so memory other processes hold is found before the load, not after it."""
    ess = ess_args(model_runner.server_args)
    free_gib = getattr(model_runner, "pre_model_load_memory", None)
    if not ess.enable or ess.facts.role == "pd-prefill" or getattr(model_runner, "is_draft_worker", False) \
            or free_gib is None:
        return
    from sglang.srt.arg_groups.overrides import resolving_view

    check_device(resolving_view(model_runner.server_args), ess.facts, free_gib * 1024 * MIB,
                 f"the free memory of {model_runner.device} before the load")


def after_init_sparse_coordinator(result, model_runner, *a, **kw):
    """Build this rank's EssRuntime once the memory pools exist, where SGLang builds HiSparse's coordinator, and
    install it as the runner's sparse-offload coordinator: the DSA backend (built later) then asks it for the selected
    rows in decode and verify, takes un-fused top-k positions, and keeps the token-granular page table."""
    server_args = model_runner.server_args
    ess = ess_args(server_args)
    if not ess.enable or getattr(model_runner, "is_draft_worker", False):
        return
    facts = ess.facts
    pool = model_runner.token_to_kv_pool
    if facts.role == "pd-prefill":
        if facts.windows:
            state.pd.sender = WarmupSender(
                facts.layers, facts.topk, facts.windows, model_runner.req_to_token_pool.req_to_token,
                pool.size + pool.page_size + 1, start_layer=pool.start_layer,
            )
            state.pd.sender_pool, state.pd.wire = pool, (facts.layers, facts.topk)
            logger.info("ESS on a PD prefill node: sends %d warm-up windows per request", facts.windows)
        return
    if not isinstance(pool, EssDSATokenToKVPool):
        raise RuntimeError(f"--enable-ess: the KV pool is {type(pool).__name__}, not ESS's (a pool hook did not apply)")
    state.runtime = EssRuntime(
        ess,
        facts,
        token_table=model_runner.req_to_token_pool.req_to_token,
        host=pool.ess_host,
        device=model_runner.device,
        start_layer=pool.start_layer,
        model=str(server_args.model_path),
        tier=pool.ess_tier,
    )
    pool.ess_runtime = state.runtime
    table = model_runner.req_to_token_pool.req_to_token
    state.pool = pool
    state.device_charged = sizing.ess_device_bytes(pool.layer_num, pool.size + pool.page_size, table.shape[0],
                                                   facts.buffer, table.shape[1], pool.scratch_rows, pool.stage_rows)
    measured = pool.get_kv_size_bytes()
    pool.mem_usage = measured / GIB  # SGLang's readout of its KV cache (memory_usage.kvcache) counts the runtime's too
    logger.info("ESS device bytes: %d measured from the pool's and the runtime's tensors, %d charged by sizing",
                measured, state.device_charged.total)
    state.runtime.req_pool = model_runner.req_to_token_pool
    state.stage_tokens = pool.ess_stage.shape[0] - sizing.FIRST_ROW
    reset_on_admit(model_runner.req_to_token_pool, state.runtime)
    model_runner.hisparse_coordinator = state.runtime
    model_runner.ess_runtime = state.runtime
    if facts.role == "pd-decode" and ess.warmup_windows:
        state.pd.wire = (facts.layers, facts.topk)
    if ess.progressive_pd:  # validate: a PD decode node's flag only
        state.runtime.progressive = ProgressiveDecode(LandingTracker(
            facts.layers, facts.context, PROGRESSIVE_REQUESTS, model_runner.req_to_token_pool.req_to_token.shape[0],
            model_runner.device, page=pool.page_size), sglang_engines(state.pd))
    logger.info("ESS runtime: %s", state.runtime.stats())


def reset_on_admit(req_pool, rt: EssRuntime) -> None:
    """Request-table rows handed to new requests start with empty ESS tables (SGLang's on-alloc-rows callback): rows
    are also freed outside release_kv_cache (the decode node's KV offload, say), and a PD request that gets no warm-up
    row must not inherit its row's previous LRU state and GPU rows. The reset waits for the next forward
    (EssRuntime.apply_admissions), in stream order after any forward still in flight."""
    previous = req_pool._on_alloc_rows

    def admit(rows: list[int]) -> None:
        if previous is not None:
            previous(rows)
        rt.reset_rows(rows)

    if previous is None:
        req_pool.register_on_alloc_rows(admit)
    else:  # SGLang allows one callback per pool: keep the one it registered, ahead of ours
        req_pool._on_alloc_rows = admit
