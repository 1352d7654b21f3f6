"""The rig's indexer logits, checked on the device before they serve: ESS's Triton kernels (ess_gpu_rig.rig_patches)
against SGLang's own torch logits they replace, on values every product and sum of which is exact in bf16 and fp32
(ternary FP8 keys and queries, scale 1, small integer weights): decode with one and two query rows a request over
SGLang's index-K pages, and prefill windows. A kernel that raises, or differs anywhere inside a row's context, fails
the check; outside it, ESS's kernels write -inf where SGLang's write 0 (SGLang's top-k masks by length). Each
scheduler runs the check before its weights load (rig_patches.before_load_model) and serves with SGLang's torch logits
if it fails (docs/gpu-server.md); the tests run the same check on the CPU in Triton's interpreter."""

from __future__ import annotations

import math

import torch

from ess.core import layout


def _ternary(g: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randint(0, 3, shape, generator=g) - 1).float()


def decode_case(next_n: int, seed: int = 0) -> dict:
    """The arguments of SGLang's fp8_paged_mqa_logits (CPU tensors): 3 requests over 11 index-K pages."""
    g = torch.Generator().manual_seed(seed)
    B, H, P, S = 3, 8, 3, 11
    rows = torch.zeros(S * 64, layout.INDEX_ROW_BYTES, dtype=torch.uint8)
    rows[:, : layout.INDEX_DIM] = _ternary(g, S * 64, layout.INDEX_DIM).to(torch.float8_e4m3fn).view(torch.uint8)
    rows[:, layout.INDEX_SCALE_OFFSET :] = torch.ones(S * 64).view(torch.uint8).view(-1, 4)  # scale 1.0
    lens = torch.tensor([150, 64, 1])
    return {"q_fp8": _ternary(g, B, next_n, H, 128).to(torch.float8_e4m3fn),
            "kv_cache_fp8": layout.index_k_rows_to_pages(rows).view(S, 64, 1, layout.INDEX_ROW_BYTES),
            "weights": torch.randint(-2, 3, (B * next_n, H), generator=g).float(),
            "context_lens": lens.view(B, 1) + torch.arange(next_n) - next_n + 1,  # each query row's own context
            "block_table": torch.randperm(S, generator=g)[: B * P].view(B, P).int(),
            "schedule_metadata": None, "max_seq_len": P * 64}


def prefill_case(seed: int = 1) -> dict:
    """The arguments of SGLang's fp8_mqa_logits (CPU tensors): 6 query rows over windows of 202 gathered keys."""
    g = torch.Generator().manual_seed(seed)
    M, H, N = 6, 8, 202
    return {"q_fp8": _ternary(g, M, H, 128).to(torch.float8_e4m3fn),
            "kv": (_ternary(g, N, 128).to(torch.float8_e4m3fn), torch.ones(N)),
            "weights": torch.randint(-2, 3, (M, H), generator=g).float(),
            "ks": torch.tensor([0, 0, 0, 120, 120, 120], dtype=torch.int32),
            "ke": torch.tensor([1, 60, 120, 121, 170, 202], dtype=torch.int32)}


def _on(case: dict, device) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else tuple(t.to(device) for t in v)
                if isinstance(v, tuple) else v) for k, v in case.items()}


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, inside: torch.Tensor) -> str | None:
    if got.shape != want.shape or got.dtype != torch.float32:
        return f"{what}: {tuple(got.shape)} {got.dtype}, SGLang's {tuple(want.shape)} {want.dtype}"
    got, want, inside = got.cpu(), want.cpu(), inside.cpu()
    if not torch.equal(got[inside], want[inside]):
        return f"{what}: {int((got[inside] != want[inside]).sum())} of {int(inside.sum())} logits differ from SGLang's"
    if not bool((got[~inside] == -math.inf).all()):
        return f"{what}: a logit past its row's context is not -inf"
    return None


def check(device, ess_decode, ess_prefill, sglang_decode, sglang_prefill) -> str | None:
    """None where ESS's decode and prefill logits equal SGLang's on `device`, else what failed. The four functions
    are called with SGLang's arguments (ess_*: the rig's kernels; sglang_*: SGLang's torch logits)."""
    try:
        for next_n in (1, 2):
            case = _on(decode_case(next_n), device)
            got = ess_decode(**case)
            B = case["q_fp8"].shape[0]
            flat = case["context_lens"].reshape(-1)
            # SGLang's torch logits take one query row a request: each row given its request's table row
            want = sglang_decode(**case | {"q_fp8": case["q_fp8"].reshape(B * next_n, 1, *case["q_fp8"].shape[2:]),
                                           "context_lens": flat,
                                           "block_table": case["block_table"].repeat_interleave(next_n, 0)})
            inside = torch.arange(case["max_seq_len"], device=flat.device) < flat[:, None]
            fault = _compare(f"decode logits, {next_n} query row(s)", got, want, inside)
            if fault:
                return fault
        case = _on(prefill_case(), device)
        got, want = ess_prefill(**case), sglang_prefill(**case)
        n = case["kv"][0].shape[0]
        col = torch.arange(n, device=case["ks"].device)
        inside = (col >= case["ks"][:, None]) & (col < case["ke"][:, None])
        fault = _compare("prefill logits", got, want, inside)
        if fault is None and got.stride(0) != want.stride(0):
            fault = f"prefill logits: row stride {got.stride(0)}, SGLang's {want.stride(0)}"
        return fault
    except Exception as e:  # a kernel that does not build or run here fails its check
        return f"{type(e).__name__}: {str(e)[:300]}"
