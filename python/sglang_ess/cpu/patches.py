"""The CPU path's patch points: one table of sglang_ess.hooks.table rows (SGLang target, hook type, hook, the
parameters it reads, why), registered through SGLang's own HookRegistry as the plugin's hooks are (sglang_ess.hooks).
Every hook that takes tensors hands CUDA tensors to SGLang's own code unchanged; the others act only for a DSA model
on the CPU. The tests resolve every target in the installed sglang and check the parameters each row names, so an
upstream rename fails a test."""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Callable

import torch

from sglang.srt.plugins.hook_registry import HookType
from sglang_ess.cpu import indexer_forward, kernels
from sglang_ess.cpu.resolution import capability_answered, replaced
from sglang_ess.hooks.table import Hook, expected_params


def _on_cpu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu"


def on_cpu(param: str, fn: Callable) -> Callable:
    """An AROUND hook: fn(*args, **kwargs) where the tensor argument `param` (named as in fn, whose parameters are the
    target's) is a CPU tensor, else SGLang's original."""
    signature = inspect.signature(fn)

    def hook(original, *args, **kwargs):
        tensor = signature.bind(*args, **kwargs).arguments[param]
        return fn(*args, **kwargs) if _on_cpu(tensor) else original(*args, **kwargs)

    hook.__name__ = hook.__qualname__ = f"cpu_{fn.__name__}"
    return hook


def _is_dsa(model_config) -> bool:
    from sglang.srt.configs.model_config import is_deepseek_dsa

    return is_deepseek_dsa(model_config.hf_config)


class _NotCpuPlatform:
    """SGLang's platform object, except that is_cpu() answers False (see around_configure)."""

    def __init__(self, platform):
        self._platform = platform

    def is_cpu(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._platform, name)


KV_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator"


def around_configure(original, kvc, *a, **kw):
    """KVCacheConfigurator.configure refuses an FP8 KV cache on the CPU unless the model is MHA on an AMX CPU: it
    guards its CPU MHA quantiser. A DSA model's FP8 latent rows are written by the DSA pool's own quantiser (on the
    CPU path, kernels.quantize_k_cache_separate), so for a DSA model the guard is skipped; nothing else of configure
    changes (its only other is_cpu() test picks the MHA quantiser)."""
    if str(kvc.device) != "cpu" or not _is_dsa(kvc.model_config):
        return original(kvc, *a, **kw)
    from sglang.srt.platforms import current_platform

    with replaced(importlib.import_module(KV_CONFIGURATOR), "current_platform", _NotCpuPlatform(current_platform)):
        return original(kvc, *a, **kw)


def around_dsa_backend_init(original, backend, model_runner, *a, **kw):
    """DeepseekSparseAttnBackend.__init__ reads the CUDA device capability to pick its kernels, which raises without
    a driver: on the CPU it is answered for the stand-in GPU (Hopper, whose flashmla_kv kernels the CPU path
    replaces)."""
    if str(model_runner.device) != "cpu":
        return original(backend, model_runner, *a, **kw)
    with capability_answered():
        return original(backend, model_runner, *a, **kw)


def indexer_forward_native(self, *args, **kwargs):
    """SGLang's op dispatch picks forward_native on a CPU; the indexer's forward is forward_cuda (below)."""
    return self.forward_cuda(*args, **kwargs)


def around_rotary_native(original, rope, positions, query, key, *a, **kw):
    """DeepseekScalingRotaryEmbedding.forward_native broadcasts its cos/sin as [1, tokens, 1, dim], which turns a 2-D
    key [tokens, dim] (the indexer's) into [tokens, tokens, dim] and adds a leading 1 to 3-D inputs: it is called
    with [tokens, heads, dim] views and its results are given the inputs' shapes back."""
    q3 = query.reshape(query.shape[0], -1, rope.head_size)
    k3 = key.reshape(key.shape[0], -1, rope.head_size)
    q, k = original(rope, positions, q3, k3, *a, **kw)
    return q.reshape(query.shape), k.reshape(key.shape)


