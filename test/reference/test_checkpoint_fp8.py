"""`ess tiny-checkpoint --fp8`: DeepSeek's FP8 checkpoint format (ess.reference.checkpoint_weights): e4m3 values and a
power-of-two (ue8m0) scale_inv per 128 x 128 block for the projections DeepSeek ships in FP8, bf16 for the rest, and
the quantization_config SGLang's FP8 loader reads. The real server serves it (test/plugin/test_server.py)."""

import json

import pytest
import torch
from safetensors import safe_open

from ess.reference import checkpoint
from ess.reference.checkpoint_weights import FP8_CONFIG, fp8_blocks, is_fp8_linear

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def restored(values, scale):
    """values x their block's scale_inv, float32 (the format's meaning)."""
    rows, cols = values.shape
    return values.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]


def test_a_block_s_scale_is_the_power_of_two_that_maps_its_maximum_into_e4m3():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 200)
    values, scale = fp8_blocks(w)
    assert values.dtype == torch.float8_e4m3fn and values.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (3, 2)  # ragged edge blocks count whole
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # ue8m0: powers of two
    back = restored(values, scale)
    for r in range(3):
        for c in range(2):
            block = (slice(128 * r, 128 * (r + 1)), slice(128 * c, 128 * (c + 1)))
            amax = w[block].abs().max()
            assert E4M3_MAX / 2 < amax / scale[r, c] <= E4M3_MAX  # the block's maximum uses e4m3's top binade
            # e4m3 keeps 3 mantissa bits: each value within half a step of its binade (2^-4 of it), or of the
            # smallest subnormal step below
            err = (back[block] - w[block]).abs()
            assert (err <= torch.maximum(w[block].abs() / 16, 2.0 ** -10 * scale[r, c])).all()


def test_the_fp8_checkpoint_holds_deepseek_s_format(tmp_path):
    checkpoint.write(str(tmp_path), seed=0, fp8=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"] == FP8_CONFIG and cfg["num_nextn_predict_layers"] == 1
    assert cfg["q_lora_rank"] % 128 == 0 and cfg["moe_intermediate_size"] % 128 == 0  # the loader's block checks
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        fp8 = {n for n in names if is_fp8_linear(n)}
        # every projection of every layer: the MTP layer's (layer 2) attention, indexer and experts, the dense MLP
        for part in ("q_a_proj", "kv_b_proj", "o_proj", "indexer.wq_b", "indexer.wk", "experts.3.up_proj",
                     "shared_experts.gate_proj"):
            assert f"model.layers.2.self_attn.{part}.weight" in fp8 or f"model.layers.2.mlp.{part}.weight" in fp8
        assert "model.layers.0.mlp.down_proj.weight" in fp8
        # 3 layers' 7 attention projections, the dense MLP's 3, and 2 MoE layers' 3 per expert, shared one included
        assert len(fp8) == 3 * 7 + 3 + 2 * 3 * (cfg["n_routed_experts"] + 1)
        for n in names:
            t = f.get_tensor(n)
            if n in fp8:
                assert t.dtype == torch.float8_e4m3fn and f.get_tensor(f"{n}_scale_inv").dtype == torch.float32
            elif not n.endswith("_scale_inv"):
                assert t.dtype in (torch.bfloat16, torch.float32), n  # embeddings, heads, router, norms, eh_proj
        assert f.get_tensor("model.layers.2.eh_proj.weight").dtype == torch.bfloat16


def test_sglang_s_dequantiser_reads_the_blocks_as_written():
    fp8_utils = pytest.importorskip("sglang.srt.layers.quantization.fp8_utils")
    w = torch.randn(640, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    values, scale = fp8_blocks(w)
    assert torch.equal(fp8_utils.block_quant_dequant(values, scale, [128, 128], torch.float32), restored(values, scale))


def test_the_full_width_layer_mix_is_one_gpu_s_share_of_ep8(tmp_path):
    """DeepSeek-V3.2's widths, its 3 dense layers then MoE layers of 256 / 8 routed experts, a token to 8 / 8 of them
    (one local expert a token on average, as each GPU of EP8 sees), the MTP layer allowed; bad mixes refused before
    anything is written."""
    cfg = checkpoint.config(mtp=True, full=True, fp8=True, moe_layers=13)
    assert (cfg["num_hidden_layers"], cfg["first_k_dense_replace"]) == (16, 3)
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["n_shared_experts"]) == (32, 1, 1)
    assert cfg["moe_intermediate_size"] == 2048 and cfg["hidden_size"] == 7168 and cfg["num_nextn_predict_layers"] == 1
    assert cfg["quantization_config"] == FP8_CONFIG
    for kwargs, flag in (({"full": True, "moe_layers": 0}, "--moe-layers"), ({"moe_layers": 2}, "--full-width"),
                         ({"full": True}, "--no-mtp")):
        with pytest.raises(ValueError, match=flag):
            checkpoint.write(str(tmp_path / "refused"), **kwargs)
    assert not (tmp_path / "refused").exists()
