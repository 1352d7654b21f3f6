"""Decode CUDA graphs per residency state (docs/plugin.md, "Two paths"): with residency first the target model's
decode graph runner captures, for each batch size, a graph of the general path and one of the resident path, as
SGLang captures its own attention variants (ShapeKey.attention_variant), and replays the one the forward's path names.
The path is chosen before the replay from what the host knows (EssRuntime.start_forward: no offloaded request live),
so no device value is read."""

from __future__ import annotations

import logging

from sglang_ess.hooks.shared import state

logger = logging.getLogger("sglang_ess")

GENERAL, RESIDENT = "ess_general", "ess_resident"


class ResidencyGraphVariants:
    """SGLang's AttentionGraphVariants protocol: the labels to capture, and the one a batch replays."""

    # the general graph first: its capture peak subsumes the resident graph's share of the graph memory pool
    capture_labels = (GENERAL, RESIDENT)

    def __init__(self, runtime):
        self.runtime = runtime

    def select(self, forward_batch) -> str:
        return RESIDENT if self.runtime.resident_forward else GENERAL


def _runtime(runner):
    rt = getattr(runner.model_runner, "ess_runtime", None)  # the target model's runner only (not MTP's draft)
    return rt if rt is not None and rt is state.runtime and rt.cache.regions is not None else None


def before_capture(runner, *a, **kw):
    """Before the decode graphs are captured: the target model's runner captures both paths (residency first only)."""
    rt = _runtime(runner)
    if rt is None:
        return
    if runner.attention_graph_variants is not None:  # SGLang's own variants (ROCm's DSA, DeepSeek-V4): one ESS path
        logger.warning("ESS: SGLang captures its own attention variants (%s); the decode graphs take the general path "
                       "only", type(runner.attention_graph_variants).__name__)
        return
    runner.attention_graph_variants = ResidencyGraphVariants(rt)
    logger.info("ESS: decode CUDA graphs of both paths (%s, %s) for batch sizes %s", GENERAL, RESIDENT,
                list(runner.capture_bs))


def around_capture_one_shape(original, runner, size, forward, stream_idx=None, variant_label=None,
                             attention_variant=None, *a, **kw):
    """One graph's capture: the runtime takes the path its label names while SGLang runs and records the forward."""
    rt = _runtime(runner)
    if rt is None or attention_variant not in (GENERAL, RESIDENT):
        return original(runner, size, forward, stream_idx, variant_label, attention_variant, *a, **kw)
    previous, rt.resident_forward = rt.resident_forward, attention_variant == RESIDENT
    try:
        out = original(runner, size, forward, stream_idx, variant_label, attention_variant, *a, **kw)
    finally:
        rt.resident_forward = previous
    rt.graphs_captured[attention_variant] = rt.graphs_captured.get(attention_variant, 0) + 1
    return out
