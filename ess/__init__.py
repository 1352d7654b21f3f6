"""ESS: the latent cache of DeepSeek-V3.2 decode in pinned host memory, a per-request LRU working set on the GPU."""

import os

# CPU runs compare two decodes token for token (`ess demo`): MKL's conditional numerical reproducibility keeps its
# BLAS results the same from run to run (without it, 2 of 22 baseline runs on the project's CPU VM greedy-decoded a
# different token, 0 of 26 with it; docs/design.md, "The reference model and ess demo"). Read by MKL at its first
# call, so set before anything imports torch; a value the environment gives wins.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
