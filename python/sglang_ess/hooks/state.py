"""What ESS's hooks of one process share (SGLang runs one model runner per scheduler process)."""

from __future__ import annotations

import dataclasses

import torch

from sglang_ess.pd_warmup import WarmupSender
from sglang_ess.runtime import EssRuntime
from sglang_ess.sizing import DiskTierSpec


@dataclasses.dataclass
class ProcessState:
    installed: bool = False
    runtime: EssRuntime | None = None  # this process's ESS runtime
    sender: WarmupSender | None = None  # a PD prefill node's, instead of a runtime
    sender_pool: object = None  # the target model's KV pool on that node (its MTP draft worker has another)
    wire: tuple[int, int] | None = None  # (layers, top-k) of the PD warm-up rows, once this process has ESS
    warmup_rows: torch.Tensor | None = None  # the PD metadata buffers' warm-up rows [slots, ints] (sglang_ess.pd_warmup)
    stage_tokens: int | None = None  # the prefill staging rows sizing charged; the scheduler keeps batches within
    tier_spec: DiskTierSpec | None = None  # the disk tier sizing resolved, for the pool (--ess-disk-dir)
    lost_readers: list = dataclasses.field(default_factory=list)  # Reqs aborted for reading lost rows, not yet let go


state = ProcessState()
