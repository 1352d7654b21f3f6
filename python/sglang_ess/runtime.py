"""EssRuntime: one per model runner (GPU rank). It owns the ESS latent cache in SGLang's coordinates (request-pool
slots, token-pool locations; see ess.serving) and answers the DSA backend's sparse-offload call, the same call
SGLang's HiSparse answers: swap_in_selected_pages(req_pool_indices, seq_lens, top_k, layer_id) -> indices of the
selected rows in the device latent buffer, which FlashMLA's sparse decode then reads.
"""

from __future__ import annotations

import torch

from ess.serving import ServingLatentCache
from sglang_ess.args import EssArgs
from sglang_ess.recorder import TraceRecorder

def layer_modes(ess: EssArgs, num_layers: int, plan: list[str] | None) -> list[str]:
    """The overlap mode of each layer: the plan's (auto with a plan), the flag's, or DA (auto without a plan)."""
    if plan is not None:
        return list(plan[:num_layers])
    mode = "da" if ess.overlap == "auto" else ess.overlap
    return [mode] * num_layers


class EssRuntime:
    def __init__(
        self,
        ess: EssArgs,
        facts: dict,
        token_table: torch.Tensor,
        host: torch.Tensor,
        device: torch.device | str,
        start_layer: int = 0,
        model: str = "",
        backend: str = "auto",
    ):
        """token_table: SGLang's req_to_token [request slots, max context] (int32 locations); host: the ESS KV pool's
        host pool [layers, locations + 1, 656]; facts: from sglang_ess.validate.validate_model."""
        self.ess = ess
        self.start_layer = start_layer
        self.num_layers = facts["layers"]
        self.token_table = token_table
        self.cache = ServingLatentCache(
            self.num_layers, token_table.shape[0], facts["buffer"], token_table.shape[1], host, device, backend
        )
        self.modes = layer_modes(ess, self.num_layers, facts.get("plan"))
        self.recorder = TraceRecorder(ess.record_trace, self.num_layers, model) if ess.record_trace else None
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=device)  # read by SGLang's graph runners
        self._own_rows: list[torch.Tensor | None] = [None] * self.num_layers

    # -- the step's own rows (the ESS KV pool wrote them to the host pool already) --------------------------------
    def keep_own_rows(self, layer_id: int, rows: torch.Tensor) -> None:
        """This decode/verify step's new rows [B(*S), 656], which swap_in_selected_pages puts into their GPU slots."""
        self._own_rows[layer_id - self.start_layer] = rows

    # -- the backend's call --------------------------------------------------------------------------------------
    def swap_in_selected_pages(
        self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, top_k: torch.Tensor, layer_id: int
    ) -> torch.Tensor:
        """top_k: positions [B, K] (decode), or [B, S, K] with seq_lens [B * S] (MTP target-verify: S query rows per
        request, whose union is one LRU step with S own tokens). Returns int32 slots of the same shape, -1 kept."""
        layer = layer_id - self.start_layer
        if layer == 0:
            self.cache.next_step()
        B = req_pool_indices.shape[0]
        if top_k.dim() == 3:
            S = top_k.shape[1]
            sets = top_k.reshape(B, -1)
            own = seq_lens.reshape(B, S).long() - 1
        else:
            sets, own = top_k, seq_lens.long() - 1
        own_rows = self._own_rows[layer]
        if own_rows is not None:
            own_rows = own_rows.reshape(B, -1, own_rows.shape[-1]) if top_k.dim() == 3 else own_rows
        r = self.cache.translate(layer, req_pool_indices, self.token_table, sets, own, own_rows)
        self._own_rows[layer] = None
        if self.recorder is not None and top_k.dim() == 2:  # verify steps hold several positions: not a trace step
            self.recorder.record(layer, req_pool_indices.cpu().numpy(), sets.cpu().numpy(), own.cpu().numpy())
        return r.attn_slot.reshape(top_k.shape).to(torch.int32)

    def latent_buffer(self, layer_id: int) -> torch.Tensor:
        """The device latent rows that swap_in_selected_pages' indices address: [slots, 1, 656] uint8."""
        return self.cache.gpu[layer_id - self.start_layer].unsqueeze(1)

    def wait_for_pending_backup(self) -> None:
        """Part of the backend-facing contract; ESS's host writes are ordered on the compute stream."""

    # -- request lifecycle (scheduler side) --------------------------------------------------------------------------
    def start_request(self, req_slot: int, context_len: int, warm_sets: torch.Tensor | None = None) -> None:
        """A request enters decode. warm_sets [layers, W, K]: the last W prefill top-k sets (LRU-Warmup), or None."""
        if warm_sets is not None and self.ess.warmup_windows > 0:
            W = min(self.ess.warmup_windows, warm_sets.shape[1])
            req = torch.tensor([req_slot], device=self.token_table.device)
            for layer in range(self.num_layers):
                self.cache.warmup(layer, req, self.token_table, warm_sets[layer, -W:].unsqueeze(0).to(self.token_table.device))
        if self.recorder is not None:
            self.recorder.start(req_slot, context_len)

    def release(self, req_slot: int, rid: str = "") -> str | None:
        """A request finished or was aborted: forget its GPU rows (its tokens go back through SGLang's allocator).
        Returns the trace file written for it, if recording."""
        self.cache.release(req_slot)
        if self.recorder is not None:
            return self.recorder.finish(req_slot, rid)
        return None

    def stats(self) -> dict:
        return {"device_bytes": self.cache.device_bytes(), "host_bytes": self.cache.host.numel(), "modes": self.modes}
