"""Fixtures of the plugin tests.

SGLang's GPU kernels of the DSA path are the plugin's CPU path here (sglang_ess.cpu: on a machine without CUDA
SGLang's plugin loader installs it with the plugin's hooks), as in the real server on a CPU: SGLang's own FP8 row
writer and pools, its indexer metadata and top-k, FlashMLA's interface computed in torch. No kernel is replaced by
the tests themselves.
"""

import functools
import os

import pytest
import torch


@pytest.fixture(scope="session")
def plugin():
    """SGLang's own plugin loader, restricted to ESS: its hooks then wrap the real sglang classes."""
    pytest.importorskip("sglang")
    os.environ["SGLANG_PLUGINS"] = "ess"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_ess.hooks import registry as hooks

    return hooks


@pytest.fixture(autouse=True)
def environment():
    """Resolving a `--device cpu` launch of a DSA model sets the environment of SGLang's CPU engine for the process's
    future children (as the launcher does for its scheduler processes): each test gets the environment back as it
    found it. (sgl_kernel's stand-in, which the same resolution puts on the import path where sgl_kernel cannot load,
    stays: importing sgl_kernel fails here without it.)"""
    env = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(env)


# -- the runtime tests' kit (test_sglang_runtime*.py) ------------------------------------------------------------------
# Each such module states its shape: L layers, top-k K, C GPU slots per request, a CTX-token prompt, STEPS decode steps
# and SLOTS, the request-table rows of its two requests (row 0 is SGLang's padding row). The kit reads the shape of the
# module that asks for it.


def _rows_of(loc, layer: int):
    """A distinct, recognisable 656-byte row per (layer, token location)."""
    x = (loc.long().unsqueeze(-1) * 7 + layer * 131 + torch.arange(656)) % 251
    return x.to(torch.uint8)


def _store(rt, layer, loc, rows, decode):
    """What the ESS KV pool does with a forward's new rows (test_sglang_pool checks the pool itself)."""
    rt.cache.host[layer][loc.long()] = rows
    if decode:
        rt.keep_own_rows(layer, rows)


def _random_topk(m, rng, pos):
    return [rng.sample(range(p + 1), m.K) for p in pos]


def _setup_runtime(m, tmp_path=None, rows=1, overlap="auto", warmup=32, pool=None, kernel="torch", residency=False,
                   fixed=False, requests=4, backend="torch"):
    """A runtime over SGLang's request-to-token table (pool: share another runtime's table; requests: its rows)."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from sglang_ess.args import EssArgs, EssFacts
    from sglang_ess.runtime import EssRuntime

    if pool is None:
        pool = ReqToTokenPool(requests, m.CTX + m.STEPS * rows + 1, "cpu", False)
        locs = torch.randperm(200 * 64)[: len(m.SLOTS) * pool.req_to_token.shape[1]].int()  # as scattered as an allocator's
        pool.req_to_token[m.SLOTS] = locs.view(len(m.SLOTS), -1)
    facts = EssFacts("co-located", m.K, m.L, m.CTX + m.STEPS, m.C if rows == 1 else rows * (m.K + 1) + 2, rows,
                     residency=residency, fixed_step=fixed)
    ess = EssArgs(enable=True, buffer_tokens=m.C, record_trace=str(tmp_path) if tmp_path else None, overlap=overlap,
                  warmup_windows=warmup)
    host = torch.zeros(m.L, 200 * 64 + 1, 656, dtype=torch.uint8)
    rt = EssRuntime(ess, facts, pool.req_to_token, host=host, device="cpu", backend=backend, kernel=kernel)
    for layer in range(m.L):  # prefill: every prompt token's row lands in the host pool
        loc = pool.req_to_token[m.SLOTS, :m.CTX].flatten()
        _store(rt, layer, loc, _rows_of(loc, layer), decode=False)
    return rt, pool


def _decode_and_check(m, rt, pool, rng):
    """STEPS decode steps of the two requests through swap_in_selected_pages (random top-k, each step's own rows
    stored as the pool stores them): every selected row is the right one."""
    req = torch.tensor(m.SLOTS)
    for t in range(m.STEPS):
        seq_lens = torch.full((2,), m.CTX + t + 1)
        topk = torch.tensor(_random_topk(m, rng, [m.CTX + t] * 2), dtype=torch.int32)
        for layer in range(m.L):
            own_loc = pool.req_to_token[m.SLOTS, m.CTX + t]
            _store(rt, layer, own_loc, _rows_of(own_loc, layer), True)
            slots = rt.swap_in_selected_pages(req, seq_lens, topk, layer)
            assert slots.dtype == torch.int32 and slots.shape == (2, m.K)
            got = rt.latent_buffer(layer)[slots.long(), 0]
            assert torch.equal(got, _rows_of(pool.req_to_token[req.unsqueeze(1), topk.long()], layer)), (t, layer)


def _sglang_req(slot: int | None, room: int = 0, metadata_index: int = -1, prompt: int = 3):
    """A real SGLang Req holding request-table row `slot` (0.5.23 keeps it in req.kv), as the scheduler leaves it,
    with a prompt of `prompt` tokens."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(f"r{slot}-{room}", "", [1] * prompt, SamplingParams(max_new_tokens=4), bootstrap_room=room)
    req.kv.req_pool_idx = slot
    req.metadata_buffer_index = metadata_index
    return req


@pytest.fixture(scope="session")
def rows_of():
    """rows_of(loc, layer): a distinct, recognisable 656-byte row per (layer, token location)."""
    return _rows_of


@pytest.fixture
def store():
    return _store


@pytest.fixture
def random_topk(request):
    """random_topk(rng, positions): K distinct positions at or before each position."""
    return functools.partial(_random_topk, request.module)


@pytest.fixture
def setup_runtime(request):
    """setup_runtime(...) -> (runtime, SGLang's ReqToTokenPool), the prompts' rows in the host pool."""
    return functools.partial(_setup_runtime, request.module)


@pytest.fixture
def decode_and_check(request):
    """decode_and_check(rt, pool, rng): STEPS decode steps, every row served checked."""
    return functools.partial(_decode_and_check, request.module)


@pytest.fixture
def sglang_req():
    return _sglang_req
