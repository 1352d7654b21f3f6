"""Launch settings of the CPU path, set inside SGLang's own argument resolution when `--device cpu` serves a DSA model.

`handle_cpu_backends` (SGLang's CPU step) is where the path switches on, in the launcher, before any scheduler process
starts: SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`, which its CPU code paths test), sgl_kernel's stand-in where the
installed build cannot load (sglang_ess.cpu.standin), the DSA attention backend with the torch top-k, and a KV budget
sized for a CPU host. The scheduler processes inherit the environment and the import path (multiprocessing's spawn
copies both before it imports anything of SGLang), and load the plugin as the launcher does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

import torch

logger = logging.getLogger("sglang_ess")

# The GPU that the CPU path stands in for: Hopper (SM90), whose DSA kernels (FlashMLA's sparse FP8 decode,
# `flashmla_kv`) are the ones ESS serves with and the CPU path replaces.
STAND_IN_CAPABILITY = (9, 0)
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
FUSE_TOPK_ENV = "SGLANG_DSA_FUSE_TOPK"  # SGLang's fused top-k (token locations out of a CUDA kernel); torch's is unfused
# Triton's CPU interpreter for every Triton kernel of the process (read when a kernel is defined, so it must be set
# before SGLang is imported: the scheduler processes inherit it): SGLang's Triton kernels that the CPU path runs as
# they are (MTP's bookkeeping) then compute on CPU tensors.
TRITON_INTERPRET_ENV = "TRITON_INTERPRET"
# torch.compile off: on a CPU it compiles C++ for SGLang's few compiled helpers (the indexer's head gates) at their first
# call, tens of seconds on a small machine for what eager torch computes in microseconds
COMPILE_ENV = "TORCH_COMPILE_DISABLE"
STANDIN_DIR = os.path.join(os.path.dirname(__file__), "standin")
# A CPU host's defaults where the flags are not given. SGLang sizes a CPU's KV cache from the free RAM (about 15 GB on
# a 24 GB machine, allocated up front) and its request table from the model's context (163,840 positions for
# DeepSeek-V3.2: 1.3 GB of table for SGLang's 2,048 default requests); a CPU serves a few requests of a few thousand
# tokens at a time.
CPU_DEFAULTS = {"max_total_tokens": 65536, "max_running_requests": 64}


def is_cpu_dsa(server_args: Any) -> bool:
    """This launch serves a DeepSeek Sparse Attention model with --device cpu."""
    from sglang.srt.arg_groups.overrides import model_config_of, resolving_view
    from sglang.srt.configs.model_config import is_deepseek_dsa

    if resolving_view(server_args).device != "cpu":
        return False
    return is_deepseek_dsa(model_config_of(server_args).hf_config)


def sgl_kernel_loads() -> bool:
    """The installed sgl_kernel imports here (its CPU build, or its CUDA build on a machine with a driver)."""
    if "sgl_kernel" in sys.modules:
        return True
    try:
        import sgl_kernel  # noqa: F401
    except ImportError:
        return False
    return True


def enable_cpu_engine() -> None:
    """The process environment of a CPU launch; the scheduler processes spawned afterwards inherit it."""
    os.environ[CPU_ENGINE_ENV] = "1"
    os.environ[FUSE_TOPK_ENV] = "0"
    os.environ[TRITON_INTERPRET_ENV] = "1"
    os.environ.setdefault(COMPILE_ENV, "1")
    if not sgl_kernel_loads() and STANDIN_DIR not in sys.path:
        sys.path.insert(0, STANDIN_DIR)
        logger.info("ESS CPU path: sgl_kernel's stand-in in place of the installed build, which cannot load here")


def cpu_backends(server_args: Any, previous) -> None:
    """Around SGLang's `handle_cpu_backends`: for a DSA model on the CPU, the DSA attention backend (SGLang's CPU
    default, intel_amx, never reaches DSA's sparse path), the torch top-k (the target's and an MTP draft's), and the CPU_DEFAULTS sizes of the token
    pool and the request table (the context length then at most the token pool, so that one request fits)."""
    if is_cpu_dsa(server_args):
        from sglang.srt.arg_groups.overrides import declare_resolution, model_config_of, resolving_view

        cfg = resolving_view(server_args)
        # sleep_on_idle: SGLang's scheduler polls for requests at full speed while idle, a core of a CPU host that
        # the servers' own compute needs
        declared = {"dsa_topk_backend": "torch", "speculative_dsa_topk_backend": "torch", "sleep_on_idle": True}
        if cfg.attention_backend is None:
            declared["attention_backend"] = "dsa"
        declared |= {flag: value for flag, value in CPU_DEFAULTS.items() if getattr(cfg, flag) is None}
        if cfg.context_length is None:
            model_max = int(model_config_of(server_args).hf_config.max_position_embeddings)
            declared["context_length"] = min(model_max, cfg.max_total_tokens or CPU_DEFAULTS["max_total_tokens"])
        declare_resolution(server_args, "sglang_ess.cpu", **declared)
        enable_cpu_engine()
        logger.info("ESS CPU path for a DSA model: %s", declared)
    previous(server_args)


@contextlib.contextmanager
def replaced(owner: Any, name: str, value: Any):
    """owner.name is value inside the block (an attribute of a module: torch.cuda's, or one of SGLang's)."""
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, previous)


def capability_answered():
    """SGLang's DSA resolution asks torch.cuda for the device capability (arg_groups/model_hook.py, and the DSA
    backend and KV dtype defaults in overrides.py), which raises without a driver: answer for the stand-in GPU."""
    return replaced(torch.cuda, "get_device_capability", lambda device=None: STAND_IN_CAPABILITY)


def model_specific_adjustments(server_args: Any, previous) -> None:
    """Around SGLang's `handle_model_specific_adjustments`."""
    if not is_cpu_dsa(server_args):
        return previous(server_args)
    with capability_answered():
        previous(server_args)


# SGLang's resolution steps the CPU path wraps (sglang.srt.arg_groups.resolution_hooks), with their wrappers.
RESOLUTION_STEPS = {
    "handle_cpu_backends": cpu_backends,
    "handle_model_specific_adjustments": model_specific_adjustments,
}
