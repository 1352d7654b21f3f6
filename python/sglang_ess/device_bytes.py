"""What ESS holds in device memory, measured from its tensors: every tensor the ESS KV pool and the runtime reach
through their attributes (into lists, tuples, dicts and ESS's own objects), each storage once, less the attributes
named in NOT_CHARGED. The state readout reports it beside what sizing charged (sglang_ess.sizing.ess_device_bytes):
a buffer added under any other name is measured, and the test of the two (test/plugin/test_device_bytes.py) fails
until sizing charges it."""

from __future__ import annotations

import torch

# Attributes of the pool, the runtime and their parts that hold no ESS device memory sized at start-up, and why.
NOT_CHARGED = {
    "ess_host": "the host pool (pinned host memory)",
    "host": "the host pool",
    "kv_buffer": "views of the host pool (SGLang's name for the latent buffer)",
    "ess_tier": "a disk tier: host frames and their page tables",
    "tier": "a disk tier",
    "data_ptrs": "SGLang's table of its buffers' addresses, a stock pool's too",
    "index_key_cache": "SGLang's index-K, measured by its buffers (index_k_with_scale_buffer)",
    "token_table": "SGLang's request table (req_to_token), a stock server's too",
    "req_pool": "SGLang's request pool",
    "ess_runtime": "measured on its own",
    "_constants": "constants per batch shape, made at CUDA-graph capture (SGLang's graph memory)",
    "_first": "constants per batch size, made at CUDA-graph capture",
    "_held": "the tensors a captured copy reads, held for the capture",
    "pending": "one forward's step results (its activations)",
    "_split": "one forward's step results",
    "_own_rows": "views of the decode scratch",
    "next_ranked": "one forward's indexer output",
    "_batch": "the decode call's request slots and positions (SGLang's forward batch)",
    "_own_region": "one forward's region rows of its new rows (its activations; under CUDA graphs, graph memory)",
    "_warm": "one prefill forward's warm-up plan",
    "_loads": "PD warm-up states waiting for the next forward (host-sized, freed there)",
    "_stage_locs": "one prefill forward's staging plan",
    "_stage_pos": "one prefill forward's staging plan",
    "_stage_req": "one prefill forward's staging plan",
    "_stage_cached": "one prefill forward's staging plan",
}
OWN_MODULES = ("ess.", "sglang_ess.")  # objects walked into; SGLang's are not (their tensors are stock's too)


def measured(pool, runtime) -> int:
    """Device bytes of the ESS KV pool (index-K included) and its runtime (None: the pool alone)."""
    index_k = sum(t.numel() * t.element_size() for t in pool.index_k_with_scale_buffer)
    storages: dict[int, int] = {}
    seen: set[int] = set()
    _walk(pool, storages, seen)
    if runtime is not None:
        _walk(runtime, storages, seen)
    return index_k + sum(storages.values())


def _walk(value, storages: dict[int, int], seen: set[int]) -> None:
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            _walk(item, storages, seen)
    elif isinstance(value, dict):
        for item in value.values():
            _walk(item, storages, seen)
    elif _own(type(value)) and hasattr(value, "__dict__"):
        for name, item in vars(value).items():
            if name not in NOT_CHARGED:
                _walk(item, storages, seen)


def _own(cls: type) -> bool:
    """An object of ESS's (or of a class made from one, such as the pool class of a launch)."""
    return not issubclass(cls, type) and any(c.__module__.startswith(OWN_MODULES) for c in cls.__mro__)
