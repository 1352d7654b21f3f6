"""The runtime's LRU-Warmup on the CPU: from a prefill forward's top-k against the oracle LRU (positions, and SGLang's
fused top-k split between TBO micro-batches), and across PD disaggregation through SGLang's metadata buffers (the
prefill node's hooks write the state, the decode node's load it; a malformed record ends its own request only). The
runtime kit (setup_runtime, rows_of, ...) is conftest.py's."""

import ctypes
import random
import types

import pytest
import torch

from ess.reference.lru_oracle import OracleLRU

sglang = pytest.importorskip("sglang")
from sglang.srt.disaggregation.utils import MetadataBuffers  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from sglang_ess.hooks import registry as hooks  # noqa: E402
from sglang_ess.pd import warmup as pd_warmup  # noqa: E402

L, K, C, CTX, STEPS = 2, 8, 12, 40, 12  # the runtime kit's shape (conftest.py)
SLOTS = [3, 1]  # SGLang request-pool slots of the two requests (slot 0 is SGLang's padding row)


def prefill_rows(rng, pool, ext):
    """An extend forward of both requests by ext tokens each (ending at CTX): per query row, its top-k positions
    among [0, p] (-1 padded) and the same as token locations (SGLang's fused top-k)."""
    topk, loc = [], []
    for slot, n in zip(SLOTS, ext):
        for p in range(CTX - n, CTX):
            pos = rng.sample(range(p + 1), min(K, p + 1)) + [-1] * max(0, K - p - 1)
            topk.append(pos)
            loc.append([int(pool.req_to_token[slot, q]) if q >= 0 else -1 for q in pos])
    return torch.tensor(topk), torch.tensor(loc)


@pytest.fixture
def prefill_setup(setup_runtime):
    def setup(seed, W):
        """A runtime with W warm-up windows, and the prefill forward of both requests (request 0 all CTX tokens,
        request 1 its last 3): (runtime, token pool, request slots, extend lengths, top-k positions, top-k locations)."""
        rt, pool = setup_runtime(warmup=W)
        ext = [CTX, 3]
        topk, topk_loc = prefill_rows(random.Random(seed), pool, ext)
        return rt, pool, torch.tensor(SLOTS), ext, topk, topk_loc

    return setup


def test_prefill_top_k_warms_decode_up(setup_runtime, rows_of, prefill_setup):
    """LRU-Warmup from the last W prefill query rows, against the oracle LRU: request 0 prefills CTX tokens, request
    1 only its last 3 (a cached prefix), fewer than W. Planning forgets earlier GPU rows. Then the same with SGLang's
    fused top-k (locations) split between two TBO micro-batches inside request 0's windows: same tables."""
    W = 4
    rt, pool, req, ext, topk, topk_loc = prefill_setup(5, W)
    rt.swap_in_selected_pages(req, torch.full((2,), CTX + 1), topk[:2], 0)  # earlier GPU rows, to be forgotten
    rt.plan_prefill(req, ext)
    for layer in range(L):
        rt.warm_from_prefill(layer, topk)
    ends = [CTX, CTX + 3]
    for i, slot in enumerate(SLOTS):
        oracle = OracleLRU(C)
        for w in range(W):
            row = ends[i] - W + w
            oracle.step(topk[row].tolist() if row >= ends[i] - ext[i] else [], -1, w - W)
        for layer in range(L):
            assert rt.cache.sparse.resident(layer, slot) == set(oracle.stamp), (slot, layer)
            pos, slots = rt.cache.sparse.resident_slots(layer, torch.tensor([slot]))
            held = pos >= 0
            want = rows_of(pool.req_to_token[slot, pos[held]], layer)
            assert torch.equal(rt.cache.gpu[layer][slots[held]], want)

    tbo, _ = setup_runtime(warmup=W, pool=pool)
    tbo.swap_in_selected_pages(req, torch.full((2,), CTX + 1), topk[:2], 0)  # the same stamp as rt
    inverse = torch.full((200 * 64,), -1, dtype=torch.int64)
    for slot in SLOTS:
        inverse[pool.req_to_token[slot, :CTX].long()] = torch.arange(CTX)
    to_positions = lambda loc: torch.where(loc >= 0, inverse[loc.clamp(min=0)], -1)  # noqa: E731
    tbo.plan_prefill(req, ext)
    split, total = CTX - 2, CTX + 3
    for layer in range(L):
        tbo.warm_from_prefill(layer, topk_loc[:split], to_positions, (0, split))
        tbo.warm_from_prefill(layer, topk_loc[split:], to_positions, (split, total))
    def state(runtime, layer, slot):  # position -> stamp, and each position's GPU row (the slot holding it may differ)
        sp = runtime.cache.sparse
        held = {int(p): (int(s), j) for j, (p, s) in enumerate(zip(sp.slot_pos[layer, slot], sp.slot_stamp[layer, slot]))
                if p >= 0 and j < sp.capacity}
        rows = {p: runtime.cache.gpu[layer][slot * sp.capacity + j] for p, (_, j) in held.items()}
        return {p: s for p, (s, _) in held.items()}, rows

    for layer in range(L):
        for slot in SLOTS:
            (a, rows_a), (b, rows_b) = state(tbo, layer, slot), state(rt, layer, slot)
            assert a == b and a and all(torch.equal(rows_a[p], rows_b[p]) for p in a), (layer, slot)
    rt.release(SLOTS[0])
    rt.start_forward()  # the release takes effect in the next forward's order
    assert rt.cache.sparse.resident(0, SLOTS[0]) == set() and rt.cache.sparse.resident(0, SLOTS[1])


