"""Stand-ins that the CPU path puts first on the import path (sglang_ess.cpu.resolution.enable_cpu_engine)."""
