"""The plugin's prefill admission (sglang_ess.hooks.forward.around_add_one_req): a prefill batch's staged rows stay
within the staging buffer sizing charged."""

import pytest

pytest.importorskip("sglang")


def test_prefill_admission_keeps_the_staged_tokens_within_the_charged_buffer(plugin, monkeypatch):
    """A prefill batch stages its requests' cached prefixes and this round's chunks; the scheduler's admission
    (PrefillAdder.add_one_req) stops adding requests where the batch would pass the staging rows sizing charged. The
    adder is a stand-in: a real PrefillAdder needs a tree cache, a KV allocator and a running ScheduleBatch, and the
    hook reads its can_run_list and rem_chunk_tokens only (its target's signature: test_sglang_plugin); the requests
    are SGLang's, placed as its admission places them (extend_end: prefix + chunk)."""
    import array
    import types

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.schedule_policy import AddReqResult
    from sglang.srt.sampling.sampling_params import SamplingParams

    def req(n, prefix=0):
        r = Req(f"r{n}", "", array.array("q", range(n)), SamplingParams(max_new_tokens=4))  # token ids as SGLang keeps them
        r.refresh_fill_ids()
        r.prefix_len = prefix  # the radix cache's match
        return r

    def admit(adder, r, *a, **kw):  # SGLang's own admission, which the hook wraps: a chunk of what is left
        chunk = min(len(r.full_untruncated_fill_ids) - r.prefix_len, adder.rem_chunk_tokens)
        r.extend_end = r.prefix_len + chunk
        adder.rem_chunk_tokens -= chunk
        adder.can_run_list.append(r)
        return AddReqResult.CONTINUE

    def add(adder, r):
        return plugin.forward.around_add_one_req(admit, adder, r, False, None)

    monkeypatch.setattr(plugin.state, "stage_tokens", 20)
    adder = types.SimpleNamespace(can_run_list=[], rem_chunk_tokens=100)
    assert add(adder, req(30)) == AddReqResult.CONTINUE  # alone: fits
    adder = types.SimpleNamespace(can_run_list=[], rem_chunk_tokens=100)
    for r, want in [(req(6), AddReqResult.CONTINUE), (req(10, prefix=6), AddReqResult.CONTINUE),
                    (req(5), AddReqResult.OTHER)]:  # 6 + (6 + 4) staged, 5 more would pass 20
        assert add(adder, r) == want
    assert [r.extend_end for r in adder.can_run_list] == [6, 10]
    # a chunked batch stages the chunk, not the whole prompt: 12 + 8 (of 30) fit
    adder = types.SimpleNamespace(can_run_list=[], rem_chunk_tokens=20)
    assert add(adder, req(12)) == AddReqResult.CONTINUE and adder.rem_chunk_tokens == 8
    assert add(adder, req(30)) == AddReqResult.CONTINUE and adder.can_run_list[-1].extend_end == 8
    # with a cached prefix the prefix is staged too: 12 + (4 + 8) passes 20
    adder = types.SimpleNamespace(can_run_list=[], rem_chunk_tokens=20)
    add(adder, req(12))
    assert add(adder, req(30, prefix=4)) == AddReqResult.OTHER
    monkeypatch.setattr(plugin.state, "stage_tokens", None)  # no ESS runtime in this process: SGLang's admission
    assert add(adder, req(50)) == AddReqResult.CONTINUE
