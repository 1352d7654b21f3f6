"""Model configurations of the reference DeepSeek-V3.2 attention: `full` (the real model) and `mini` (CPU tests)."""

from __future__ import annotations

import dataclasses

from ess import layout


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

    def __post_init__(self) -> None:
        # The cache formats are fixed by FlashMLA / SGLang; every configuration keeps them.
        if self.kv_lora_rank != layout.NOPE_DIM or self.qk_rope_head_dim != layout.ROPE_DIM:
            raise ValueError("kv_lora_rank must be 512 and qk_rope_head_dim 64 (the 656-byte latent row)")
        if self.index_head_dim != layout.INDEX_DIM:
            raise ValueError("index_head_dim must be 128 (the 132-byte index-K row)")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError("index_head_dim must hold the RoPE part")

    @property
    def softmax_scale(self) -> float:
        # 1/sqrt(qk_head_dim); the real model's YaRN mscale factor is left out (random weights here).
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

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


FULL = ModelConfig(
    name="full",
    num_layers=61,
    hidden=7168,
    num_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    index_heads=64,
    index_head_dim=128,
    index_topk=2048,
    vocab=129280,
    mlp_hidden=18432,
    max_positions=163840,
)

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
)

CONFIGS = {"full": FULL, "mini": MINI}


def get_config(name: str, **overrides) -> ModelConfig:
    if name not in CONFIGS:
        raise ValueError(f"--config: unknown model configuration {name!r}; choose from {sorted(CONFIGS)}")
    return dataclasses.replace(CONFIGS[name], **overrides) if overrides else CONFIGS[name]
