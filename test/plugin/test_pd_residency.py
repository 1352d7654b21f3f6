"""A PD decode node with residency first: every state change a request can undergo between its request-table row and
its KV landing (a demotion, a promotion, both, a warm-up row after the demotion, an abort, a retraction's restore),
through the runtime as the plugin's hooks drive it over SGLang's real request table. Whatever happened before, once
the KV lands every row a step reads is the token's own (docs/pd.md, "Residency first on a PD decode node")."""

import pytest
import torch

from sglang_ess.args import EssArgs, EssFacts
from sglang_ess.runtime import EssRuntime

sglang = pytest.importorskip("sglang")
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402

from sglang_ess.pd import warmup as pd_warmup  # noqa: E402

L, K, C = 2, 4, 8
ROWS = 4  # request rows 1..4 (row 0 is SGLang's padding row): a device pool of 5 x C = 40 rows
WIDTH = 48  # the request table's width
A, B, D = 1, 2, 3  # request slots
PROMPT = 30  # positions whose KV the transfer writes


def rows_of(loc: torch.Tensor, layer: int) -> torch.Tensor:
    """A distinct, recognisable 656-byte row per (layer, token location)."""
    return ((loc.long().unsqueeze(-1) * 7 + layer * 131 + torch.arange(656)) % 251).to(torch.uint8)


def pd_runtime(warmup: int = 0) -> EssRuntime:
    pool = ReqToTokenPool(ROWS, WIDTH, "cpu", False)
    assert pool.req_to_token.shape[0] == ROWS + 1
    pool.req_to_token[1:] = torch.randperm(ROWS * WIDTH).view(ROWS, WIDTH).int() + 1  # scattered, as an allocator's
    facts = EssFacts("pd-decode", K, L, WIDTH, C, residency=True)
    ess = EssArgs(enable=True, buffer_tokens=C, warmup_windows=warmup)
    host = torch.zeros(L, ROWS * WIDTH + 2, 656, dtype=torch.uint8)
    return EssRuntime(ess, facts, pool.req_to_token, host=host, device="cpu", backend="torch", kernel="torch")


def allocate(rt: EssRuntime, slot: int, positions: int) -> None:
    """SGLang gives a request a request-table row (the hooks' on-alloc callback and reach)."""
    rt.plan_positions(slot, positions)
    rt.reset_rows([slot])


def land(rt: EssRuntime, slot: int, entries=None) -> None:
    """The transfer writes the request's KV into the host pool by token location; SGLang commits it."""
    for layer in range(L):
        loc = rt.token_table[slot, :PROMPT].long()
        rt.cache.host[layer][loc] = rows_of(loc, layer)
    rt.kv_landed(slot, PROMPT)
    if entries is not None:
        rt.admit_transferred(slot, entries)


def forward(rt: EssRuntime) -> None:
    """A forward begins (of other requests: the request under test is not in it)."""
    rt.start_forward()
    rt.end_forward()


def decode_reads_true_rows(rt: EssRuntime, slot: int, topk: list[int]) -> None:
    """One decode step of the request (its own row at position PROMPT): every row delivered is the token's own."""
    rt.start_forward()
    req, top = torch.tensor([slot]), torch.tensor([topk], dtype=torch.int32)
    for layer in range(L):
        own = rt.token_table[slot, PROMPT:PROMPT + 1].long()
        rt.cache.host[layer][own] = rows_of(own, layer)
        rt.keep_own_rows(layer, rows_of(own, layer))
        slots = rt.swap_in_selected_pages(req, torch.tensor([PROMPT + 1]), top, layer)
        got = rt.latent_buffer(layer)[slots.long(), 0]
        want = rows_of(rt.token_table[slot, top.long()], layer)
        assert torch.equal(got, want), f"layer {layer}: rows {(got != want).any(-1).tolist()} are not the tokens' own"
    rt.end_forward()


def stale(rt: EssRuntime) -> None:
    """What an earlier request left in the device rows: bytes that are no token's row here."""
    rt.cache.gpu.fill_(0xEE)


def demoted_runtime(warmup: int = 0, forward_after: bool = True) -> EssRuntime:
    """A (40 positions: the whole pool) admitted resident over stale device rows, then B (8) given a row, whose
    admission at the next forward (run here unless forward_after is False) demotes A: no KV of A has landed."""
    rt = pd_runtime(warmup)
    stale(rt)
    allocate(rt, A, 40)
    forward(rt)
    assert rt.cache.resident_requests() == [A]
    allocate(rt, B, 8)
    if forward_after:
        forward(rt)
        assert rt.residency.demoted == 1 and A in rt.cache.offloaded
    return rt


def promoted_runtime(positions: int) -> EssRuntime:
    """A (`positions`) admitted offloaded beside B (32 rows of the 40), then B leaves and A is promoted, its KV not
    landed (its region gets whatever the host rows were)."""
    rt = pd_runtime()
    stale(rt)
    allocate(rt, B, 32)
    forward(rt)
    allocate(rt, A, positions)
    forward(rt)
    assert rt.cache.offloaded == {A}
    rt.release(B)
    forward(rt)
    assert rt.residency.promoted == 1 and rt.cache.resident_requests() == [A]
    return rt


