"""The plugin's test of record: real SGLang servers on this CPU, `python -m sglang.launch_server --device cpu
--kv-cache-dtype fp8_e4m3` on a tiny random DeepSeek-V3.2 checkpoint (`ess tiny-checkpoint`), stock and with
`--enable-ess --ess-buffer-tokens 96`, real HTTP requests, greedy tokens compared request by request.

The ESS server's plan mixes the overlap modes across the two layers (none on layer 0, DA on layer 1): with
`--ess-overlap none` or `da` alike the ESS server reads the same rows with the same kernel as stock SGLang, so its
tokens must equal stock's exactly, always. (DBA needs SGLang's two-batch overlap, which the CPU path does not run;
test_sglang_plugin checks its refusal without it.) A second pair of servers runs MTP (EAGLE, one draft token):
verify steps through ESS, tokens equal too, and again on DeepSeek's FP8 checkpoint format. A third pair serves with a disk tier whose page file is changed under
the ESS server: the one request that reads a changed page is aborted, the others get stock's tokens. With residency
first, both paths (docs/plugin.md, "Two paths") and each time a resident request's rows must reach the host pool (a
demotion mid-decode, the radix cache's next turn) give stock's tokens too.

Every workload waits for the previous one (ess.harness.servers): a server's batches then depend on the calls only,
not on timing, so stock and ESS compute the same batches (SGLang's CPU kernels are not batch-invariant).
"""

import glob
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang")

from ess.core.disk_tier import DISK_PAGE  # noqa: E402
from ess.reference import checkpoint  # noqa: E402
from ess.harness import servers as S  # noqa: E402

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-dsv32")
    checkpoint.write(str(out), seed=0)
    return str(out)


def run_pair(tmp_path, model, stock_flags, ess_flags, workload, env=None):
    """Start a stock and an ESS server together (env: beside this process's environment), then run
    `workload(server, is_ess)` on each in turn. Returns {"stock": result, "ess": result} and the ESS server's state
    readout after the workload."""
    servers = {"stock": S.Server(model, S.CPU_FLAGS + stock_flags, str(tmp_path / "stock.log"), env=dict(env or {})),
               "ess": S.Server(model, S.CPU_FLAGS + stock_flags + ess_flags, str(tmp_path / "ess.log"),
                               env=dict(env or {}))}
    try:
        S.start_all(list(servers.values()))  # they load together; one whose port was taken first starts again
        results = {name: workload(srv, name == "ess") for name, srv in servers.items()}
        readout = servers["ess"].state()
        return results, readout["ess"] | {"memory_usage": readout.get("memory_usage")}, servers["ess"].log()
    finally:
        for srv in servers.values():
            srv.stop()


def tokens(answers):
    return [a["output_ids"] for a in answers]


def plain_workload(srv, is_ess):
    """Eight concurrent requests of unequal lengths; then eight that share prefixes with them (the radix cache
    holds those); then one request aborted mid-decode, and four more requests after it. ESS's counters are read
    around the first batch too (SGLang's own warm-up request came before)."""
    a = S.prompts(8, (200, 420), seed=0)
    before = srv.state().get("ess")
    out = {"unequal": srv.generate(a, NEW_TOKENS)}
    if is_ess:
        after = srv.state()["ess"]
        out["unequal_counts"] = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
        out["modes"] = after["modes"]
    out["shared_prefix"] = srv.generate(S.shared_prefix_prompts(a, 128, 64, seed=1), NEW_TOKENS)
    out["aborted"] = srv.generate_and_abort(S.prompts(1, (300, 300), seed=2)[0], after_tokens=4)
    out["after_abort"] = srv.generate(S.prompts(4, (150, 300), seed=3), NEW_TOKENS)
    out["streamed"] = srv.stream(S.prompts(1, (250, 250), seed=4)[0], NEW_TOKENS)
    return out


