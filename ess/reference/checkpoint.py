"""`ess tiny-checkpoint OUT`: a tiny random DeepSeek-V3.2 checkpoint that stock SGLang loads and serves.

DeepSeek-V3.2's real config keys and model_type (`deepseek_v32`, DeepseekV32ForCausalLM), its attention formats kept
(kv_lora_rank 512 and a 64-wide RoPE part: the 656-byte latent rows; 128-wide index keys: the 132-byte index-K rows;
YaRN RoPE scaling as the real model has it) and every width that no format fixes shrunk: 2 layers (one dense, one MoE
with 4 routed experts, top-2, and a shared expert), hidden 256, 4 attention heads, 4 indexer heads, `index_topk` 64,
so that a few hundred tokens of context overflow a 96-slot ESS buffer on every step. `full=True` keeps every width of the
real model instead (ess.core.dsv32: hidden 7168, 128 heads, q_lora 1536, 64 indexer heads, top-k 2048, vocab 129280,
the dense MLP's 18432) and only the depth shrinks (FULL_WIDTH: 4 dense layers): the GPU server's model
(benchmark/gpu/server.sh, about 8.5 GB). Weights are BF16 in one safetensors file, named as DeepSeek's own checkpoints
name them, drawn from one seeded generator (the same seed gives the same bytes; config and weights:
ess.reference.checkpoint_weights).

The tokenizer covers the model's whole vocabulary (320 ids, or DeepSeek-V3.2's 129,280 at full width), and every id
decodes to text of its own, appended to what came before (`tokenizer`): a random model emits any id, and a serving
benchmark times only the chunks that carry text, so a token that decoded to nothing (or to half a UTF-8 character,
held back until the next) would hide from its TTFT, ITL and TPOT. Written with the `tokenizers` library, loaded by
transformers' PreTrainedTokenizerFast.
"""

from __future__ import annotations

import itertools
import json
import os

from ess.reference.checkpoint_weights import VOCAB, config, to_fp8, weights
from ess.reference.locality import apply as apply_locality

VOCAB_SPECIAL = ("<bos>", "<eos>")  # token ids 0 and 1 (the config's bos and eos); then "<unk>", then CHARS
UNK = "<unk>"
CHARS = [chr(c) for c in range(0x20, 0x7F)] + ["\n", "\t"]  # what text encodes to (other characters: <unk>)
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


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
          locality: float | None = None, fp8: bool = False, moe_layers: int | None = None) -> list[str]:
    """Write the checkpoint into out_dir (created; refused if it holds any of FILES already): SHAPE's widths, or
    FULL_WIDTH's where full; weights drawn on `device`. With `locality` (the noise share, ess.reference.locality) the
    indexer's top-k is as sticky as a real model's; None: the random checkpoint. With fp8, the projections in
    DeepSeek's FP8 block format (ess.reference.checkpoint_weights.to_fp8), drawn as the bf16 ones are. With full and
    moe_layers, DeepSeek-V3.2's layer mix at one GPU's share of EP8 (checkpoint_weights.full_width_mix), its MTP
    layer allowed. Returns the paths."""
    from safetensors.torch import save_file

    if full and mtp and moe_layers is None:
        raise ValueError("a full-width checkpoint's MTP layer is an MoE layer of 256 experts (11B parameters): "
                         "write it without (--no-mtp), or at one GPU's share of EP8 (--moe-layers)")
    if locality is not None and not 0.0 <= locality <= 1.0:
        raise ValueError(f"locality (the indexer's noise share) must be in [0, 1], got {locality}")
    cfg = config(mtp, full, fp8, moe_layers)  # refuses a bad layer mix before anything is written
    taken = [f for f in FILES if os.path.exists(os.path.join(out_dir, f))]
    if taken:
        raise FileExistsError(f"{out_dir} already holds {', '.join(taken)}: give an empty or new directory")
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f) for f in FILES]
    with open(paths[0], "w") as f:
        json.dump(cfg, f, indent=1)
    with open(paths[1], "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1}, f)
    w = weights(cfg, seed, device)
    meta = {"format": "pt"}  # one key: safetensors orders a map at random
    if locality is not None:
        w = apply_locality(w, cfg, locality, seed)
        meta = {"ess_locality": str(locality), "format": "pt"}  # which checkpoint a report's figures used
    if fp8:
        w = to_fp8(w, device)
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
