"""What ESS's hooks of one process share (SGLang runs one model runner per scheduler process): `state`."""

from __future__ import annotations

import dataclasses

from sglang_ess.pd.state import PdState
from sglang_ess.runtime import EssRuntime
from sglang_ess.sizing import DeviceBytes, DiskTierSpec


@dataclasses.dataclass
class ProcessState:
    installed: bool = False
    runtime: EssRuntime | None = None  # this process's ESS runtime
    stage_tokens: int | None = None  # the prefill staging rows sizing charged; the scheduler keeps batches within
    pool: object = None  # this process's ESS KV pool (sglang_ess.pool)
    device_charged: DeviceBytes | None = None  # what sizing charged for the pool and runtime as they were built
    tier_spec: DiskTierSpec | None = None  # the disk tier sizing resolved, for the pool (--ess-disk-dir)
    lost_readers: list = dataclasses.field(default_factory=list)  # Reqs aborted for reading lost rows, not yet let go
    pd: PdState = dataclasses.field(default_factory=PdState)  # PD's: warm-up sender, held rooms, reports


state = ProcessState()
