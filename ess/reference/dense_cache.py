"""The baseline latent cache: every 656-byte row of every live token on the device, as stock SGLang keeps it.

A latent cache serves the reference model through four calls; `ess.reference.ess_cache.EssLatentCache` implements the same ones:
    prefill(layer, b, rows, warm_sets)   store request b's prefill rows [L, 656] (warm_sets: last W top-k sets)
    start_decode()                       called once between prefill and decode step 0
    decode(layer, step, topk, pos, own_rows) -> DecodeRows   store the step's own rows, return the selected rows
    device_bytes()                       latent-cache bytes held on the device
"""

from __future__ import annotations

import dataclasses

import torch

from ess.core import layout


@dataclasses.dataclass
class DecodeRows:
    rows: torch.Tensor  # [B, K, 656] uint8, the latent rows selected by top-k (garbage where not valid)
    valid: torch.Tensor  # [B, K] bool
    hit: torch.Tensor | None = None  # [B, K] bool: resident before this step (ESS only; None = all resident)


class DenseLatentCache:
    def __init__(self, num_layers: int, batch: int, max_len: int, device: torch.device | str):
        self.rows = torch.zeros(num_layers, batch, max_len, layout.LATENT_ROW_BYTES, dtype=torch.uint8, device=device)

    def prefill(self, layer: int, b: int, rows: torch.Tensor, warm_sets: torch.Tensor | None) -> None:
        self.rows[layer, b, : rows.shape[0]] = rows

    def start_decode(self) -> None:
        pass

    def decode(self, layer: int, step: int, topk: torch.Tensor, pos: torch.Tensor, own_rows: torch.Tensor) -> DecodeRows:
        batch = torch.arange(topk.shape[0], device=topk.device)
        self.rows[layer, batch, pos] = own_rows
        valid = topk >= 0
        rows = self.rows[layer][batch.unsqueeze(1), topk.long().clamp(min=0)]
        return DecodeRows(rows=rows, valid=valid)

    def device_bytes(self) -> int:
        return self.rows.numel()
