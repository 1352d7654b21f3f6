"""Model and hardware descriptions for the decode simulator; the models derive from ess.core.dsv32's record."""

from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources

from ess.core import dsv32, layout

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    dense_layers: int
    hidden: int
    heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int
    experts: int
    experts_per_token: int
    shared_experts: int
    moe_inter: int
    dense_inter: int
    vocab: int
    index_heads: int  # 0: no Lightning Indexer (dense MLA, DeepSeek-V3)
    index_dim: int
    index_topk: int | None  # None: attend to the whole context
    latent_row_bytes: int
    index_row_bytes: int
    max_positions: int  # the context the model serves (config.json's max_position_embeddings; V3 and V3.2)

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


# config.json's names (ess.core.dsv32) of the fields above
_CONFIG_NAMES = {
    "num_hidden_layers": "layers", "first_k_dense_replace": "dense_layers", "hidden_size": "hidden",
    "num_attention_heads": "heads", "q_lora_rank": "q_lora", "kv_lora_rank": "kv_lora", "qk_nope_head_dim": "nope",
    "qk_rope_head_dim": "rope", "v_head_dim": "v", "n_routed_experts": "experts", "num_experts_per_tok": "experts_per_token",
    "n_shared_experts": "shared_experts", "moe_intermediate_size": "moe_inter", "intermediate_size": "dense_inter",
    "vocab_size": "vocab", "index_n_heads": "index_heads", "index_head_dim": "index_dim", "index_topk": "index_topk",
    "max_position_embeddings": "max_positions",
}
DSV32 = ModelSpec("dsv32", **{field: dsv32.CONFIG[key] for key, field in _CONFIG_NAMES.items()},
                  latent_row_bytes=layout.LATENT_ROW_BYTES, index_row_bytes=layout.INDEX_ROW_BYTES)
# DeepSeek-V3: V3.2 without the indexer, decoding on a bf16 latent cache (NoPE and RoPE values, 2 bytes each)
DSV3 = dataclasses.replace(DSV32, name="dsv3", index_heads=0, index_topk=None,
                           latent_row_bytes=2 * (layout.NOPE_DIM + layout.ROPE_DIM), index_row_bytes=0)
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