def around_set_embed_and_head(original, model, embed, head, *a, **kw):
    """DeepseekV2ForCausalLM.set_embed_and_head (the MTP draft shares the target's embedding and head) calls
    torch.cuda.synchronize, which raises without a driver; a CPU has nothing to wait for."""
    if embed.device.type != "cpu":
        return original(model, embed, head, *a, **kw)
    with replaced(torch.cuda, "synchronize", lambda device=None: None):
        return original(model, embed, head, *a, **kw)


def get_last_loc(req_to_token, req_pool_indices_tensor, prefix_lens_tensor):
    """SGLang's own torch version (get_last_loc_torch), which it picks only for the torch_native and ascend backends."""
    from sglang.srt.mem_cache.allocation import get_last_loc_torch

    return get_last_loc_torch(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)


def gpu_branch(module_name: str, **flags) -> Callable:
    """An AROUND hook for a function whose CPU branch calls sgl_kernel's CPU build: on CPU tensors it runs with the
    module's platform flags set as given (`_is_cpu=False` and the branch's own), which takes the branch that launches
    SGLang's Triton kernel; Triton's interpreter (resolution.TRITON_INTERPRET_ENV) runs it on the CPU tensors."""

    def hook(original, *args, **kwargs):
        if not any(_on_cpu(a) for a in (*args, *kwargs.values())):
            return original(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            module = importlib.import_module(module_name)
            for name, value in {"_is_cpu": False, **flags}.items():
                stack.enter_context(replaced(module, name, value))
            return original(*args, **kwargs)

    hook.__name__ = hook.__qualname__ = f"triton_branch_of_{module_name.rsplit('.', 1)[1]}"
    return hook


DSA_BACKEND = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"
PAD = "sglang.kernels.ops.attention.pad"
SPEC_TREE = "sglang.kernels.ops.speculative.spec_tree"
EAGLE_OPS = "sglang.kernels.ops.speculative.eagle"
ALLOCATION = "sglang.srt.mem_cache.allocation"
CACHE_LOCS = "sglang.kernels.ops.speculative.cache_locs"
DEEPSEEK = "sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM"
INDEXER = "sglang.srt.layers.attention.dsa.dsa_indexer"
INDEX_K_CACHE = "sglang.kernels.ops.kvcache.dsa_index_k_cache"
TRANSFORM_INDEX = "sglang.kernels.ops.attention.dsa.transform_index"
QUANT_K_CACHE = "sglang.kernels.ops.quantization.dsa_quant_k_cache"
ROTARY = "sglang.srt.layers.rotary_embedding.rope_variant.DeepseekScalingRotaryEmbedding"
MOONCAKE = "sglang.srt.disaggregation.mooncake.conn"
NIXL = "sglang.srt.disaggregation.nixl.conn"
PD_PREFILL = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin"


def around_early_prefix_send(original, self, req, *args, **kwargs):
    """A PD prefill node on the CPU: no early send of a cached prefix (under overlap scheduling it records a CUDA
    event); the request's final send covers the same pages, as SGLang's own code lets it where the early send does
    not apply."""
    return None


def after_mooncake_sender_init(result, self, *args, **kwargs):
    """A PD prefill node on the CPU: the sender takes its page indices as it does on every other engine (SGLang's
    host-tensor path copies them through pinned memory and waits on a CUDA event, which a CPU cannot)."""
    self.supports_host_tensor_indices = False


# The memory kind a NIXL agent is asked for on the CPU, by the kind SGLang names: all of SGLang's buffers are host
# memory there. (A test whose loopback agent stands for a GPU machine's NIXL sets this empty: kinds pass unchanged.)
HOST_MEMORY_KINDS = {"VRAM": "DRAM"}


class _HostMemoryAgent:
    """A NIXL agent asked for host memory kinds (HOST_MEMORY_KINDS) wherever SGLang names a device kind. Its
    attributes read and write through to the agent (the manager keeps the wrapped agent in its place)."""

    def __init__(self, agent):
        object.__setattr__(self, "_agent", agent)

    def __getattr__(self, name):
        attr = getattr(self._agent, name)
        if not callable(attr):
            return attr

        def host(value):
            return HOST_MEMORY_KINDS.get(value, value) if isinstance(value, str) else value

        def call(*args, **kwargs):
            return attr(*map(host, args), **{k: host(v) for k, v in kwargs.items()})

        return call

    def __setattr__(self, name, value):
        setattr(self._agent, name, value)


def around_nixl_register_buffers(original, self, *args, **kwargs):
    """A PD node over NIXL on the CPU: SGLang registers and addresses its KV and state buffers as VRAM, which UCX
    refuses for host addresses ("VRAM memory is detected as host by UCX"); the agent is asked for DRAM instead, here
    and in every later call (the manager keeps the wrapped agent; a registration again keeps it wrapped once)."""
    if not isinstance(self.agent, _HostMemoryAgent):
        self.agent = _HostMemoryAgent(self.agent)
    return original(self, *args, **kwargs)


PATCHES = [
    Hook(f"{KV_CONFIGURATOR}.KVCacheConfigurator.configure", HookType.AROUND, around_configure,
         ("self", "pre_model_load_memory"),
         "refuses an FP8 KV cache on the CPU for every MLA model ('CPU FP8 KV cache is only supported for MHA')"),
    Hook(f"{DSA_BACKEND}.__init__", HookType.AROUND, around_dsa_backend_init, ("self", "model_runner"),
         "asks torch.cuda for the device capability (no driver: RuntimeError)"),
    Hook(f"{INDEXER}.Indexer.forward_native", HookType.REPLACE, indexer_forward_native, ("self",),
         "raises NotImplementedError ('Indexer has no native (pure-torch) path')"),
    Hook(f"{INDEXER}.Indexer.forward_cuda", HookType.AROUND, on_cpu("x", indexer_forward.forward),
         ("self", "x", "q_lora", "positions", "forward_batch", "layer_id", "return_indices", "use_cuda_graph"),
         "refuses devices other than CUDA, HIP and XPU, and reaches DeepGEMM's logits and CUDA-only asserts"),
    Hook(f"{INDEXER}.rotate_activation", HookType.AROUND, on_cpu("x", kernels.rotate_activation), ("x",),
         "the indexer's Hadamard transform is a CUDA kernel"),
    Hook(f"{INDEX_K_CACHE}.SetKAndS.triton", HookType.AROUND, on_cpu("buf", kernels.set_k_and_s),
         ("cls", "pool", "buf", "loc", "index_k", "index_k_scale"), "the index-K store is a Triton kernel"),
    Hook(f"{INDEX_K_CACHE}.GetKAndS.triton", HookType.AROUND, on_cpu("buf", kernels.get_k_and_s),
         ("cls", "pool", "buf", "page_indices", "seq_len_tensor", "seq_len_sum", "max_seq_len"),
         "the index-K gather of a prefill is a Triton kernel"),
    Hook(f"{QUANT_K_CACHE}.quantize_k_cache_separate", HookType.AROUND,
         on_cpu("k_nope", kernels.quantize_k_cache_separate), ("k_nope", "k_rope", "tile_size"),
         "the FP8 quantiser of the 656-byte latent rows is a Triton kernel"),
    Hook(f"{TRANSFORM_INDEX}.transform_index_page_table_decode", HookType.AROUND,
         on_cpu("topk_indices", kernels.transform_index_page_table_decode),
         ("page_table", "topk_indices", "result", "page_size"), "the decode top-k -> locations map is a Triton kernel"),
    Hook(f"{TRANSFORM_INDEX}.transform_index_page_table_prefill", HookType.AROUND,
         on_cpu("topk_indices", kernels.transform_index_page_table_prefill),
         ("page_table", "topk_indices", "extend_lens_cpu", "page_size", "output_num_tokens", "page_table_is_expanded",
          "cu_seqlens_q"), "the prefill top-k -> locations map is a Triton kernel"),
    Hook(f"{PAD}.seqlens_expand_triton", HookType.AROUND, on_cpu("seq_lens", kernels.seqlens_expand),
         ("extend_seq_lens", "seq_lens", "total_len", "max_q_len"), "MTP verify metadata: asserts CUDA tensors"),
    Hook(f"{ROTARY}.forward_native", HookType.AROUND, around_rotary_native, ("self", "positions", "query", "key"),
         "broadcasts a 2-D key into [tokens, tokens, dim]"),
    Hook(f"{DEEPSEEK}.set_embed_and_head", HookType.AROUND, around_set_embed_and_head, ("self", "embed", "head"),
         "MTP: torch.cuda.synchronize (no driver: RuntimeError)"),
    Hook(f"{ALLOCATION}.get_last_loc", HookType.AROUND, on_cpu("req_to_token", get_last_loc),
         ("req_to_token", "req_pool_indices_tensor", "prefix_lens_tensor"),
         "MTP decode: a Triton kernel for every attention backend but torch_native and ascend"),
    Hook(f"{ALLOCATION}.assign_req_to_token_pool_func", HookType.AROUND,
         on_cpu("req_to_token", kernels.assign_req_to_token_pool),
         ("req_pool_indices", "req_to_token", "start_offset", "end_offset", "out_cache_loc", "batch_size"),
         "MTP decode: sgl_kernel's CPU build (assign_req_to_token_pool_cpu)"),
    Hook(f"{CACHE_LOCS}.assign_draft_cache_locs_contiguous_func", HookType.AROUND,
         on_cpu("req_to_token", kernels.assign_draft_cache_locs_contiguous),
         ("req_pool_indices", "req_to_token", "seq_lens", "out_cache_loc", "topk", "num_cols", "positions", "mrope"),
         "MTP draft: sgl_kernel's CPU build (assign_draft_cache_locs_contiguous_cpu)"),
    Hook(f"{CACHE_LOCS}.assign_extend_cache_locs_func", HookType.AROUND,
         on_cpu("req_to_token", kernels.assign_extend_cache_locs),
         ("req_pool_indices", "req_to_token", "start_offset", "end_offset", "batch_size", "draft_token_num", "device"),
         "MTP verify: sgl_kernel's CPU build (assign_extend_cache_locs_cpu)"),
    Hook(f"{SPEC_TREE}.build_tree_kernel_efficient_func", HookType.AROUND, gpu_branch(SPEC_TREE, _is_xpu=True),
         ("parent_list", "top_scores_index", "seq_lens"),
         "MTP draft: sgl_kernel's CPU build (build_tree_kernel_efficient_cpu); XPU's branch is a Triton kernel"),
    Hook(f"{SPEC_TREE}.verify_tree_greedy_func", HookType.AROUND, gpu_branch(SPEC_TREE, _is_xpu=True),
         ("predicts", "accept_index", "accept_token_num"),
         "MTP verify: sgl_kernel's CPU build (verify_tree_greedy_cpu); XPU's branch is a Triton kernel"),
    Hook(f"{EAGLE_OPS}.fill_bonus_tokens_func", HookType.AROUND, gpu_branch(EAGLE_OPS),
         ("accept_tokens", "accept_lens", "bonus_tokens"),
         "MTP verify: sgl_kernel's CPU build (fill_bonus_tokens_cpu)"),
    Hook(f"{EAGLE_OPS}.fill_accept_out_cache_loc_func", HookType.AROUND, gpu_branch(EAGLE_OPS),
         ("accept_index", "out_cache_loc", "accept_out_cache_loc"),
         "MTP verify: sgl_kernel's CPU build (fill_accept_out_cache_loc_cpu)"),
    Hook(f"{MOONCAKE}.MooncakeKVSender.__init__", HookType.AFTER, after_mooncake_sender_init, ("self",),
         "PD prefill over Mooncake: the page indices go through pinned memory and a CUDA event (no driver: RuntimeError)"),
    Hook(f"{NIXL}.NixlKVManager.register_buffer_to_engine", HookType.AROUND, around_nixl_register_buffers, ("self",),
         "PD over NIXL: KV and state buffers registered as VRAM (host memory on the CPU: UCX fails, NIXL_ERR_BACKEND)"),
    Hook(f"{PD_PREFILL}.maybe_send_cached_prefix_chunk", HookType.AROUND, around_early_prefix_send, ("self", "req"),
         "PD prefill with a radix-cache hit: the early send records a CUDA event (no driver: RuntimeError)"),
]

EXPECTED_PARAMS = expected_params(PATCHES)  # the tests' view: target -> the parameters its hook reads
