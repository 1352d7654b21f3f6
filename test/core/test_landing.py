"""Progressive PD transfer, the core pieces (CPU, exact): the decode node's landed tracker and the prefill node's
send order (docs/pd.md, "Progressive PD transfer")."""

import random

import torch

from ess.core.landed_rows import LandingTracker
from ess.core.send_order import send_order


def brute_ready(landed: dict, base: dict, lengths: dict, page: int, req: list, miss: list, layer: int) -> list:
    out = []
    for r, ms in zip(req, miss):
        if r not in lengths:
            out.append(True)
            continue
        ok = base[r] and all(p < 0 or p >= lengths[r] or (layer, p // page) in landed[r] for p in ms)
        out.append(ok)
    return out


def test_ready_equals_a_brute_force_check_over_random_landings():
    rng = random.Random(5)
    L, P, rows = 3, 200, 9
    for trial in range(40):
        page = rng.choice([1, 4, 64])
        tr = LandingTracker(L, P, requests=4, table_rows=rows, device="cpu", page=page)
        landed, base, lengths = {}, {}, {}
        for r in rng.sample(range(1, rows), 4):
            n = rng.randint(1, P)
            assert tr.open(r, n)
            landed[r], base[r], lengths[r] = set(), False, n
            if rng.random() < 0.8:
                tr.mark_base(r)
                base[r] = True
            pages = -(-n // page)
            for _ in range(rng.randint(0, 6)):
                pg = torch.tensor(rng.sample(range(pages), rng.randint(1, pages)))
                ly = None if rng.random() < 0.5 else torch.tensor(rng.sample(range(L), rng.randint(1, L)))
                tr.mark_landed(r, pg, ly)
                for layer in (range(L) if ly is None else ly.tolist()):
                    landed[r] |= {(layer, int(p)) for p in pg}
        assert not tr.open(0, 5)  # every slot taken: that request waits for its whole transfer
        B, M = 6, 7
        req = [rng.randrange(rows) for _ in range(B)]
        miss = [[rng.choice([-1, rng.randrange(P + 20)]) for _ in range(M)] for _ in range(B)]
        for layer in range(L):
            got = tr.ready(torch.tensor(req, dtype=torch.int32), torch.tensor(miss, dtype=torch.int32), layer)
            assert got.dtype == torch.bool and got.tolist() == brute_ready(landed, base, lengths, page, req, miss, layer), trial
            for r, ms in zip(req, miss):  # the pages a waiting step names to the prefill node
                want = sorted({p // page for p in ms if 0 <= p < lengths.get(r, 0)} - {q for ly, q in landed.get(r, ())
                                                                                       if ly == layer})
                assert tr.unlanded_pages(r, torch.tensor(ms), layer).tolist() == want, trial


def test_a_request_becomes_ready_as_its_pages_land_and_its_slot_is_reused_clean():
    tr = LandingTracker(2, 256, requests=1, table_rows=4, device="cpu", page=64)
    assert tr.open(2, 130)  # pages 0, 1, 2 (the last partial)
    req, miss = torch.tensor([2, 1]), torch.tensor([[5, 129], [3, -1]])
    assert tr.ready(req, miss, 0).tolist() == [False, True]  # nothing landed, not even phase 1; row 1 is untracked
    tr.mark_base(2)
    tr.mark_landed(2, torch.tensor([0]))
    assert tr.ready(req, miss, 0).tolist() == [False, True]  # 129 is on page 2
    tr.mark_landed(2, torch.tensor([2]), torch.tensor([1]))
    assert tr.ready(req, miss, 0).tolist() == [False, True] and tr.ready(req, miss, 1).tolist() == [True, True]
    assert tr.ready(req, torch.tensor([[130, 200], [-1, -1]]), 0).tolist() == [True, True]  # decoded rows: local
    assert not tr.complete(2)
    tr.mark_landed(2, torch.tensor([1, 2]))
    assert tr.complete(2)
    tr.close(2)
    tr.close(2)  # idempotent
    assert tr.open(3, 64)  # the freed slot starts from nothing landed
    assert tr.ready(torch.tensor([3, 2]), torch.tensor([[0], [0]]), 0).tolist() == [False, True]
    assert tr.open_rows() == [3] and int((tr.slot_of >= 0).sum()) == 1


def brute_order(positions, windows, prompt_len, page):
    heat = {}
    for p, w in zip(positions.flatten().tolist(), windows.flatten().tolist()):
        if 0 <= p < prompt_len:
            newest, n = heat.get(p // page, (-1, 0))
            heat[p // page] = (max(newest, w), n + 1)
    hot = sorted(heat, key=lambda g: (-heat[g][0], -heat[g][1], g))
    rest = [g for g in range(-(-prompt_len // page)) if g not in heat]
    return hot, rest


def test_send_order_is_hottest_first_then_the_rest_ascending():
    rng = random.Random(6)
    for trial in range(50):
        L, N, n, page = rng.randint(1, 4), rng.randint(1, 30), rng.randint(1, 400), rng.choice([1, 8, 64])
        positions = torch.tensor([[rng.choice([-1, rng.randrange(n + 10)]) for _ in range(N)] for _ in range(L)])
        windows = torch.tensor([[rng.randrange(32) for _ in range(N)] for _ in range(L)])
        hot, rest = send_order(positions, windows, n, page)
        assert (hot.tolist(), rest.tolist()) == brute_order(positions, windows, n, page), trial
        assert sorted(hot.tolist() + rest.tolist()) == list(range(-(-n // page)))  # every page once
    # the newest window wins over the count; then the count; then the page
    hot, rest = send_order(torch.tensor([[0, 1, 64, 200]]), torch.tensor([[3, 3, 9, 3]]), 256, 64)
    assert hot.tolist() == [1, 0, 3] and rest.tolist() == [2]


def test_ready_needs_no_host_value():
    """On the meta device a tensor has no values: anything that reads one on the host (.item(), nonzero, a
    data-dependent shape) fails there, so `ready` can sit inside a captured step."""
    tr = LandingTracker(2, 256, requests=2, table_rows=4, device="meta", page=64)
    got = tr.ready(torch.empty(3, dtype=torch.int32, device="meta"), torch.empty(3, 5, dtype=torch.int32, device="meta"), 1)
    assert got.shape == (3,) and got.dtype == torch.bool
