"""Where ESS hooks into SGLang 0.5.23: one table of every touch point (sglang_ess.hooks.table.Hook: target, hook type,
hook, the parameters it reads, why), registered through SGLang's own HookRegistry, and one step of SGLang's argument
resolution (RESOLUTION_STEP: the launch's checks, sglang_ess.validate.resolution_step). Every hook is a no-op unless the
server was launched with --enable-ess. The hooks themselves live by concern:
    startup.py   the flags, the KV pool and its sizing, the device check, the runtime
    forward.py   a prefill batch's admission and staging, each forward and the DSA backend's calls, a request's
                 release, a disk-tier page lost, the state readout
    graphs.py    decode CUDA graphs of both paths (general and resident), one chosen per replay
    pd.py        PD disaggregation: the warm-up metadata, the decode node's transfer queue, the ordered sends and
                 progress reports over Mooncake and NIXL, the transfer engines' memory registration
    shared.py    what they share in one process (`state`; its PD part is sglang_ess.pd.state)
The test suite resolves every target in the installed sglang and checks the parameters each row names, so an upstream
rename fails a test.
"""

from __future__ import annotations

import sys

from sglang.srt.plugins.hook_registry import HookType

from sglang_ess import cpu
from sglang_ess.hooks import forward, graphs, pd, startup, table
from sglang_ess.hooks.table import Hook
from sglang_ess.hooks.shared import state
from sglang_ess.validate import resolution_step

AFTER, AROUND, BEFORE = HookType.AFTER, HookType.AROUND, HookType.BEFORE

SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
DSA_BACKEND = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"
INDEXER = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer"
INDEXER_METADATA = "sglang.srt.layers.attention.dsa.dsa_indexer_metadata.DSAIndexerMetadata"
KV_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
RELEASE_KV = "sglang.srt.mem_cache.common.release_kv_cache"
REQ_TO_TOKEN = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool"
DECODE_REQ_TO_TOKEN = "sglang.srt.disaggregation.decode.DecodeReqToTokenPool"
PREFILL_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
METADATA_BUFFERS = "sglang.srt.disaggregation.utils.MetadataBuffers"
DECODE_TRANSFER_QUEUE = "sglang.srt.disaggregation.decode.DecodeTransferQueue"
NIXL_MANAGER = "sglang.srt.disaggregation.nixl.conn.NixlKVManager"
MOONCAKE_MANAGER = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"
MOONCAKE_REGISTRATION = "sglang.srt.disaggregation.mooncake.conn.KVArgsRegisterInfo"
NIXL_REGISTRATION = "sglang.srt.disaggregation.nixl.conn.KVArgsRegisterInfo"
MOONCAKE_ENGINE = "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine"
INTERNAL_STATE = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
DECODE_GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
DECODE_GRAPH_VOTE = "sglang.srt.managers.scheduler_components.dp_attn._local_decode_cuda_graph_vote"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
FLASH_MLA = "sglang.kernels.ops.attention.flash_mla_interface.flash_mla_with_kvcache"  # the backend imports it per call
RESOLUTION_STEP = "handle_other_validations"  # the argument resolution step the launch's checks wrap

