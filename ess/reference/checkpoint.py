"""`ess tiny-checkpoint OUT`: a tiny random DeepSeek-V3.2 checkpoint that stock SGLang loads and serves.

DeepSeek-V3.2's real config keys and model_type (`deepseek_v32`, DeepseekV32ForCausalLM), its attention formats kept
(kv_lora_rank 512 and a 64-wide RoPE part: the 656-byte latent rows; 128-wide index keys: the 132-byte index-K rows;
YaRN RoPE scaling as the real model has it) and every width that no format fixes shrunk: 2 layers (one dense, one MoE
with 4 routed experts, top-2, and a shared expert), hidden 256, 4 attention heads, 4 indexer heads, `index_topk` 64,
so that a few hundred tokens of context overflow a 96-slot ESS buffer on every step. `full=True` keeps every width of the
real model instead (ess.core.dsv32: hidden 7168, 128 heads, q_lora 1536, 64 indexer heads, top-k 2048, vocab 129280,
the dense MLP's 18432) and only the depth shrinks (FULL_WIDTH: 4 dense layers): the GPU server's model
(benchmark/gpu/server.sh, about 8.5 GB). Weights are BF16 in one safetensors file, named as DeepSeek's own checkpoints
name them, drawn from one seeded generator (the same seed gives the same bytes).

The tokenizer covers the model's whole vocabulary (320 ids, or DeepSeek-V3.2's 129,280 at full width), and every id
decodes to text of its own, appended to what came before (`tokenizer`): a random model emits any id, and a serving
benchmark times only the chunks that carry text, so a token that decoded to nothing (or to half a UTF-8 character,
held back until the next) would hide from its TTFT, ITL and TPOT. Written with the `tokenizers` library, loaded by
transformers' PreTrainedTokenizerFast.
"""

from __future__ import annotations

import copy
import itertools
import json
import os

import torch

from ess.core import dsv32

VOCAB_SPECIAL = ("<bos>", "<eos>")  # token ids 0 and 1 (the config's bos and eos); then "<unk>", then CHARS
UNK = "<unk>"
CHARS = [chr(c) for c in range(0x20, 0x7F)] + ["\n", "\t"]  # what text encodes to (other characters: <unk>)
VOCAB = 320  # the embedding rows
SHAPE = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "q_lora_rank": 64,
         "qk_nope_head_dim": 32, "v_head_dim": 32, "index_n_heads": 4, "index_topk": 64, "n_routed_experts": 4,
         "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_intermediate_size": 64, "intermediate_size": 256,
         "n_group": 1, "topk_group": 1, "vocab_size": VOCAB}
# DeepSeek-V3.2's own widths (its config.json), at a depth a single GPU's lease can write and load: every layer dense
# (first_k_dense_replace = the depth), so no MoE kernel is needed; the experts' keys stay for SGLang's config checks.
FULL_WIDTH = {**{key: dsv32.CONFIG[key] for key in SHAPE}, "num_hidden_layers": 4, "first_k_dense_replace": 4}
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def config(mtp: bool = True, full: bool = False) -> dict:
    """config.json: DeepSeek-V3.2's keys, the formats' widths as the real model's, SHAPE's widths shrunk (FULL_WIDTH's
    where full); with its MTP layer (one, as the real model) unless mtp is False."""
    shape = FULL_WIDTH if full else SHAPE
    return {
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


def words():
    """Endless distinct ASCII words, shortest first: " a" .. " z", " aa" .. " zz", " aaa" ..."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    for n in itertools.count(1):
        for w in itertools.product(letters, repeat=n):
            yield " " + "".join(w)


def vocabulary(size: int) -> list[str]:
    """The text of each of `size` ids: the bos and eos names, <unk>, CHARS, then words. Distinct, non-empty, ASCII."""
    head = [*VOCAB_SPECIAL, UNK, *CHARS]
    if size < len(head):
        raise ValueError(f"a vocabulary of {size} ids cannot hold the {len(head)} tokens text encodes to")
    return head + list(itertools.islice(words(), size - len(head)))


def tokenizer(size: int = VOCAB):
    """A character-level tokenizer of exactly `size` ids whose every id decodes to its own text (vocabulary), the
    texts of a sequence concatenated: text encodes character by character (CHARS; anything else to <unk>), and
    decoding appends each id's text, so every generated token streams as a chunk of its own. bos and eos are ordinary
    tokens here (a benchmark ignoring eos still streams them); the model's config names them for stopping."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocabulary(size))}, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()
    return tok


def write(out_dir: str, seed: int = 0, mtp: bool = True, full: bool = False, device: str = "cpu",
          locality: float | None = None) -> list[str]:
    """Write the checkpoint into out_dir (created; refused if it holds any of FILES already): SHAPE's widths, or
    FULL_WIDTH's where full; weights drawn on `device`. With `locality` (the noise share, ess.reference.locality) the
    indexer's top-k is as sticky as a real model's; None: the random checkpoint. Returns the paths."""
    from safetensors.torch import save_file

    if full and mtp:
        raise ValueError("a full-width checkpoint's MTP layer is an MoE layer of 256 experts (11B parameters): "
                         "write it without (--no-mtp)")
    if locality is not None and not 0.0 <= locality <= 1.0:
        raise ValueError(f"locality (the indexer's noise share) must be in [0, 1], got {locality}")
    taken = [f for f in FILES if os.path.exists(os.path.join(out_dir, f))]
    if taken:
        raise FileExistsError(f"{out_dir} already holds {', '.join(taken)}: give an empty or new directory")
    os.makedirs(out_dir, exist_ok=True)
    cfg = config(mtp, full)
    paths = [os.path.join(out_dir, f) for f in FILES]
    with open(paths[0], "w") as f:
        json.dump(cfg, f, indent=1)
    with open(paths[1], "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1}, f)
    w = weights(cfg, seed, device)
    meta = {"format": "pt"}  # one key: safetensors orders a map at random
    if locality is not None:
        from ess.reference.locality import apply

        w = apply(w, cfg, locality, seed)
        meta = {"ess_locality": str(locality), "format": "pt"}  # which checkpoint a report's figures used
    save_file(w, paths[2], metadata=meta)
    write_tokenizer(out_dir, cfg["vocab_size"], cfg["max_position_embeddings"])
    return paths


def locality_of(model_dir: str) -> float | None:
    """The locality knob a checkpoint was written with (its safetensors metadata), None for the random one."""
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, FILES[2]), "pt") as f:
        value = (f.metadata() or {}).get("ess_locality")
    return None if value is None else float(value)


def write_tokenizer(out_dir: str, size: int, max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json of `tokenizer(size)` into out_dir."""
    tokenizer(size).save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        # no special tokens, no clean-up of spaces: every id's text streams as it is
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
                   "clean_up_tokenization_spaces": False, "model_max_length": max_length}, f, indent=1)