def test_a_request_demoted_before_its_kv_lands_reads_its_own_rows():
    """The issue's reproduction: A (40 positions) is admitted resident, B's admission demotes it before its KV has
    landed, the transfer is committed with no warm-up row: A's held slots get their rows when the KV lands."""
    rt = demoted_runtime()
    land(rt, A)
    decode_reads_true_rows(rt, A, [0, 1, 2, 3])


def test_a_request_demoted_in_the_forward_its_kv_lands_reads_its_own_rows():
    """The same forward admits B (demoting A) and takes A's landing: the landing, applied after, fills A's slots."""
    rt = demoted_runtime(forward_after=False)
    land(rt, A)
    decode_reads_true_rows(rt, A, [0, 1, 5, 7])
    assert rt.residency.demoted == 1


def test_rows_are_admitted_in_the_order_they_were_given():
    """Requests that leave and requests that come before one forward: the newcomers are admitted in the order SGLang
    gave their rows (first come, first resident), whatever order the rows were reset in. Here the earlier request's
    row is the one let go last, so it comes after the later one's in the resets; it is admitted first all the same,
    and the later one's admission demotes it."""
    rt = pd_runtime()
    allocate(rt, B, 8)
    allocate(rt, D, 8)
    forward(rt)
    rt.release(B)
    rt.release(D)  # resets: B, D
    allocate(rt, D, 40)  # the first request given a row: D's row, reset last
    allocate(rt, B, 8)
    forward(rt)
    assert D in rt.cache.offloaded and rt.cache.resident_requests() == [B] and rt.residency.demoted == 1


def test_a_warmup_row_after_the_demotion_replaces_what_it_held():
    """Demoted before landing, then the transfer brings the prefill node's warm-up state: the state it loads is what the
    request holds, each row its own."""
    rt = demoted_runtime(warmup=32)
    entries = pd_warmup.compact(pd_warmup.encode(torch.arange(PROMPT - 6, PROMPT).expand(L, 1, 6)), 6)
    land(rt, A, entries)
    forward(rt)
    held = rt.cache.sparse.slot_pos[:, A, :C]
    assert sorted(held[0][held[0] >= 0].tolist()) == list(range(PROMPT - 6, PROMPT)) and rt.arrivals.warm_loaded == 1
    decode_reads_true_rows(rt, A, [PROMPT - 1, PROMPT - 2, 0, 1])


def test_a_request_promoted_before_its_kv_lands_is_filled_when_it_lands():
    """A is admitted offloaded (B holds all but C rows), B leaves, A is promoted before its KV has landed (its region gets
    whatever the host rows were): the landing fills it again."""
    rt = promoted_runtime(30)
    land(rt, A)
    decode_reads_true_rows(rt, A, [0, 9, 17, 29])


def test_promoted_then_demoted_before_its_kv_lands():
    rt = promoted_runtime(35)  # 40 rows: the whole pool
    allocate(rt, D, 8)
    forward(rt)
    assert A in rt.cache.offloaded and rt.residency.demoted == 1 and rt.residency.promoted == 1
    land(rt, A)
    decode_reads_true_rows(rt, A, [3, 2, 1, 0])


@pytest.mark.parametrize("landed", [False, True])
@pytest.mark.parametrize("reused", [False, True])
def test_an_abort_before_the_landing_leaves_nothing_for_the_row_s_next_request(landed, reused):
    """A demoted, then aborted (before its KV landed, or after the commit but before a forward took it): its row's next
    request (given the row before the next forward, or after it) starts with nothing held, and reads its own rows."""
    rt = demoted_runtime()
    if landed:
        land(rt, A)
    rt.release(A)
    rt.release(B)
    if not reused:
        forward(rt)
        assert not bool(rt.cache.is_resident.any()), "a freed slot still counts as resident"
        assert int((rt.cache.sparse.slot_pos[:, A] >= 0).sum()) == 0
    allocate(rt, A, 40)
    forward(rt)
    assert int((rt.cache.sparse.slot_pos[:, A] >= 0).sum()) == 0 and rt.cache.resident_requests() == [A]
    land(rt, A)
    decode_reads_true_rows(rt, A, [4, 3, 2, 1])
    assert rt.arrivals.filled_from_host == 1


def test_a_retracted_request_restored_from_its_backup_reads_its_own_rows():
    """SGLang's PD decode retraction (cpu_tensor backup): the request lets go of its row, later gets a new one and its
    KV back into the host pool (the pool's load_cpu_copy tells the runtime, as a transfer's commit does: tested with
    the real pool in test_sglang_pool.py). Demoted before the restore reached it, it still reads its own rows."""
    rt = pd_runtime()
    allocate(rt, A, 40)
    forward(rt)
    land(rt, A)
    forward(rt)
    rt.release(A)  # retracted
    forward(rt)
    stale(rt)
    allocate(rt, D, 40)  # its new row
    forward(rt)
    allocate(rt, B, 8)
    forward(rt)
    assert D in rt.cache.offloaded
    land(rt, D)  # the restore
    decode_reads_true_rows(rt, D, [0, 1, 2, 28])
