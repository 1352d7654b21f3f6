"""LRU-Warmup across PD disaggregation (CPU): the state a prefill node sends equals what a co-located warm-up leaves,
it travels in SGLang's real metadata buffers (copied item by item as Mooncake's send_aux copies them), and the
decode node loads it into the request's GPU slots."""

import ctypes
import random
import types

import pytest
import torch

from ess.core.policy import STAMP_MOD, lru_update
from ess.core.sparse_pool import SparseMemoryPool
from lru_oracle import OracleLRU
from sglang_ess import pd_warmup

sglang = pytest.importorskip("sglang")
from sglang.srt.disaggregation.utils import MetadataBuffers  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from sglang_ess import hooks  # noqa: E402
from sglang_fixtures import decode_request, sglang_req  # noqa: E402
from test_sglang_runtime import CTX, K, L, SLOTS, prefill_setup, rows_of, setup_runtime  # noqa: E402


def random_sets(rng, W, K, P):
    """[1, W, K] warm-up sets over positions < P, some windows short or empty."""
    sets = torch.full((1, W, K), -1)
    for w in range(W):
        n = rng.randint(0, K)
        sets[0, w, :n] = torch.tensor(rng.sample(range(P), n), dtype=torch.long)
    return sets


def test_sent_state_equals_the_colocated_warmup_and_decodes_alike():
    """For C <= N slots the loaded state (rows and stamps) is the oracle warm-up's, and the decode steps after it
    miss the same rows; with more slots than entries the N newest by (window, position) are kept."""
    rng = random.Random(3)
    K, P = 8, 70
    for trial in range(60):
        W, C = rng.randint(1, 32), rng.randint(K + 1, 4 * K)
        sets = random_sets(rng, W, K, P)
        oracle = OracleLRU(C)
        for w in range(W):
            oracle.step(sets[0, w].tolist(), -1, w - W)
        entries = pd_warmup.compact(pd_warmup.encode(sets), pd_warmup.entries_per_layer(K))
        pool = SparseMemoryPool(1, 2, C, P, "cpu")
        pos, window = pd_warmup.unpack(entries, C)
        pool.load(1, pos, window - pd_warmup.WINDOWS)
        held = {int(p): int(s) for p, s in zip(pool.slot_pos[0, 1, :C], pool.slot_stamp[0, 1, :C]) if p >= 0}
        assert held == {p: s % STAMP_MOD for p, s in oracle.stamp.items()}, trial  # the policy's modular stamps
        slots = pool.pos_slot[0, 1, :P]
        assert all(int(pool.slot_pos[0, 1, s]) == p for p, s in enumerate(slots.tolist()) if s >= 0)
        assert int((slots >= 0).sum()) == len(held)
        for t in range(4):  # decode steps: same misses as the oracle
            own, topk = P - 4 + t, rng.sample(range(P - 4 + t), K)
            got = lru_update(*pool.layer_state(0), torch.tensor([1]), torch.tensor([topk]), torch.tensor([own]), t)
            assert int(got.n_miss[0]) == oracle.step(topk, own, t)

    sets = torch.arange(40).view(1, 5, 8)  # 40 distinct positions, 8 per window
    entries = pd_warmup.compact(pd_warmup.encode(sets), 12)  # room for the 12 newest only
    pos, window = pd_warmup.unpack(entries, 64)
    assert pos.tolist() == [list(range(39, 27, -1))] and set(window[0].tolist()) == {31, 30}


def test_parts_merge_into_the_whole():
    """TBO micro-batches hold parts of a request's windows; merging their compacted parts gives the whole."""
    rng = random.Random(4)
    for _ in range(30):
        sets = random_sets(rng, 12, 8, 40)
        v = pd_warmup.encode(sets)
        cut = rng.randint(0, v.shape[1])
        n = rng.randint(4, 40)
        parts = torch.cat([pd_warmup.compact(v[:, :cut], n), pd_warmup.compact(v[:, cut:], n)], 1).long()
        assert torch.equal(pd_warmup.compact(parts, n), pd_warmup.compact(v, n))


def metadata_buffers(size):
    return MetadataBuffers(size, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=16)


def send_aux(src: MetadataBuffers, src_index: int, dst: MetadataBuffers, dst_index: int) -> None:
    """What Mooncake's send_aux does: buffer i's item src_index to the peer's buffer i, item dst_index, for the buffers
    both nodes registered."""
    sp, _, lens = src.get_buf_infos()
    dp, _, _ = dst.get_buf_infos()
    for i in range(min(len(sp), len(dp))):
        ctypes.memmove(dp[i] + lens[i] * dst_index, sp[i] + lens[i] * src_index, lens[i])


def test_warmup_state_travels_in_the_metadata_buffers(plugin, monkeypatch):
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
    monkeypatch.setattr(hooks, "_sender", sender)
    monkeypatch.setattr(hooks, "_sender_pool", target_pool)
    monkeypatch.setattr(hooks, "_wire", (L, K))
    backend = types.SimpleNamespace(token_to_kv_pool=target_pool, req_to_token=pool.req_to_token, use_fused_topk=True)
    batch = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=req,
                                  seq_lens_cpu=torch.tensor([CTX, CTX]), extend_prefix_lens_cpu=[0, CTX - 3])
    hooks.after_init_forward_metadata(None, backend, batch)
    split, total = CTX - 1, CTX + 3  # the second micro-batch holds request 0's newest window only
    for layer in range(L):
        for rows, rng_ in [(slice(0, split), (0, split)), (slice(split, total), (split, total))]:
            child = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, tbo_parent_token_range=rng_)
            hooks.around_forward_extend(lambda *a, **kw: None, backend, None, None, None,
                                        types.SimpleNamespace(layer_id=layer), child, topk_indices=topk_loc[rows])
    prefill_meta = metadata_buffers(4)  # SGLang's class, through the plugin's hook on its constructor
    reqs = [sglang_req(s, 2**63 + 1000 if i else 1000, metadata_index=i + 1)  # bootstrap rooms: unsigned 64-bit ids
            for i, s in enumerate(SLOTS)]
    for r in reqs:
        hooks.after_set_buf(None, prefill_meta, r)

    # the decode node: the same slots, an empty cache; the KV already in its host pool
    decode_rt, _ = setup_runtime(warmup=W, pool=pool)
    monkeypatch.setattr(hooks, "_runtime", decode_rt)
    decode_meta = metadata_buffers(8)
    assert decode_meta.get_buf_infos()[0][-1] == decode_meta.ess_warmup.data_ptr()  # appended by the plugin's hook
    for i, r in enumerate(reqs):
        send_aux(prefill_meta, r.metadata_buffer_index, decode_meta, 5 + i)
        decode_req = decode_request(sglang_req(r.kv.req_pool_idx, r.bootstrap_room), 5 + i)
        hooks.after_commit_transfer(None, types.SimpleNamespace(metadata_buffers=decode_meta), decode_req)

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
    monkeypatch.setattr(hooks, "_runtime", stale)
    other = decode_request(sglang_req(SLOTS[0], 77), 5)  # row 5 holds room 1000's state
    hooks.after_commit_transfer(None, types.SimpleNamespace(metadata_buffers=decode_meta), other)
    monkeypatch.setattr(hooks, "_wire", None)
    plain = metadata_buffers(4)  # a prefill node without ESS: one buffer fewer, so row 5 is not written
    assert not hasattr(plain, "ess_warmup")
    send_aux(plain, 1, decode_meta, 5)
    assert pd_warmup.read_row(decode_meta.ess_warmup[5], 1000, L, K) is not None
    assert stale.cache.sparse.resident(0, SLOTS[0]) == set()
