"""Progressive PD's wire, without a transfer: how the prefill node splits a request's last chunk into its parts
(sglang_ess.pd.sending: phase 1, the warm-up pages in heat order, the rest in slices, each page once, against brute
force, and SGLang's chunk fields of each part), and the progress and need messages between the nodes
(sglang_ess.pd.engines, sglang_ess.pd.sending), a malformed one dropped at no cost."""

import types

import pytest

from sglang_ess.pd import engines as pd_engines
from sglang_ess.pd import sending as pd_sending

sglang = pytest.importorskip("sglang")
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402


def test_parts_send_each_page_of_the_last_chunk_once_in_the_progressive_order(plugin):
    """The parts of a last chunk against brute force: phase 1 and end carry no page; phase 2 the chunk's warm-up
    pages in heat order; phase 3 the rest ascending in slices; every page once. SGLang's chunk fields follow."""
    import random

    import numpy as np
    from sglang.srt.disaggregation.common.utils import TransferKVChunk

    mp = pd_sending
    rng = random.Random(3)
    for _ in range(200):
        first, count, step = rng.randrange(0, 9), rng.randrange(1, 30), rng.randrange(1, 6)
        hot = np.array(rng.sample(range(40), rng.randrange(0, 12)))
        got = mp.parts(first, count, hot, step)
        kinds = [k for k, _ in got]
        assert kinds[0] == "phase1" and kinds[1] == "phase2" and kinds[-1] == "end" and not len(got[0][1] + got[-1][1])
        warm = [p for p in hot.tolist() if first <= p < first + count]
        warm += [first + count - 1] if first + count - 1 not in warm else []  # the prompt's last page: before decode
        rest = [p for p in range(first, first + count) if p not in warm]
        assert got[1][1].tolist() == warm
        assert [p for _, pages in got[2:-1] for p in pages.tolist()] == rest
        assert all(k == "phase3" and 0 < len(p) <= step for k, p in got[2:-1])
    kv = np.arange(100, 110, dtype=np.int32)  # the prefill pages of send indices 4 .. 13
    chunk = TransferKVChunk(room=5, prefill_kv_indices=kv, index_slice=slice(4, 14), is_last_chunk=True,
                            prefill_aux_index=2, state_indices=[[1, 2]])
    parts = mp.split(chunk, prefix_pages=1, hot=np.array([12, 9, 3]))  # the chunk is pages 5 .. 14
    slices = -(-7 // mp.SLICE_PAGES)  # phase 3: the chunk's 7 other pages
    assert [p.ess.kind for p in parts] == ["phase1", "phase2", *["phase3"] * slices, "end"]
    assert parts[1].ess.pages.tolist() == [12, 9, 14] and parts[1].prefill_kv_indices.tolist() == [107, 104, 109]
    assert parts[1].index_slice.tolist() == [11, 8, 13]
    assert [p.is_last_chunk for p in parts] == [True, *[False] * (1 + slices), True]
    assert [p.prefill_aux_index for p in parts] == [2, *[None] * (1 + slices), 2]
    assert parts[0].state_indices == [[1, 2]] and all(p.state_indices is None for p in parts[1:])


def test_malformed_progress_and_need_messages_are_dropped(plugin):
    """A bad message costs nothing but itself: the threads that read them go on, nothing is recorded."""
    mp, note, pd = pd_engines, pd_sending.note_need, plugin.state.pd
    mgr = types.SimpleNamespace(request_status={1: None}, required_prefill_response_num_table={1: 1})
    assert mp.take(pd, [mp.TAG, b"not a room", b"phase1", b"3"], mgr) is True
    assert mp.take(pd, [mp.TAG, b"1", b"phase9", b""], mgr) is True
    assert mp.take(pd, [mp.TAG, b"1"], mgr) is True and pd.inbox == {}
    assert mp.take(pd, [b"other"], mgr) is False
    mgr.required_prefill_response_num_table[1] = 2  # a room several prefill ranks serve: its reports are not read
    assert mp.take(pd, [mp.TAG, b"1", b"phase3", b""], mgr) is True and pd.inbox == {}
    sending = types.SimpleNamespace(transfer_infos={7: {}}, request_status={7: KVPoll.Transferring}, failure_records={},
                                    check_status=lambda room: KVPoll.Transferring)
    assert note(pd, [mp.NEED, b"7", b"x", b""], sending) is True and pd.take_need(7) is None
    assert note(pd, [mp.NEED, b"8", b"0", b""], sending) is True and pd.take_need(8) is None  # not sent here
    assert note(pd, [b"ROOM"], sending) is False