@pytest.fixture(scope="module")
def plain(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")
    plan = tmp / "plan.json"
    plan.write_text(json.dumps({"format": "ess-layer-plan/1", "num_layers": 2, "modes": ["none", "da"]}))
    return run_pair(tmp, model, [], S.ESS_FLAGS + ["--ess-layer-plan", str(plan)], plain_workload)


def test_unequal_concurrent_requests_give_stock_tokens_and_miss_every_step(plain):
    results, _, log = plain
    stock, ess = results["stock"], results["ess"]
    assert tokens(ess["unequal"]) == tokens(stock["unequal"])
    assert all(len(t) == NEW_TOKENS for t in tokens(ess["unequal"]))
    counts = ess["unequal_counts"]
    # every decode forward of the batch missed: 96 slots against top-64 sets over 200-420 positions
    assert counts["forwards"] == NEW_TOKENS - 1 and counts["forwards_without_misses"] == 0, counts
    assert 0 < counts["missed_rows"] < counts["selected_rows"], counts
    assert ess["modes"] == ["none", "da"]  # the plan's modes, both exercised
    assert any("ESS pool:" in line for line in log.splitlines())


def test_every_device_byte_the_server_holds_is_charged(plain):
    """The ESS server's pool and runtime hold exactly what sizing charged (their tensors, walked), and SGLang's own
    readout of its KV cache (memory_usage.kvcache, GiB to 3 places) counts all of it."""
    _, state, log = plain
    device = state["device"]
    assert device["measured"] == device["charged"]["total"], device
    assert state["memory_usage"]["kvcache"] == round(device["measured"] / (1 << 30), 3), state["memory_usage"]
    assert "ESS device bytes:" in log


def test_every_generated_token_streams_its_own_text(plain):
    """A streamed request as `sglang.benchmark.serving` reads it (it times a chunk only when its text is not empty):
    every chunk carries new tokens and, for each, new text (the checkpoint's tokenizer gives every id text of its
    own), on both servers, the same text. SGLang sends a chunk per token, but merges the outputs that reach its HTTP
    handler before that wakes (a loaded machine: one chunk of two tokens was seen on CI's kind of machine), so a chunk
    may carry more than one."""
    streams = {name: plain[0][name]["streamed"] for name in ("stock", "ess")}
    for name, chunks in streams.items():
        counts = [0] + [c["meta_info"]["completion_tokens"] for c in chunks]
        lengths = [0] + [len(c["text"]) for c in chunks]
        assert counts[-1] == NEW_TOKENS and len(chunks) >= NEW_TOKENS // 2, (name, counts)
        for i in range(1, len(counts)):  # new tokens in every chunk, at least a character of text for each
            assert counts[i] > counts[i - 1] and lengths[i] - lengths[i - 1] >= counts[i] - counts[i - 1], (name, i)
    assert streams["stock"][-1]["text"] == streams["ess"][-1]["text"]


def test_shared_prefixes_come_from_the_radix_cache_with_stock_tokens(plain):
    results, _, _ = plain
    stock, ess = results["stock"], results["ess"]
    assert all(a["meta_info"]["cached_tokens"] >= 128 for a in ess["shared_prefix"])
    assert tokens(ess["shared_prefix"]) == tokens(stock["shared_prefix"])


def test_a_request_aborted_mid_decode_is_let_go_and_the_server_serves_on(plain):
    results, state, _ = plain
    stock, ess = results["stock"], results["ess"]
    for r in (stock, ess):
        assert r["aborted"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(r["aborted"]["output_ids"]) >= 4
    assert tokens(ess["after_abort"]) == tokens(stock["after_abort"])
    # every request let go through the plugin's release hook: 8 + 8 + the aborted one + 4 (and SGLang's warm-up)
    assert state["released_requests"] >= 21, state


@pytest.mark.parametrize("steps", [1, 3])
def test_mtp_verify_through_ess_gives_stock_tokens(model, tmp_path, steps):
    """EAGLE of 1 and 3 draft steps (top-1): each verify step's 2 or 4 query rows a request through ESS."""
    def workload(srv, is_ess):
        return srv.generate(S.prompts(8, (200, 420), seed=4), NEW_TOKENS)

    ess = S.ESS_MTP_FLAGS if steps == 1 else \
        ["--enable-ess", "--ess-buffer-tokens", str((steps + 1) * 65), "--ess-residency", "off"]  # rows x (64 + 1)
    results, state, _ = run_pair(tmp_path, model, S.mtp_flags(steps), ess, workload)
    assert tokens(results["ess"]) == tokens(results["stock"])
    assert state["device"]["measured"] == state["device"]["charged"]["total"]  # the verify rows' scratch too
    assert state["forwards"] > 0 and state["missed_rows"] > 0, state  # the verify steps went through ESS


def test_deepseek_s_fp8_checkpoint_with_mtp_gives_stock_tokens(tmp_path):
    """DeepSeek's FP8 format (`ess tiny-checkpoint --fp8`: e4m3 projections with a ue8m0 scale per 128 x 128 block,
    the MTP layer's too) through SGLang's FP8 loader, computed on this CPU (no AMX) as SGLang's AMX kernels do,
    W8A16 (sglang_ess.cpu.fp8); MTP verify steps through ESS; tokens equal stock's."""
    model = str(tmp_path / "model")
    checkpoint.write(model, seed=0, fp8=True)

    def workload(srv, is_ess):
        return srv.generate(S.prompts(8, (200, 420), seed=4), NEW_TOKENS)

    results, state, log = run_pair(tmp_path, model, S.MTP_FLAGS, S.ESS_MTP_FLAGS, workload)
    assert tokens(results["ess"]) == tokens(results["stock"])
    assert state["forwards"] > 0 and state["missed_rows"] > 0, state  # the verify steps went through ESS
    for kind in ("linear layers'", "the experts'"):  # the checkpoint's FP8 tensors reached SGLang's FP8 methods
        assert f"ESS CPU path: {kind} FP8 block-scaled weights dequantized" in log


def test_a_checkpoint_with_a_real_models_locality_misses_little_with_stock_tokens(plain, tmp_path_factory):
    """The checkpoint with a real model's top-k locality (ess.reference.locality, the fitted noise share) through
    SGLang's own indexer: every request offloaded with 96 slots against top-64 sets over 200-420 positions, as the
    random checkpoint's run above. Its top-k sets hold from step to step, so ESS fetches a fraction of the random
    checkpoint's rows; tokens equal stock's."""
    from ess.reference import locality

    tmp = tmp_path_factory.mktemp("locality")
    model = str(tmp / "model")
    checkpoint.write(model, seed=0, locality=locality.FITTED)

    def workload(srv, is_ess):
        before = srv.state().get("ess")
        out = srv.generate(S.prompts(8, (200, 420), seed=0), NEW_TOKENS)
        after = srv.state().get("ess")
        return out, None if after is None else {k: after[k] - before[k] for k in ("selected_rows", "missed_rows")}

    results, _, _ = run_pair(tmp, model, [], S.ESS_FLAGS, workload)
    assert tokens(results["ess"][0]) == tokens(results["stock"][0])
    local, random_ = results["ess"][1], plain[0]["ess"]["unequal_counts"]
    local_share = local["missed_rows"] / local["selected_rows"]
    random_share = random_["missed_rows"] / random_["selected_rows"]
    assert local_share < random_share / 3, (local, random_)


def residency_workload(srv, is_ess):
    """Residency first on a device pool of 9 request rows x 96 slots (--max-running-requests 8): three requests of
    about 300 tokens (two fit whole, the third is offloaded: one batch of both kinds); then a burst of eight, which
    demotes the resident ones, finishing one after another (8 to 36 new tokens), which promotes offloaded ones; then
    two short requests, which fit whole again (the resident path: their new rows stay in their regions), and two that
    continue them (their prompts, outputs and a new turn: the radix cache serves the outputs' rows, which the host
    pool got when the short requests finished); then two sharing a prefix with the first batch (from the radix cache,
    written into their regions from the host pool). ESS's state after each."""
    first = S.prompts(3, (280, 320), seed=5)
    out = {"mixed": srv.generate(first, NEW_TOKENS)}
    if is_ess:
        out["state_mixed"] = srv.state()["ess"]
    out["burst"] = srv.generate(S.prompts(8, (200, 420), seed=6), [8, 12, 16, 20, 24, 28, 32, 36])
    if is_ess:
        out["state_burst"] = srv.state()["ess"]
    short = S.prompts(2, (105, 110), seed=7)  # 24 new tokens reach past page 2 (64-token pages): cached rows
    out["after"] = srv.generate(short, NEW_TOKENS)
    if is_ess:
        out["state_after"] = srv.state()["ess"]
    turn = S.prompts(2, (20, 20), seed=10)
    out["next_turn"] = srv.generate([p + a["output_ids"] + t for p, a, t in zip(short, out["after"], turn)], NEW_TOKENS)
    if is_ess:
        out["state_next_turn"] = srv.state()["ess"]
    out["shared_prefix"] = srv.generate(S.shared_prefix_prompts(first[:2], 128, 32, seed=9), NEW_TOKENS)
    if is_ess:
        out["state_shared"] = srv.state()["ess"]
    return out


@pytest.fixture(scope="module", params=["none", "da"])
def residency(request, model, tmp_path_factory):
    """The residency workload with every layer in one overlap mode: none (the serial step) and DA (the step at the
    indexer, its misses copied beside the rest of the layer)."""
    return run_pair(tmp_path_factory.mktemp(f"residency-{request.param}"), model, ["--max-running-requests", "8"],
                    S.ESS_RESIDENT_FLAGS + ["--ess-overlap", request.param], residency_workload)


def test_resident_and_offloaded_requests_in_one_batch_give_stock_tokens(residency):
    results, _, _ = residency
    stock, ess = results["stock"], results["ess"]
    assert tokens(ess["mixed"]) == tokens(stock["mixed"])
    mixed = ess["state_mixed"]
    assert mixed["residency"]["resident_requests"] == 2 and mixed["residency"]["offloaded_requests"] == 1, mixed
    assert mixed["missed_rows"] > 0  # the offloaded one missed; the resident ones cannot


def test_requests_cross_the_wall_both_ways_with_stock_tokens(residency):
    results, _, _ = residency
    stock, ess = results["stock"], results["ess"]
    assert tokens(ess["burst"]) == tokens(stock["burst"]) and tokens(ess["after"]) == tokens(stock["after"])
    burst, after = ess["state_burst"], ess["state_after"]
    assert burst["residency"]["demoted"] >= 1 and burst["residency"]["promoted"] >= 1, burst
    # the short requests fit whole: they ran without a miss, on the resident path
    assert after["residency"]["offloaded_requests"] == 0 and after["missed_rows"] == burst["missed_rows"], after
    assert after["resident_forwards"] >= NEW_TOKENS - 1 > 0 and burst["general_forwards"] > 0, after


def test_a_next_turn_reads_the_outputs_of_resident_requests_from_the_radix_cache(residency):
    """The short requests' new rows lived in their regions only (the resident path backs nothing up); at their end the
    radix cache keeps them, so they went to the host pool, from which the next turn's prefill reads them."""
    results, _, _ = residency
    stock, ess = results["stock"], results["ess"]
    for a, prev in zip(ess["next_turn"], ess["after"]):  # the radix cache's whole pages hold decode rows
        assert a["meta_info"]["cached_tokens"] > prev["meta_info"]["prompt_tokens"], a["meta_info"]
    assert tokens(ess["next_turn"]) == tokens(stock["next_turn"])


def test_resident_requests_take_shared_prefixes_from_the_radix_cache(residency):
    results, _, _ = residency
    stock, ess = results["stock"], results["ess"]
    assert all(a["meta_info"]["cached_tokens"] >= 128 for a in ess["shared_prefix"])
    assert tokens(ess["shared_prefix"]) == tokens(stock["shared_prefix"])
    shared = ess["state_shared"]
    assert shared["residency"]["offloaded_requests"] == 0 and shared["missed_rows"] == ess["state_after"]["missed_rows"]


def test_a_request_demoted_mid_decode_keeps_stock_tokens(model, tmp_path):
    """Residency first on a device pool of 5 request rows x 96 slots (--max-running-requests 4): request A (280 tokens,
    150 new) takes 480 rows; B (280 tokens) arrives with it but waits for SGLang's own admission: under --max-total-
    tokens 896 (14 pages of 64) it fits once A's reservation of new tokens shrinks, the new-token ratio decaying every
    decode step (SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS 60; priority scheduling, all of one priority, so that admission is
    tried again every step), so B joins after about 11 of A's decode steps. B's region demotes A mid- decode: the rows
    of A's resident steps, which only its region held, go to the host pool first, and A's later steps fetch them from
    there. Both servers schedule alike (the same token budget and ratio): tokens equal stock's."""
    flags = ["--enable-priority-scheduling", "--max-running-requests", "4", "--max-total-tokens", "896"]
    env = {"SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS": "60"}
    # no ignore_eos (the ratio decays only for such requests), the checkpoint's EOS (id 1) kept out by a logit bias
    sampling = {"max_new_tokens": 150, "temperature": 0, "logit_bias": {"1": -1000.0}}

    def workload(srv, is_ess):
        before = srv.state().get("ess")  # after SGLang's warm-up request
        out = srv.post("/generate", {"input_ids": S.prompts(2, (280, 280), seed=11), "sampling_params": sampling})
        return out, before

    results, state, _ = run_pair(tmp_path, model, flags, S.ESS_RESIDENT_FLAGS, workload, env=env)
    (ess, before), (stock, _) = results["ess"], results["stock"]
    assert tokens(ess) == tokens(stock) and [len(t) for t in tokens(ess)] == [150, 150]
    r = state["residency"]
    assert r["device_rows"] == 5 * 96 and r["demoted"] == 1, state
    # A decoded on the resident path before B joined and demoted it, then both on the general path, A's own decode
    # rows among its misses
    resident, general = (state[k] - before[k] for k in ("resident_forwards", "general_forwards"))
    assert resident >= 2 and general >= 140 and state["missed_rows"] > 0, (resident, general, state)


def test_mtp_verify_with_resident_and_offloaded_requests_gives_stock_tokens(model, tmp_path):
    """Four requests on 9 request rows x 160 slots: two keep every row on the device, two are offloaded (one of them
    demoted to make room), verify steps of both kinds in one batch (the general path); then two short ones, both
    resident: their verify steps take the resident path (S new rows a request written into its region)."""
    def workload(srv, is_ess):
        mixed = srv.generate(S.prompts(4, (280, 320), seed=8), NEW_TOKENS)
        state = srv.state().get("ess")
        return mixed, state, srv.generate(S.prompts(2, (100, 120), seed=12), NEW_TOKENS)

    results, state, _ = run_pair(tmp_path, model, S.MTP_FLAGS + ["--max-running-requests", "8"],
                                 ["--enable-ess", "--ess-buffer-tokens", "160"], workload)
    (mixed, mid, short), stock = results["ess"], results["stock"]
    assert tokens(mixed) == tokens(stock[0]) and tokens(short) == tokens(stock[2])
    r = mid["residency"]
    assert r["resident_requests"] >= 1 and r["offloaded_requests"] >= 1 and mid["missed_rows"] > 0, mid
    assert state["residency"]["offloaded_requests"] == 0, state
    assert state["resident_forwards"] > mid["resident_forwards"], state


def test_a_device_too_small_for_one_request_is_refused_before_the_weights_load(model):
    """The real launcher, --mem-fraction-static 1e-5 of this machine's memory (SGLang's CPU "device"): SGLang's static
    budget cannot hold one ESS request, which is said in one line before any weight loads."""
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", model, *S.CPU_FLAGS,
                          *S.ESS_FLAGS, "--mem-fraction-static", "0.00001"], capture_output=True, text=True,
                         env={**os.environ, "SGLANG_PLUGINS": "ess"}, timeout=300)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr and "Load weight" not in out.stdout + out.stderr, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("sglang: error: --enable-ess: one request of ") and "--mem-fraction-static 1e-05" in last


