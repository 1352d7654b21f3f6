"""Model directories (config.json only) for launching SGLang's argument resolution on the CPU."""

import json

DSV32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 7168,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_topk": 2048,
    "index_head_dim": 128, "index_n_heads": 64, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_intermediate_size": 2048, "intermediate_size": 18432, "vocab_size": 129280,
    "max_position_embeddings": 163840, "num_nextn_predict_layers": 1, "rope_theta": 10000, "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6, "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


def model_dir(tmp_path, name="dsv32", **changes):
    cfg = {**DSV32, **changes}
    for k in [k for k, v in changes.items() if v is None]:
        del cfg[k]
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def sglang_req(slot: int | None, room: int = 0, metadata_index: int = -1):
    """A real SGLang Req holding request-table row `slot` (0.5.23 keeps it in req.kv), as the scheduler leaves it."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(f"r{slot}-{room}", "", [1, 2, 3], SamplingParams(max_new_tokens=4), bootstrap_room=room)
    req.kv.req_pool_idx = slot
    req.metadata_buffer_index = metadata_index
    return req


def decode_request(req, metadata_index: int):
    """SGLang's DecodeRequest of a PD decode node for `req` (no receiver: the transfer is over when the hook runs)."""
    from sglang.srt.disaggregation.decode import DecodeRequest

    return DecodeRequest(req=req, kv_receiver=None, metadata_buffer_index=metadata_index)
