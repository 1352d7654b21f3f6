"""Where ESS hooks into SGLang 0.5.23: one table of (target, hook type, hook), registered through SGLang's own
HookRegistry. Every hook is a no-op unless the server was launched with --enable-ess. The test suite resolves every
target in the installed sglang and checks the parameters each hook relies on, so an upstream rename fails a test.
"""

from __future__ import annotations

import logging
import torch

from ess import layout
from sglang_ess import args as ess_args_mod
from sglang_ess.runtime import EssRuntime
from sglang_ess.validate import resolution_step, validate_server_args

logger = logging.getLogger("sglang_ess")

SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
DSA_BACKEND = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"
DSA_POOL = "sglang.srt.mem_cache.memory_pool.DSATokenToKVPool"
RELEASE_KV = "sglang.srt.mem_cache.common.release_kv_cache"
RESOLUTION_STEP = "handle_other_validations"

_installed = False
_runtime: EssRuntime | None = None  # this process's (one model runner per scheduler process)


# -- flags -----------------------------------------------------------------------------------------------------
def after_add_cli_args(result, parser, *a, **kw):
    ess_args_mod.add_cli_args(parser)


def after_from_cli_args(server_args, cls, namespace, *a, **kw):
    ess_args_mod.attach(server_args, ess_args_mod.from_namespace(namespace))


# -- runtime ---------------------------------------------------------------------------------------------------
def after_init_sparse_coordinator(result, model_runner, *a, **kw):
    """Build this rank's EssRuntime once the memory pools exist (where SGLang builds HiSparse's coordinator)."""
    global _runtime
    server_args = model_runner.server_args
    ess = ess_args_mod.ess_args(server_args)
    if not ess.enable or getattr(model_runner, "is_draft_worker", False):
        return
    facts = validate_server_args(server_args)
    pool = model_runner.token_to_kv_pool
    _runtime = EssRuntime(
        ess,
        facts,
        token_table=model_runner.req_to_token_pool.req_to_token,
        host_locations=pool.size + pool.page_size,
        device=model_runner.device,
        start_layer=getattr(pool, "start_layer", 0) or 0,
        model=str(server_args.model_path),
    )
    pool._ess_runtime = _runtime
    model_runner.ess_runtime = _runtime
    logger.info("ESS runtime: %s", _runtime.stats())


def after_backend_init(result, backend, model_runner, *a, **kw):
    """The DSA backend asks its sparse-offload coordinator for the selected rows' indices in decode."""
    rt = getattr(model_runner, "ess_runtime", None)
    if rt is not None:
        backend.hisparse_coordinator = rt
        backend._ess_runtime = rt


def around_forward_decode(original, backend, *a, **kw):
    rt = getattr(backend, "_ess_runtime", None)
    if rt is None:
        return original(backend, *a, **kw)
    rt.decoding = True
    try:
        return original(backend, *a, **kw)
    finally:
        rt.decoding = False


def after_set_mla_kv_buffer(result, pool, layer, loc_info, *a, layer_id_override=None, **kw):
    """New latent rows: SGLang quantised them into its buffer; ESS copies them to the host pool (and, in decode, to
    their GPU slots)."""
    rt = getattr(pool, "_ess_runtime", None)
    if rt is None:
        return
    from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

    loc = unwrap_write_loc(loc_info)[0]
    layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
    rows = pool.kv_buffer[layer_id - rt.start_layer].view(torch.uint8).view(-1, layout.LATENT_ROW_BYTES)[loc]
    rt.store_rows(layer_id, loc, rows, decode=rt.decoding)


def around_get_key_buffer(original, pool, layer_id, *a, **kw):
    rt = getattr(pool, "_ess_runtime", None)
    if rt is not None and rt.decoding:
        return rt.latent_buffer(layer_id)
    return original(pool, layer_id, *a, **kw)


def before_release_kv_cache(req, *a, **kw):
    rt = _runtime
    idx = getattr(req, "req_pool_idx", None)
    if rt is not None and idx is not None:
        path = rt.release(int(idx), str(getattr(req, "rid", "")))
        if path:
            logger.info("ESS trace written: %s", path)


def _hook_table():
    from sglang.srt.plugins.hook_registry import HookType

    return [
        (f"{SERVER_ARGS}.add_cli_args", HookType.AFTER, after_add_cli_args),
        (f"{SERVER_ARGS}.from_cli_args", HookType.AFTER, after_from_cli_args),
        (f"{MODEL_RUNNER}.maybe_init_hisparse_coordinator", HookType.AFTER, after_init_sparse_coordinator),
        (f"{DSA_BACKEND}.__init__", HookType.AFTER, after_backend_init),
        (f"{DSA_BACKEND}.forward_decode", HookType.AROUND, around_forward_decode),
        (f"{DSA_POOL}.set_mla_kv_buffer", HookType.AFTER, after_set_mla_kv_buffer),
        (f"{DSA_POOL}.get_key_buffer", HookType.AROUND, around_get_key_buffer),
        (RELEASE_KV, HookType.BEFORE, before_release_kv_cache),
    ]


# Parameters of each target that the hook above relies on (by name, in order from the first).
EXPECTED_PARAMS = {
    f"{SERVER_ARGS}.add_cli_args": ["parser"],
    f"{SERVER_ARGS}.from_cli_args": ["cls", "args"],
    f"{MODEL_RUNNER}.maybe_init_hisparse_coordinator": ["self"],
    f"{DSA_BACKEND}.__init__": ["self", "model_runner"],
    f"{DSA_BACKEND}.forward_decode": ["self", "q", "k", "v", "layer", "forward_batch"],
    f"{DSA_POOL}.set_mla_kv_buffer": ["self", "layer", "loc_info", "cache_k_nope", "cache_k_rope", "layer_id_override"],
    f"{DSA_POOL}.get_key_buffer": ["self", "layer_id"],
    RELEASE_KV: ["req", "tree_cache"],
}


def install() -> list[str]:
    """Register every hook (SGLang applies them after all plugins ran). Returns the targets."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry

    global _installed
    table = _hook_table()
    if not _installed:  # SGLang loads plugins once per process; tests may call this again
        for target, kind, hook in table:
            HookRegistry.register(target, hook, kind)
        register_resolution_hook(RESOLUTION_STEP)(resolution_step)
        _installed = True
    return [t for t, _, _ in table]


def check_installed() -> list[str]:
    """Targets that SGLang failed to patch (it logs and goes on; ESS would then be silently off)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [t for t, _, _ in _hook_table() if t not in HookRegistry._patched]