# -- a disk-tier page changed under the server -------------------------------------------------------------------------
TIER_FLAGS = ["--max-running-requests", "1", "--context-length", "2048", "--max-total-tokens", "8192",
              "--cuda-graph-backend-decode", "disabled"]  # a disk tier runs eager (docs/plugin.md, "Disk tier")
# 66 frames of 41,984 bytes: the 65 pages one decode step of one request may need, so a few prompts push pages to disk
ESS_TIER_FLAGS = ["--ess-host-pool-gib", "0.0026"]


def corrupt_page_files(disk_dir: str) -> int:
    """Change the first byte of every row of every page of every ESS page file under disk_dir (whole pages and single
    rows are both read, and checked, by the tier), through the scheduler's own open descriptor (the file is unlinked
    once open), as a failing disk or a stray writer would. Returns the pages changed."""
    changed = 0
    for link in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            target = os.readlink(link)
        except OSError:
            continue
        if not target.startswith(os.path.join(disk_dir, "ess_tier_")):
            continue
        fd = os.open(link, os.O_RDWR)  # buffered: flushed below, so the tier's direct reads see it
        try:
            for page in range(os.fstat(fd).st_size // DISK_PAGE):
                data = bytearray(os.pread(fd, DISK_PAGE, page * DISK_PAGE))
                for row in range(64):
                    data[row * 656] ^= 0xFF
                os.pwrite(fd, bytes(data), page * DISK_PAGE)
                changed += 1
            os.fsync(fd)
        finally:
            os.close(fd)
    return changed


def test_a_page_changed_on_disk_aborts_its_reader_only_and_the_server_serves_on(model, tmp_path):
    """A prompt's rows pushed to the disk tier, every page of the page file then changed: the next request that reuses
    that prompt's cached prefix reads a page that fails its checksum and gets HTTP 500 naming the file and the page;
    an unrelated request after it gets stock's tokens; and the same request sent again is computed afresh (the
    server let its cached prefixes go) and gets stock's tokens too."""
    disk = tmp_path / "disk"
    disk.mkdir()
    a = S.prompts(1, (400, 400), seed=5)[0]
    b = a[:320] + S.prompts(1, (80, 80), seed=6)[0]  # five of a's 64-token pages from the radix cache
    pushers = S.prompts(2, (1100, 1100), seed=7)  # 2 x 18 pages a layer, over the 66 frames

    def workload(srv, is_ess):
        out = {"a": srv.generate([a], NEW_TOKENS)}
        for p in pushers:
            srv.generate([p], NEW_TOKENS)
        if is_ess:
            out["tier_before"] = srv.state()["ess"]["tier"]
            out["pages_changed"] = corrupt_page_files(str(disk))
            with pytest.raises(S.ServerError) as err:
                srv.generate([b], NEW_TOKENS)
            out["b"] = str(err.value)
        else:
            out["b"] = srv.generate([b], NEW_TOKENS)
        out["c"] = srv.generate(S.prompts(1, (300, 300), seed=8), NEW_TOKENS)
        if not is_ess:
            srv.flush()  # stock's cache holds b: both servers compute it afresh
        out["b_again"] = srv.generate([b], NEW_TOKENS)
        return out

    results, state, log = run_pair(tmp_path, model, TIER_FLAGS,
                                   S.ESS_FLAGS + ESS_TIER_FLAGS + ["--ess-disk-dir", str(disk)], workload)
    stock, ess = results["stock"], results["ess"]
    assert ess["tier_before"]["disk_pages"] > 0 and ess["pages_changed"] > 0, ess["tier_before"]
    assert "HTTP 500" in ess["b"] and "fails its checksum" in ess["b"] and "ess_tier_" in ess["b"], ess["b"]
    assert tokens(ess["a"]) == tokens(stock["a"])
    assert tokens(ess["c"]) == tokens(stock["c"])
    assert tokens(ess["b_again"]) == tokens(stock["b_again"])
    assert ess["b_again"][0]["meta_info"]["cached_tokens"] == 0  # a's lost prefix was let go, not reused
    assert state["tier"]["checksum_failures"] > 0, state["tier"]  # (its rows are found again once rewritten)
    assert any("ESS disk tier: request" in line and "aborted" in line for line in log.splitlines())
