"""The tiny checkpoint with a real model's indexer locality (ess/reference/locality.py)."""

import hashlib
import os

import numpy as np
import pytest
import torch

from ess.analysis.profiling import similarity
from ess.core.trace import Trace
from ess.reference import checkpoint, locality

# model.safetensors of `checkpoint.write(dir, 0)` before the locality option existed (this venv's torch)
RANDOM_SHA256 = "f92f822e0f026734543ee8f5f26df8185dfa4f2e682a010623f4e9fde816b990"


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_knob_off_is_the_random_checkpoint(tmp_path):
    from safetensors.torch import load_file

    off, on = tmp_path / "off", tmp_path / "on"
    checkpoint.write(str(off), 0, locality=None)
    assert _sha(os.path.join(off, "model.safetensors")) == RANDOM_SHA256
    checkpoint.write(str(on), 0, locality=locality.FITTED)
    for f in ("config.json", "tokenizer.json"):
        assert _sha(os.path.join(off, f)) == _sha(os.path.join(on, f))
    a, b = load_file(os.path.join(off, "model.safetensors")), load_file(os.path.join(on, "model.safetensors"))
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert "model.embed_tokens.weight" in changed and "model.layers.1.self_attn.indexer.wq_b.weight" in changed
    assert all(k == "model.embed_tokens.weight" or ".indexer." in k for k in changed)  # nothing else moves
    # the checkpoint names its locality (safetensors metadata), which the GPU server's reports carry
    assert checkpoint.locality_of(str(off)) is None and checkpoint.locality_of(str(on)) == locality.FITTED
    with pytest.raises(ValueError, match="locality"):
        checkpoint.write(str(tmp_path / "bad"), 0, locality=1.5)
    assert not (tmp_path / "bad").exists()


def test_fitted_knob_is_stickier_than_random():
    cfg = checkpoint.config(mtp=False)
    w = checkpoint.weights(cfg, 0)
    kw = dict(context=448, steps=24, requests=1, seed=1)
    rand = similarity(locality.indexer_trace(w, cfg, **kw)).mean()
    sticky = similarity(locality.indexer_trace(locality.apply(w, cfg, locality.FITTED, 0), cfg, **kw)).mean()
    assert sticky > 0.6 and sticky > rand + 0.25, (rand, sticky)


def test_share_curve_tiny_case():
    # 1 request, 1 layer, top-k 2, context 40: steps use {0, 1} (own 40), {0, 40} (own 41), {1, 41} (own 42)
    topk = np.array([[0, 1], [0, 40], [1, 41]], np.int32).reshape(1, 3, 1, 2)
    tr = Trace(topk=topk, context_len=np.array([40], np.int64)).validate()
    # 3 slots (ratio 0.05: top-k + 1): 2 first touches, then hits, then 1 was evicted (LRU) -> (2 + 0 + 1) / 3 / 2
    # 40 slots (ratio 1.0): first touches only -> (2 + 0 + 0) / 3 / 2
    assert np.allclose(locality.share_curve(tr, [0.05, 1.0]), [0.5, 1 / 3])


def test_real_curve_is_the_dsv32_mapping():
    ratios, share = locality.real_share_curve()
    assert ratios == [0.05, 0.1, 0.2, 0.3, 0.5]
    assert np.allclose(share * 2048, [381.07, 171.50, 78.25, 52.77, 39.71], atol=0.01)  # docs/profiling.md's numbers