# What each hook does there is its docstring's; `why` says it in a line.
TABLE = [
    # -- startup.py: the flags, the KV pool and its sizing, the device check, the runtime
    Hook(f"{SERVER_ARGS}.add_cli_args", AFTER, startup.after_add_cli_args, ("parser",),
         "the ESS flags join SGLang's parser"),
    Hook(f"{SERVER_ARGS}.from_cli_args", AFTER, startup.after_from_cli_args, ("cls", "args"),
         "the parsed ESS flags ride on the ServerArgs record"),
    Hook(f"{KV_CONFIGURATOR}._resolve_memory_pool_config", AROUND, startup.around_resolve_memory_pool_config,
         ("self", "pre_model_load_memory"), "ESS's sizing: latent rows on the host, index-K and C slots on the device"),
    Hook(f"{KV_CONFIGURATOR}._build_dsa_kv_pool", AROUND, startup.around_build_dsa_kv_pool,
         ("self", "max_total_num_tokens", "max_running_requests", "dsa_pool_class"),
         "ESS's DSA pool class, with its scratch and staging rows"),
    Hook(f"{MODEL_RUNNER}.load_model", BEFORE, startup.before_load_model, ("self",),
         "the device check again with the free memory SGLang measured, before the weights load"),
    Hook(f"{MODEL_RUNNER}.maybe_init_hisparse_coordinator", AFTER, startup.after_init_sparse_coordinator, ("self",),
         "the runtime (or a prefill node's warm-up sender), installed as the sparse-offload coordinator"),
    # -- forward.py: the forward and the requests around it
    Hook(f"{PREFILL_ADDER}.add_one_req", AROUND, forward.around_add_one_req, ("self", "req", "has_chunked_req"),
         "a prefill batch stays within the staging rows sizing charged"),
    Hook(f"{REQ_TO_TOKEN}.alloc", AFTER, forward.after_req_to_token_alloc, ("self", "reqs"),
         "residency first: each new request's reach sizes its region"),
    Hook(f"{DECODE_REQ_TO_TOKEN}.alloc", AFTER, forward.after_req_to_token_alloc, ("self", "reqs"),
         "as ReqToTokenPool's, on a PD decode node"),
    Hook(f"{MODEL_RUNNER}.forward", AROUND, forward.around_model_forward, ("self", "forward_batch"),
         "the runtime's start and end of each forward of the target model"),
    Hook(f"{DSA_BACKEND}.init_forward_metadata", AFTER, forward.after_init_forward_metadata,
         ("self", "forward_batch"), "a prefill batch staged and its LRU-Warmup planned before layer 0"),
    Hook(f"{INDEXER}.forward_cuda", AFTER, forward.after_indexer, forward.INDEXER_PARAMS,
         "DA / DBA: the LRU step and the misses' H2D start right after the indexer"),
    Hook(f"{INDEXER_METADATA}.topk_transform", AROUND, forward.around_topk_transform,
         ("self", "logits", "topk", "ks", "cu_seqlens_q", "ke_offset"),
         "--ess-record-lookahead: the positions ranked after the top-k"),
    Hook(f"{DSA_BACKEND}.forward_decode", AROUND, forward.around_forward_decode,
         ("self", "q", "k", "v", "layer", "forward_batch"), "decode reads the GPU slots; DA's split allowed"),
    Hook(FLASH_MLA, AROUND, forward.around_flash_mla, forward.FLASH_MLA_PARAMS,
         "DA's split attention: FlashMLA's call is Attn0, ESS adds Attn1 over the misses"),
    Hook(f"{DSA_BACKEND}.forward_extend", AROUND, forward.around_forward_extend,
         ("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache", "q_rope", "k_rope", "topk_indices"),
         "prefill reads the staging buffer and its top-k warms the GPU slots up; verify reads them as decode"),
    Hook(RELEASE_KV, AROUND, forward.around_release_kv_cache, ("req", "tree_cache"),
         "a request's GPU rows let go (held while its progressive transfer still lands)"),
    Hook(f"{SCHEDULER}.run_batch", AFTER, forward.after_run_batch, ("self", "batch"),
         "a request that read a lost disk-tier row ends with that page's error"),
    Hook(f"{SCHEDULER}.get_next_batch_to_run", BEFORE, forward.before_get_next_batch, ("self",),
         "the prefix cache evicted once a lost page's readers are let go"),
    Hook(f"{INTERNAL_STATE}.get_internal_state", AFTER, forward.after_get_internal_state, ("self", "recv_req"),
         "ESS's counters and pool in /get_server_info"),
    # -- pd.py: PD disaggregation
    Hook(f"{METADATA_BUFFERS}.__init__", AFTER, pd.after_metadata_buffers_init, ("self", "size"),
         "both PD nodes append the warm-up metadata buffer"),
    Hook(f"{METADATA_BUFFERS}.get_buf_infos", AFTER, pd.after_get_buf_infos, ("self",),
         "the transfer engines send the warm-up buffer with the rest of the metadata"),
    Hook(f"{METADATA_BUFFERS}.set_buf", AFTER, pd.after_set_buf, ("self", "req"),
         "prefill node: a request's warm-up state into its metadata row"),
    Hook(f"{DECODE_TRANSFER_QUEUE}._commit_transfer_to_req", AFTER, pd.after_commit_transfer, ("self", "decode_req"),
         "decode node: the warm-up state the prefill node sent, loaded"),
    Hook(f"{DECODE_TRANSFER_QUEUE}.pop_transferred", AROUND, pd.around_pop_transferred, ("self", "rids_to_check"),
         "--ess-progressive-pd: a request joins once its phases 1 and 2 have landed"),
    Hook(f"{DECODE_TRANSFER_QUEUE}.has_pending_deferred_releases", AFTER, pd.after_has_pending_releases, ("self",),
         "a KV release ESS holds keeps the scheduler awake"),
    Hook(f"{DECODE_TRANSFER_QUEUE}.resolve_deferred_releases", AFTER, pd.after_resolve_releases, ("self",),
         "the progressive streams pumped every scheduler iteration"),
    Hook(f"{NIXL_MANAGER}.__init__", BEFORE, pd.before_nixl_manager, ("self", "args"),
         "ESS's host layers registered with NIXL as DRAM"),
    Hook(f"{MOONCAKE_ENGINE}.batch_register", AFTER, pd.after_mooncake_register, ("self", "ptrs", "lengths"),
         "a failed Mooncake registration stops the node"),
    Hook(f"{DECODE_GRAPH_RUNNER}.capture", BEFORE, graphs.before_capture, ("self",),
         "residency first: the decode graphs of both paths, general and resident"),
    Hook(f"{DECODE_GRAPH_RUNNER}.capture_one_shape", AROUND, graphs.around_capture_one_shape,
         ("self", "size", "forward", "stream_idx", "variant_label", "attention_variant"),
         "a graph's capture runs the path its label names"),
    Hook(f"{DECODE_GRAPH_RUNNER}.can_run_graph", AFTER, pd.after_can_run_graph, ("self", "forward_batch"),
         "a batch holding a request still landing runs eagerly"),
    Hook(DECODE_GRAPH_VOTE, AFTER, pd.after_decode_graph_vote, ("local_batch", "disable_cuda_graph"),
         "under DP attention such a rank votes eager"),
    Hook(f"{MOONCAKE_MANAGER}.transfer_worker", AROUND, pd.around_transfer_worker, ("self", "queue", "executor"),
         "prefill node: a progressive room's last chunk sent in parts and reported"),
    Hook(f"{MOONCAKE_MANAGER}.conclude_transfer", AROUND, pd.around_conclude_transfer,
         ("self", "bootstrap_room", "status", "targets", "failure_reason"),
         "phase 1's Success held back until the room's last part"),
    Hook(f"{MOONCAKE_MANAGER}.send_aux", AROUND, pd.around_send_aux,
         ("self", "req", "prefill_aux_index", "dst_aux_ptrs"), "the last part sends no metadata again"),
    Hook(f"{MOONCAKE_MANAGER}.build_receiver_registration_message", AFTER, pd.after_registration_message, ("self",),
         "a progressive decode rank asks for progressive sends"),
    Hook(f"{MOONCAKE_REGISTRATION}.from_zmq", AFTER, pd.after_registration_info, ("cls", "msg"),
         "the prefill node records that it asked"),
    Hook(f"{MOONCAKE_MANAGER}.handle_chunk_ready", AROUND, pd.around_handle_chunk_ready, ("self", "msg"),
         "decode node: ESS's progress reports into the inbox"),
    Hook(f"{MOONCAKE_MANAGER}._handle_abort_notification", AROUND, pd.around_abort_notification, ("self", "msg"),
         "prefill node: the pages a decode step waits for, noted"),
    Hook(f"{NIXL_MANAGER}.transfer_worker", AROUND, pd.around_nixl_transfer_worker, ("self", "queue"),
         "as Mooncake's"),
    Hook(f"{NIXL_MANAGER}.conclude_transfer", AROUND, pd.around_conclude_transfer,
         ("self", "bootstrap_room", "status", "targets", "failure_reason"), "as Mooncake's"),
    Hook(f"{NIXL_MANAGER}.send_aux", AROUND, pd.around_send_aux,
         ("self", "peer_name", "prefill_aux_index", "dst_aux_ptrs"), "as Mooncake's"),
    Hook(f"{NIXL_MANAGER}._await_handles", AROUND, pd.around_await_handles, ("self", "handles"),
         "the handle of a send ESS skipped is not waited on"),
    Hook(f"{NIXL_MANAGER}.build_receiver_registration_message", AFTER, pd.after_registration_message, ("self",),
         "as Mooncake's"),
    Hook(f"{NIXL_REGISTRATION}.from_zmq", AFTER, pd.after_registration_info, ("cls", "msg"), "as Mooncake's"),
    Hook(f"{NIXL_MANAGER}.handle_chunk_ready", AROUND, pd.around_handle_chunk_ready, ("self", "msg"),
         "as Mooncake's"),
    Hook(f"{NIXL_MANAGER}._handle_abort_notification", AROUND, pd.around_abort_notification, ("self", "msg"),
         "as Mooncake's"),
]

EXPECTED_PARAMS = table.expected_params(TABLE)  # the tests' view: target -> the parameters its hook reads


def install() -> list[str]:
    """Register every hook (SGLang applies them after all plugins ran). Returns the targets."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    if not state.installed:  # SGLang loads plugins once per process; tests may call this again
        # the CPU path first: its kernels then sit inside ESS's hooks on the same targets (the indexer's forward)
        cpu.install()
        table.register(TABLE)
        register_resolution_hook(RESOLUTION_STEP)(resolution_step)
        if not getattr(sys.excepthook, "ess", False):
            sys.excepthook = startup.launch_error_hook(sys.excepthook)
        state.installed = True
    return [row.target for row in TABLE]


def check_installed() -> list[str]:
    """Targets that SGLang failed to patch (it logs and goes on; ESS would then be silently off)."""
    return table.unpatched(TABLE)
