"""A tiny model configuration that decodes in well under a second on a CPU, and caches for it: the fixtures of the
reference tests and of quick experiments."""

from ess.core.settings import WARMUP_WINDOWS, EssConfig
from ess.reference.config import get_config
from ess.reference.dense_cache import DenseLatentCache
from ess.reference.ess_cache import EssLatentCache
from ess.reference.model import MiniModel, random_prompts

TINY = get_config("mini", num_layers=2, index_topk=16)
BUFFER = TINY.index_topk + 8  # 24 slots against contexts of 114..160 tokens: misses happen every step


def tiny_model(seed: int = 0) -> MiniModel:
    return MiniModel(TINY, seed=seed)


def tiny_prompts(batch: int = 3, context: int = 160, seed: int = 0):
    return random_prompts(batch, context, TINY.vocab, seed, vary=23)  # unequal lengths on purpose


def dense(cfg=TINY):
    return lambda ctx, max_len: DenseLatentCache(cfg.num_layers, len(ctx), max_len, "cpu")


def ess_cache(warmup: bool, buffer: int = BUFFER):
    """A cache factory for MiniModel.generate: the ESS cache with `buffer` GPU slots, LRU-Warmup on or off."""
    cfg = EssConfig(topk=TINY.index_topk, buffer_tokens=buffer, warmup_windows=WARMUP_WINDOWS if warmup else 0)
    return lambda ctx, max_len: EssLatentCache(cfg, TINY.num_layers, ctx, max_len, "cpu")
