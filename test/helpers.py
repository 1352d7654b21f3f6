"""Small shared fixtures: a tiny model configuration that decodes in well under a second on CPU."""

import torch

from ess.reference.config import get_config
from ess.reference.dense_cache import DenseLatentCache
from ess.reference.model import MiniModel, random_prompts

TINY = get_config("mini", num_layers=2, index_topk=16)


def tiny_model(seed: int = 0) -> MiniModel:
    return MiniModel(TINY, seed=seed)


def tiny_prompts(batch: int = 3, context: int = 160, seed: int = 0):
    return random_prompts(batch, context, TINY.vocab, seed, vary=23)  # unequal lengths on purpose


def dense(cfg=TINY):
    return lambda ctx, max_len: DenseLatentCache(cfg.num_layers, len(ctx), max_len, "cpu")
