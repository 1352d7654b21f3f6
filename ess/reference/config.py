"""Model configurations of the reference DeepSeek-V3.2 attention: `full` (the real model, ess.core.dsv32's record) and
`mini` (CPU tests).

Field names follow DeepSeek's official inference code (`ModelArgs` in DeepSeek-V3.2-Exp's `inference/model.py`);
`from_hf` reads a Hugging Face `config.json`. YaRN (rope_factor, original_seq_len, beta_fast, beta_slow, mscale) is on
whenever the configured maximum positions exceed original_seq_len, as there: always for the full model (163,840 >
4,096); the mini config sets original_seq_len to its maximum, so it stays off unless asked.
"""

from __future__ import annotations

import dataclasses
import math

from ess.core import dsv32, layout
from ess.core.memory import cache_bytes


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    vocab: int
    mlp_hidden: int
    max_positions: int
    rope_theta: float = 10000.0
    original_seq_len: int = 4096
    rope_factor: float = 40.0
    beta_fast: int = 32
    beta_slow: int = 1
    mscale: float = 1.0

    def __post_init__(self) -> None:
        # The cache formats are fixed by FlashMLA / SGLang; every configuration keeps them.
        if self.kv_lora_rank != layout.NOPE_DIM or self.qk_rope_head_dim != layout.ROPE_DIM:
            raise ValueError("kv_lora_rank must be 512 and qk_rope_head_dim 64 (the 656-byte latent row)")
        if self.index_head_dim != layout.INDEX_DIM:
            raise ValueError("index_head_dim must be 128 (the 132-byte index-K row)")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError("index_head_dim must hold the RoPE part")
        if not self.rope_factor >= 1 or not self.original_seq_len > 0 or not self.beta_fast > self.beta_slow > 0:
            raise ValueError("YaRN needs rope_factor >= 1, original_seq_len > 0 and beta_fast > beta_slow > 0")

    @property
    def yarn(self) -> bool:
        """YaRN rope scaling and the softmax correction are on (the official code's max_seq_len > original_seq_len)."""
        return self.max_positions > self.original_seq_len

    @property
    def softmax_scale(self) -> float:
        """MLA's softmax scale: 1/sqrt(qk_head_dim), times mscale^2 under YaRN (the indexer's scale has no such factor)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.yarn:
            m = 0.1 * self.mscale * math.log(self.rope_factor) + 1.0
            scale *= m * m
        return scale

    def weight_bytes(self) -> int:
        """float32 bytes of the reference model's weights (attention, MLP, embedding and LM head)."""
        H, dn, dr, dv, r = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank
        attn = (
            self.q_lora_rank * self.hidden
            + H * (dn + dr) * self.q_lora_rank
            + (r + dr) * self.hidden
            + H * dn * r
            + H * r * dv
            + self.hidden * H * dv
            + self.index_heads * self.index_head_dim * self.q_lora_rank
            + self.index_head_dim * self.hidden
            + self.index_heads * self.hidden
        )
        mlp = 3 * self.hidden * self.mlp_hidden
        return 4 * (self.num_layers * (attn + mlp) + 2 * self.vocab * self.hidden)

    def latent_bytes(self, tokens: int) -> int:
        return tokens * self.num_layers * layout.LATENT_ROW_BYTES

    def index_k_bytes(self, tokens: int) -> int:
        return tokens * self.num_layers * layout.INDEX_ROW_BYTES

    def device_cache_bytes(self, tokens: int, ess_capacity: int | None = None) -> int:
        """Device bytes of one request's caches at `tokens` tokens, with ESS's `ess_capacity` slots or without ESS."""
        return cache_bytes(self.num_layers, tokens, layout.LATENT_ROW_BYTES, layout.INDEX_ROW_BYTES, ess_capacity)


MINI = ModelConfig(
    name="mini",
    num_layers=4,
    hidden=256,
    num_heads=4,
    q_lora_rank=128,
    kv_lora_rank=512,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=64,
    index_heads=4,
    index_head_dim=128,
    index_topk=64,
    vocab=1024,
    mlp_hidden=512,
    max_positions=65536,
    original_seq_len=65536,  # YaRN off: the demo's figures stay comparable; get_config("mini", original_seq_len=4096) turns it on
)

# Hugging Face config.json names (DeepSeek-V3.2) of the fields above; YaRN's live in its rope_scaling, where the
# softmax correction's factor is mscale_all_dim (the one the official code calls mscale).
_HF_NAMES = {
    "num_hidden_layers": "num_layers", "hidden_size": "hidden", "num_attention_heads": "num_heads",
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "index_n_heads": "index_heads",
    "index_head_dim": "index_head_dim", "index_topk": "index_topk", "vocab_size": "vocab",
    "intermediate_size": "mlp_hidden", "max_position_embeddings": "max_positions", "rope_theta": "rope_theta",
}
_HF_ROPE_SCALING = {"factor": "rope_factor", "original_max_position_embeddings": "original_seq_len",
                    "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale_all_dim": "mscale"}


def from_hf(hf: dict, name: str = "hf") -> ModelConfig:
    """The configuration of a Hugging Face config.json (as a dict). Without rope_scaling there is no YaRN."""
    missing = sorted(k for k in _HF_NAMES if k not in hf)
    if missing:
        raise ValueError(f"config.json: missing {missing}")
    fields = {field: hf[key] for key, field in _HF_NAMES.items()}
    scaling = hf.get("rope_scaling") or {}
    fields.update({field: scaling[key] for key, field in _HF_ROPE_SCALING.items() if key in scaling})
    if not scaling:
        fields["original_seq_len"] = fields["max_positions"]
    for field in ("rope_theta", "rope_factor", "mscale"):  # config.json may write them as integers
        if field in fields:
            fields[field] = float(fields[field])
    return ModelConfig(name=name, **fields)


FULL = from_hf(dsv32.CONFIG, name="full")
CONFIGS = {"full": FULL, "mini": MINI}


def get_config(name: str, **overrides) -> ModelConfig:
    if name not in CONFIGS:
        raise ValueError(f"--config: unknown model configuration {name!r}; choose from {sorted(CONFIGS)}")
    return dataclasses.replace(CONFIGS[name], **overrides) if overrides else CONFIGS[name]
