"""Model and hardware descriptions for the decode simulator."""

from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int = 61
    dense_layers: int = 3
    hidden: int = 7168
    heads: int = 128
    q_lora: int = 1536
    kv_lora: int = 512
    nope: int = 128
    rope: int = 64
    v: int = 128
    experts: int = 256
    experts_per_token: int = 8
    shared_experts: int = 1
    moe_inter: int = 2048
    dense_inter: int = 18432
    vocab: int = 129280
    index_heads: int = 64  # 0: no Lightning Indexer (dense MLA, DeepSeek-V3)
    index_dim: int = 128
    index_topk: int | None = 2048  # None: attend to the whole context
    latent_row_bytes: int = 656  # FP8 latent row (V3.2); V3 decodes on a bf16 cache: 576 x 2 bytes
    index_row_bytes: int = 132
    max_positions: int = 163840  # the context the model serves (config.json's max_position_embeddings; V3 and V3.2)

    # Parameter counts (weights), per layer unless said otherwise.
    @property
    def mla_params(self) -> dict[str, int]:
        H, h = self.heads, self.hidden
        return {
            "q_a": h * self.q_lora,
            "kv_a": h * (self.kv_lora + self.rope),
            "q_b": self.q_lora * H * (self.nope + self.rope),
            "w_kc": H * self.nope * self.kv_lora,
            "w_vc": H * self.kv_lora * self.v,
            "o": H * self.v * h,
        }

    @property
    def indexer_params(self) -> int:
        if not self.index_heads:
            return 0
        return self.q_lora * self.index_heads * self.index_dim + self.hidden * self.index_dim + self.hidden * self.index_heads

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_inter

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    def weight_bytes_per_gpu(self, ep: int, mtp_layers: int = 1) -> float:
        """Weights on one GPU with data-parallel attention (TP 1) and experts spread over `ep` GPUs.

        FP8 for the GEMM weights (block scales add 1/128^2, ignored); bf16 for embedding, LM head, w_kc/w_vc; fp32
        router. The MTP layer is one more MoE layer plus its eh_proj."""
        mla = self.mla_params
        attn = mla["q_a"] + mla["kv_a"] + mla["q_b"] + mla["o"] + self.indexer_params + 2 * (mla["w_kc"] + mla["w_vc"])
        dense_ffn = 3 * self.hidden * self.dense_inter
        experts_here = math.ceil(self.experts / ep)
        moe = (experts_here + self.shared_experts) * self.expert_params + 4 * self.hidden * self.experts
        per_layers = self.layers * attn + self.dense_layers * dense_ffn + self.moe_layers * moe
        mtp = mtp_layers * (attn + moe + 2 * (2 * self.hidden) * self.hidden)
        embed_head = 2 * 2 * self.vocab * self.hidden
        return float(per_layers + mtp + embed_head)


DSV32 = ModelSpec("dsv32")
DSV3 = ModelSpec("dsv3", index_heads=0, index_topk=None, latent_row_bytes=1152, index_row_bytes=0)
MODELS = {"dsv32": DSV32, "dsv3": DSV3}


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    memory_gib: float
    hbm_tbps: float
    fp8_tflops: float
    bf16_tflops: float
    nvlink_gbps: float
    net_gbps: float
    pcie_gbps: float
    source: str
    host_memory_gib_per_node: float = 2048.0
    host_pinnable_fraction: float = 0.8
    gpus_per_node: int = 8
    nvme_read_gbps_per_node: float = 48.0  # the disk tier's read bandwidth (assumed; hardware.json's _doc)
    nvme_read_kiops_per_node: float = 8000.0  # its 4 KiB random reads per second, thousands (assumed; _doc)

    def host_budget_bytes(self) -> float:
        """Pinned host memory one GPU's ESS Total Memory Pool may take."""
        return self.host_memory_gib_per_node * GIB * self.host_pinnable_fraction / self.gpus_per_node


def load_hardware() -> dict[str, Hardware]:
    data = json.loads(resources.files("ess.analysis.sim").joinpath("data/hardware.json").read_text())
    return {k: Hardware(name=k, **v) for k, v in data.items() if not k.startswith("_")}


def get_hardware(name: str) -> Hardware:
    hw = load_hardware()
    if name not in hw:
        raise ValueError(f"--hardware: unknown GPU {name!r}; choose from {sorted(hw)}")
    return hw[name]


def get_model(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"--model: unknown model {name!r}; choose from {sorted(MODELS)}")
    return MODELS[name]
