"""The tiny DeepSeek-V3.2 checkpoint's config.json and weights (ess.reference.checkpoint writes them): DeepSeek-V3.2's
config with SHAPE's widths (or FULL_WIDTH's), and every tensor SGLang's DeepSeek loader reads, drawn from one seeded
generator. A module of its own so that ess.reference.locality (which rebuilds some of these tensors, and which the
writer calls) reads them without importing the writer: no import circle.
"""

from __future__ import annotations

import copy

import torch

from ess.core import dsv32

VOCAB = 320  # the embedding rows
SHAPE = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "q_lora_rank": 64,
         "qk_nope_head_dim": 32, "v_head_dim": 32, "index_n_heads": 4, "index_topk": 64, "n_routed_experts": 4,
         "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_intermediate_size": 64, "intermediate_size": 256,
         "n_group": 1, "topk_group": 1, "vocab_size": VOCAB}
# DeepSeek-V3.2's own widths (its config.json), at a depth a single GPU's lease can write and load: every layer dense
# (first_k_dense_replace = the depth), so no MoE kernel is needed; the experts' keys stay for SGLang's config checks.
FULL_WIDTH = {**{key: dsv32.CONFIG[key] for key in SHAPE}, "num_hidden_layers": 4, "first_k_dense_replace": 4}
# DeepSeek-V3.2's layer mix on one GPU: the share of a deployment with expert parallelism over EP GPUs. Its 3 dense
# layers, then `moe_layers` MoE layers (the model has 58), each with 256 / EP routed experts of the real width and the
# shared expert, a token routed to 8 / EP of them (8 of 256 over EP GPUs: that many local experts a token on
# average, so each GPU's experts see the tokens they would); the MTP layer as another MoE layer. Left out: the
# all-to-all of the tokens between the GPUs, and the other MoE layers (the simulator adds both: docs/simulator.md).
EP = 8


def full_width_mix(moe_layers: int) -> dict:
    """FULL_WIDTH's widths with DeepSeek-V3.2's layer mix at one GPU's share of EP8 (EP above)."""
    if moe_layers < 1:
        raise ValueError(f"--moe-layers must be at least 1, got {moe_layers}")
    dense = dsv32.CONFIG["first_k_dense_replace"]
    return {**FULL_WIDTH, "num_hidden_layers": dense + moe_layers, "first_k_dense_replace": dense,
            "n_routed_experts": dsv32.CONFIG["n_routed_experts"] // EP,
            "num_experts_per_tok": dsv32.CONFIG["num_experts_per_tok"] // EP, "n_group": 1, "topk_group": 1}


# DeepSeek's FP8 checkpoint format (its config.json's quantization_config): e4m3 weights, one power-of-two (ue8m0)
# scale per 128 x 128 block, stored as `<name>_scale_inv` (weight = fp8 x scale_inv)
FP8_BLOCK = 128
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
              "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
# SHAPE's widths that a 128 x 128 block must divide in SGLang's FP8 loader: the query's low rank (its rows share
# fused_qkv_a_proj's scale blocks with kv_a's) and the experts' width (gate and up merged)
FP8_SHAPE = {"q_lora_rank": FP8_BLOCK, "moe_intermediate_size": FP8_BLOCK}
# The linear layers DeepSeek ships in FP8 (SGLang builds them with the FP8 method); the embeddings, the heads, the
# router, the indexer's head weights and the MTP layer's eh_proj stay bf16
FP8_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "indexer.wq_b", "indexer.wk",
               "gate_proj", "up_proj", "down_proj")


def config(mtp: bool = True, full: bool = False, fp8: bool = False, moe_layers: int | None = None) -> dict:
    """config.json: DeepSeek-V3.2's keys, the formats' widths as the real model's, SHAPE's widths shrunk (FULL_WIDTH's
    where full, with moe_layers its layer mix: full_width_mix); with its MTP layer (one, as the real model) unless mtp
    is False; with fp8, DeepSeek's FP8 format (FP8_CONFIG; SHAPE's widths FP8_SHAPE's where a block must divide
    them)."""
    if moe_layers is not None and not full:
        raise ValueError("--moe-layers is the full-width model's layer mix: give --full-width too")
    if full:
        shape = FULL_WIDTH if moe_layers is None else full_width_mix(moe_layers)
    else:
        shape = {**SHAPE, **FP8_SHAPE} if fp8 else SHAPE
    quant = {"quantization_config": copy.deepcopy(FP8_CONFIG)} if fp8 else {}
    return {
        **quant,
        **copy.deepcopy(dsv32.CONFIG),  # the real model's keys and values, then its widths shrunk
        **shape,
        "num_key_value_heads": shape["num_attention_heads"],
        "num_nextn_predict_layers": int(mtp),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }


