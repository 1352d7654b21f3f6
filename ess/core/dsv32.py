"""DeepSeek-V3.2, the one record of the model: its config.json (Hugging Face key names), the keys this project reads or
writes. The simulator's model (ess.analysis.sim.specs), the reference model's full configuration (ess.reference.config)
and the tiny checkpoints (ess.reference.checkpoint) derive from it; the widths that the cache formats fix are
ess.core.layout's (the 656-byte latent row: kv_lora_rank NoPE values and a qk_rope_head_dim RoPE part; the 132-byte
index-K row: index_head_dim values).

Read it, never change it: copy it (`copy.deepcopy`) to make another model's configuration.
"""

from __future__ import annotations

from ess.core import layout

CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,  # the first 3 layers dense, the other 58 MoE
    "moe_intermediate_size": 2048,
    "intermediate_size": 18432,  # the dense layers' MLP
    "n_group": 8,
    "topk_group": 4,
    "vocab_size": 129280,
    "num_key_value_heads": 128,
    "kv_lora_rank": layout.NOPE_DIM,
    "qk_rope_head_dim": layout.ROPE_DIM,
    "index_head_dim": layout.INDEX_DIM,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 1,  # the MTP layer
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-6,
}
