"""The decode benchmark's stack under two-batch overlap (ess.reference.decode_stack.TwoBatch): the stages run in
SGLang's order, so each micro-batch's H2D is in flight while the other runs its experts and all-to-all; and the two
micro-batches give the outputs one stack gives them."""

import torch

from ess.reference.config import get_config
from ess.reference.decode_stack import Setup, Stack, TwoBatch
from ess.reference.ess_cache import EssLatentCache
from ess.reference.layer_rest import LayerRest, MoeShape, RestWeights

CONTEXT, BATCH, STEPS = 256, 4, 2


def setup() -> tuple[Setup, callable, torch.Tensor]:
    cfg = get_config("mini", num_layers=2)
    s = Setup(cfg, 2, [CONTEXT], [0.6], [1], STEPS - 1, 1, torch.device("cpu"), "reference", None, tbo=True)
    shape = MoeShape.mini(cfg.hidden, cfg.vocab)
    weights = RestWeights.random(shape, 32, torch.float32, s.device)

    def rest(attn, tokens):
        return LayerRest(shape, attn, weights, tokens, 32, 1.0, 2.0)

    g = torch.Generator().manual_seed(0)  # each step's and layer's top-k: distinct positions of the context
    topk = torch.stack([torch.randperm(CONTEXT, generator=g)[: cfg.index_topk] for _ in range(STEPS * 2 * BATCH)])
    return s, rest, topk.reshape(STEPS, 2, BATCH, -1).to(torch.int32)


def test_a_micro_batchs_h2d_is_in_flight_under_the_others_experts(monkeypatch):
    s, rest, topk = setup()
    pair = TwoBatch(s, BATCH, CONTEXT, 154, 1, topk, None, rest=rest)
    name = {id(h.cache): "AB"[i] for i, h in enumerate(pair.halves)}
    owner = {id(h.rest): "AB"[i] for i, h in enumerate(pair.halves)}
    log = []
    fetch, backup, routed = EssLatentCache.fetch, EssLatentCache.backup_own, LayerRest.routed
    monkeypatch.setattr(EssLatentCache, "fetch", lambda c, *a, **k: (log.append(name[id(c)] + " h2d"), fetch(c, *a, **k))[1])
    monkeypatch.setattr(EssLatentCache, "backup_own",
                        lambda c, *a, **k: (log.append(name[id(c)] + " core"), backup(c, *a, **k))[1])
    monkeypatch.setattr(LayerRest, "routed", lambda r: (log.append(owner[id(r)] + " experts"), routed(r))[1])
    pair.step(1, "dba")
    assert log.count("A h2d") == log.count("B h2d") == 2  # a launch a layer and micro-batch (the layer's misses)
    for mb, other in ("AB", "BA"):
        launches = [i for i, x in enumerate(log) if x == f"{mb} h2d"]
        cores = [i for i, x in enumerate(log) if x == f"{mb} core"]
        for h2d, core in zip(launches, cores):  # between the launch and the attention that waits for it
            between = log[h2d:core]
            if h2d:  # the first layer of A has nothing of B's before it
                assert f"{other} experts" in between, (mb, log)


def test_two_micro_batches_give_what_one_stack_gives():
    """Lossless: the pair's attention outputs are each half's own stack's, in every mode (none exactly, the split
    modes up to their log-sum-exp merge), the pair's micro-batches replaying their rows of the batch's top-k."""
    s, rest, topk = setup()
    for mode in ("none", "da", "dba"):
        pair = TwoBatch(s, BATCH, CONTEXT, 154, 1, topk, None, rest=rest)
        got = pair.step(0, mode)
        solo = []
        for i, part in enumerate([slice(0, 2), slice(2, 4)]):
            one = Stack(s, 2, CONTEXT, 154, 1, topk[:, :, part].contiguous(), None, seed=i, rest=rest,
                        weights=pair.halves[0].w)
            solo.append(one.step(0, "none"))
        for li, o in enumerate(got):
            want = torch.cat([solo[0][li], solo[1][li]])
            assert (o - want).abs().max() <= (0.0 if mode != "da" else 1e-5), (mode, li)