# -- LRU-Warmup across PD disaggregation, through SGLang's metadata buffers --------------------------------------------


def decode_request(req, metadata_index: int):
    """SGLang's DecodeRequest of a PD decode node for `req` (no receiver: the transfer is over when the hook runs)."""
    from sglang.srt.disaggregation.decode import DecodeRequest

    return DecodeRequest(req=req, kv_receiver=None, metadata_buffer_index=metadata_index)


def metadata_buffers(size):
    return MetadataBuffers(size, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=16)


def send_aux(src: MetadataBuffers, src_index: int, dst: MetadataBuffers, dst_index: int) -> None:
    """What Mooncake's send_aux does: buffer i's item src_index to the peer's buffer i, item dst_index, for the buffers
    both nodes registered."""
    sp, _, lens = src.get_buf_infos()
    dp, _, _ = dst.get_buf_infos()
    for i in range(min(len(sp), len(dp))):
        ctypes.memmove(dp[i] + lens[i] * dst_index, sp[i] + lens[i] * src_index, lens[i])


def test_a_malformed_pd_warmup_record_ends_its_own_request_only(plugin, monkeypatch, caplog, setup_runtime, sglang_req):
    """The wire is input: a decode node that receives a warm-up row it cannot load (a position past the request, a
    position twice in a layer, a stray negative entry) aborts that request with the reason (SGLang's transfer queue
    then streams the abort and releases it), loads nothing of it, and serves the others; the runtime's own entry
    refuses such entries too, before anything reads them."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    L_, K_ = L, K
    n = pd_warmup.entries_per_layer(K_)
    good = torch.full((L_, n), -1, dtype=torch.int32)
    good[:, :3] = torch.tensor([5 * 32 + 31, 3 * 32 + 30, 1 * 32 + 2], dtype=torch.int32)
    assert pd_warmup.check_entries(good, CTX) is None
    past, twice, stray = good.clone(), good.clone(), good.clone()
    past[1, 0] = (CTX + 7) * 32 + 31
    twice[0, 1] = 5 * 32 + 3
    stray[0, 5] = -9
    assert pd_warmup.check_entries(past, CTX) == f"position {CTX + 7} beyond the request's {CTX} tokens"
    assert pd_warmup.check_entries(twice, CTX) == "a position twice in one layer"
    assert pd_warmup.check_entries(stray, CTX) == "a negative entry other than -1"

    rt, _ = setup_runtime(warmup=4)
    monkeypatch.setattr(hooks.state, "runtime", rt)
    monkeypatch.setattr(hooks.state.pd, "wire", (L_, K_))
    meta = metadata_buffers(4)
    for i, entries in enumerate([past, good]):
        pd_warmup.write_row(meta.ess_warmup[i], L_, n, entries, 4, 1000 + i)
        req = sglang_req(SLOTS[i], 1000 + i, prompt=CTX)
        with caplog.at_level("WARNING", logger="sglang_ess"):
            hooks.pd.after_commit_transfer(None, types.SimpleNamespace(metadata_buffers=meta), decode_request(req, i))
        reqs = reqs + [req] if i else [req]
    rt.start_forward()
    assert "PD warm-up metadata of request 1000 is malformed (position" in caplog.text
    assert isinstance(reqs[0].finished_reason, FINISH_ABORT) and "malformed" in reqs[0].finished_reason.message
    assert reqs[1].finished_reason is None
    assert rt.cache.sparse.resident(0, SLOTS[0]) == set()  # nothing of it loaded
    assert rt.cache.sparse.resident(0, SLOTS[1]) == {5, 3, 1}  # the other request's warm-up loaded
    for bad, why in ((past, "beyond the request's"), (twice, "twice"), (stray, "negative"), (good[:1], "shape")):
        with pytest.raises(ValueError, match=why):
            rt.admit_transferred(SLOTS[0], bad, positions=CTX)


def test_warmup_state_travels_in_the_metadata_buffers(plugin, monkeypatch, setup_runtime, rows_of, sglang_req,
                                                      prefill_setup):
    """Prefill node: the hooks plan and record through a prefill forward split into two TBO micro-batches, from
    SGLang's fused top-k (token locations), and write the request's metadata row. The row travels as Mooncake sends
    it. Decode node: the commit hook loads it, and the GPU slots hold what a co-located warm-up from the same top-k
    holds (the same rows and stamps, byte-identical row contents). A stale row (another request's, or a prefill
    node without ESS) is ignored."""
    W = 4
    colocated, pool, req, ext, topk, topk_loc = prefill_setup(6, W)
    colocated.plan_prefill(req, ext)
    for layer in range(L):
        colocated.warm_from_prefill(layer, topk)

    # the prefill node (its pool: a stand-in object; its req_to_token: the same table)
    target_pool = object()
    sender = pd_warmup.WarmupSender(L, K, W, pool.req_to_token, 200 * 64 + 1)
    monkeypatch.setattr(hooks.state.pd, "sender", sender)
    monkeypatch.setattr(hooks.state.pd, "sender_pool", target_pool)
    monkeypatch.setattr(hooks.state.pd, "wire", (L, K))
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod

    backend = types.SimpleNamespace(token_to_kv_pool=target_pool, req_to_token=pool.req_to_token, use_fused_topk=True,
                                    get_topk_transform_method=lambda mode: TopkTransformMethod.PAGED)
    batch = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=req,
                                  seq_lens_cpu=torch.tensor([CTX, CTX]), extend_prefix_lens_cpu=[0, CTX - 3])
    hooks.forward.after_init_forward_metadata(None, backend, batch)
    split, total = CTX - 1, CTX + 3  # the second micro-batch holds request 0's newest window only
    for layer in range(L):
        for rows, rng_ in [(slice(0, split), (0, split)), (slice(split, total), (split, total))]:
            child = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, tbo_parent_token_range=rng_)
            hooks.forward.around_forward_extend(lambda *a, **kw: None, backend, None, None, None,
                                        types.SimpleNamespace(layer_id=layer), child, topk_indices=topk_loc[rows])
    prefill_meta = metadata_buffers(4)  # SGLang's class, through the plugin's hook on its constructor
    reqs = [sglang_req(s, 2**63 + 1000 if i else 1000, metadata_index=i + 1)  # bootstrap rooms: unsigned 64-bit ids
            for i, s in enumerate(SLOTS)]
    for r in reqs:
        hooks.pd.after_set_buf(None, prefill_meta, r)

    # the decode node: the same slots, an empty cache; the KV already in its host pool
    decode_rt, _ = setup_runtime(warmup=W, pool=pool)
    monkeypatch.setattr(hooks.state, "runtime", decode_rt)
    decode_meta = metadata_buffers(8)
    assert decode_meta.get_buf_infos()[0][-1] == decode_meta.ess_warmup.data_ptr()  # appended by the plugin's hook
    for i, r in enumerate(reqs):
        decode_rt.reset_rows([r.kv.req_pool_idx])  # SGLang's prealloc handed the row out (its on-alloc-rows callback)
        send_aux(prefill_meta, r.metadata_buffer_index, decode_meta, 5 + i)
        decode_req = decode_request(sglang_req(r.kv.req_pool_idx, r.bootstrap_room, prompt=CTX), 5 + i)
        hooks.pd.after_commit_transfer(None, types.SimpleNamespace(metadata_buffers=decode_meta), decode_req)
    decode_rt.start_forward()  # the reset, then the load, in the next forward's order

    for slot in SLOTS:
        for layer in range(L):
            def state(rt):
                sp = rt.cache.sparse
                return {int(p): int(s) for p, s in zip(sp.slot_pos[layer, slot], sp.slot_stamp[layer, slot]) if p >= 0}
            assert state(decode_rt) and state(decode_rt) == state(colocated), (slot, layer)
            pos, slots = decode_rt.cache.sparse.resident_slots(layer, torch.tensor([slot]))
            held = pos >= 0
            assert torch.equal(decode_rt.cache.gpu[layer][slots[held]], rows_of(pool.req_to_token[slot, pos[held]], layer))

    stale, _ = setup_runtime(warmup=W, pool=pool)
    monkeypatch.setattr(hooks.state, "runtime", stale)
    other = decode_request(sglang_req(SLOTS[0], 77), 5)  # row 5 holds room 1000's state
    hooks.pd.after_commit_transfer(None, types.SimpleNamespace(metadata_buffers=decode_meta), other)
    stale.start_forward()
    monkeypatch.setattr(hooks.state.pd, "wire", None)
    plain = metadata_buffers(4)  # a prefill node without ESS: one buffer fewer, so row 5 is not written
    assert not hasattr(plain, "ess_warmup")
    send_aux(plain, 1, decode_meta, 5)
    assert pd_warmup.read_row(decode_meta.ess_warmup[5], 1000, L, K) is not None
    assert stale.cache.sparse.resident(0, SLOTS[0]) == set()