def weights(cfg: dict, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor SGLang's DeepSeek loader reads, by the checkpoint's names, drawn in name order from one generator
    on `device` (a GPU draws a full-width model in a second; the same seed and device, the same bytes): linear layers
    N(0, 1 / fan_in), norms 1, biases 0. The tensors are returned on the CPU."""
    gen = torch.Generator(device=device).manual_seed(seed)
    vocab = cfg["vocab_size"]
    H, hid, ql = cfg["num_attention_heads"], cfg["hidden_size"], cfg["q_lora_rank"]
    nope, rope, vd, kvl = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    ih, idim, E = cfg["index_n_heads"], cfg["index_head_dim"], cfg["n_routed_experts"]
    shapes: dict[str, tuple] = {"model.embed_tokens.weight": (vocab, hid), "model.norm.weight": (hid,),
                                "lm_head.weight": (vocab, hid)}

    def mlp(prefix: str, inner: int) -> None:
        shapes.update({f"{prefix}gate_proj.weight": (inner, hid), f"{prefix}up_proj.weight": (inner, hid),
                       f"{prefix}down_proj.weight": (hid, inner)})

    L = cfg["num_hidden_layers"]
    for i in range(L + cfg["num_nextn_predict_layers"]):  # the MTP layers follow the decoder's, numbered on
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        if i >= L:  # an MTP layer's own tensors, around a decoder block like the others
            shapes.update({f"{p}embed_tokens.weight": (vocab, hid), f"{p}enorm.weight": (hid,), f"{p}hnorm.weight": (hid,),
                           f"{p}eh_proj.weight": (hid, 2 * hid), f"{p}shared_head.norm.weight": (hid,),
                           f"{p}shared_head.head.weight": (vocab, hid)})
        shapes.update({
            f"{p}input_layernorm.weight": (hid,), f"{p}post_attention_layernorm.weight": (hid,),
            f"{a}q_a_proj.weight": (ql, hid), f"{a}q_a_layernorm.weight": (ql,),
            f"{a}q_b_proj.weight": (H * (nope + rope), ql),
            f"{a}kv_a_proj_with_mqa.weight": (kvl + rope, hid), f"{a}kv_a_layernorm.weight": (kvl,),
            f"{a}kv_b_proj.weight": (H * (nope + vd), kvl), f"{a}o_proj.weight": (hid, H * vd),
            f"{a}indexer.wq_b.weight": (ih * idim, ql), f"{a}indexer.wk.weight": (idim, hid),
            f"{a}indexer.k_norm.weight": (idim,), f"{a}indexer.k_norm.bias": (idim,),
            f"{a}indexer.weights_proj.weight": (ih, hid),
        })
        if i < cfg["first_k_dense_replace"]:
            mlp(f"{p}mlp.", cfg["intermediate_size"])
        else:
            shapes.update({f"{p}mlp.gate.weight": (E, hid), f"{p}mlp.gate.e_score_correction_bias": (E,)})
            for e in range(E):
                mlp(f"{p}mlp.experts.{e}.", cfg["moe_intermediate_size"])
            mlp(f"{p}mlp.shared_experts.", cfg["moe_intermediate_size"] * cfg["n_shared_experts"])

    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("bias"):
            t = torch.zeros(shape)
        elif len(shape) == 1:
            t = torch.ones(shape)
        else:
            t = (torch.randn(shape, generator=gen, device=device) * shape[1] ** -0.5).to(torch.bfloat16).cpu()
        # the router's correction bias in float32
        out[name] = t if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
    return out


def is_fp8_linear(name: str) -> bool:
    """Whether DeepSeek's FP8 checkpoints hold this tensor in FP8 (FP8_LINEARS: a layer's projections)."""
    return name.endswith(".weight") and name.removesuffix(".weight").endswith(FP8_LINEARS) and ".layers." in name


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight in DeepSeek's FP8 block format: (e4m3 values, float32 scale_inv of shape [ceil(rows / 128),
    ceil(cols / 128)]), each block's scale the power of two (ue8m0) at or above its absolute maximum / 448, so that
    values x scale_inv restore the weight to e4m3's precision."""
    rows, cols = w.shape
    b = FP8_BLOCK
    nr, nc = -(-rows // b), -(-cols // b)
    padded = torch.zeros(nr * b, nc * b, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(nr, b, nc, b)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-10)
    scale = torch.exp2(torch.ceil(torch.log2(amax / torch.finfo(torch.float8_e4m3fn).max)))
    values = (blocks / scale[:, None, :, None]).view(nr * b, nc * b)[:rows, :cols].to(torch.float8_e4m3fn)
    return values.contiguous(), scale


def to_fp8(w: dict[str, torch.Tensor], device: str = "cpu") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in DeepSeek's FP8 format: each FP8_LINEARS weight as its e4m3 values and a
    `<name>_scale_inv` beside it (fp8_blocks, on `device`; the results on the CPU), the others unchanged. Takes the
    tensors out of w as it goes (a full-width model is held once)."""
    out = {}
    for name in sorted(w):
        t = w.pop(name)
        if is_fp8_linear(name):
            values, scale = fp8_blocks(t.to(device))
            out[name], out[f"{name}_scale_inv"] = values.cpu(), scale.cpu()
        else:
            out[name] = t
    return out
