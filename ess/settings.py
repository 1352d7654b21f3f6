"""ESS's defaults and choices, in one place (no torch import: the CLI's parser reads them)."""

KERNELS = ("auto", "fused", "torch")  # the LRU step: ess.lru_kernel's fused kernel, or ess.policy's torch ops
