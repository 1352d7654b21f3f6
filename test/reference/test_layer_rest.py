"""The measured rest of a decode layer (ess.reference.layer_rest): the grouped GEMM against one GEMM per expert, the
routing's share of one GPU, shapes, refusals; on a GPU, the all-to-all's spin against its asked length."""

import pytest
import torch

from ess.reference import attention as A
from ess.reference.config import get_config
from ess.reference.layer_rest import (LayerRest, MoeShape, RestWeights, comm_wait, fp8_grouped_mm,
                                      fp8_grouped_mm_loop, grouped_mm, grouped_mm_loop, local_counts, quantize_columns,
                                      quantize_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_gemm_equals_one_gemm_per_expert_empty_experts_too(dtype):
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 0, 1]
    x = torch.randn(sum(counts), 16, generator=g).to(dtype)
    w = torch.randn(len(counts), 16, 24, generator=g).to(dtype)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    assert torch.equal(grouped_mm(x, w, offs), grouped_mm_loop(x, w, counts))


def test_one_gpu_gets_its_experts_share_of_the_pairs():
    """Uniform routing: each of the ep GPUs' T tokens picks 8 of 256 experts; one GPU's 256 / ep experts get about
    8 T pairs (the pairs per GPU do not depend on ep), spread unevenly."""
    shape = MoeShape.dsv32()
    for ep in (8, 32):
        counts = local_counts(shape, ep, 204)
        assert len(counts) == 256 // ep and abs(sum(counts) / (8 * 204) - 1) < 0.1 and len(set(counts)) > 1
    assert local_counts(shape, 32, 204) == local_counts(shape, 32, 204)  # drawn once, seeded: fixed shapes


def test_the_rest_of_a_layer_runs_at_the_mini_shapes_and_refuses_a_bad_ep():
    cfg = get_config("mini", num_layers=1)
    shape = MoeShape.mini(cfg.hidden, cfg.vocab)
    w = RestWeights.random(shape, 32, torch.float32, torch.device("cpu"))
    rest = LayerRest(shape, A.AttentionWeights.random(cfg, torch.Generator().manual_seed(0)), w, 5, 32, 10.0, 20.0)
    o, h = torch.randn(5, cfg.num_heads, 512), torch.randn(5, cfg.hidden)
    assert rest.gemm == "bf16 grouped" and rest(o, h).shape == rest(o, h, dense=True).shape == (5, cfg.hidden)
    assert rest.routed().shape == (sum(rest.counts), cfg.hidden) and rest.lm_head(h).shape == (5, cfg.vocab)
    comm_wait(1e6, torch.device("cpu"))  # the CPU run times nothing: no wait
    with pytest.raises(ValueError, match="ep 3"):
        RestWeights.random(shape, 3, torch.float32, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the spin is a GPU kernel")
def test_the_all_to_all_spin_lasts_what_it_is_asked_on_a_gpu():
    from ess.analysis.timing import graph_us

    dev = torch.device("cuda")
    for us in (50.0, 400.0):
        took = graph_us(lambda: comm_wait(us, dev), 5)
        assert abs(took / us - 1) < 0.15, (us, took)


def test_fp8_experts_stay_within_fp8s_error_of_the_bf16_product():
    """The FP8 path (row-wise activations, per-column weights, as the deployment's FP8 experts up to the block
    size): its oracle against the unquantized product; a LayerRest with fp8 weights runs it on the CPU."""
    g = torch.Generator().manual_seed(1)
    counts = [5, 0, 7]
    x, w = torch.randn(12, 64, generator=g), torch.randn(3, 64, 48, generator=g)
    got = fp8_grouped_mm_loop(*quantize_rows(x), *quantize_columns(w), counts).float()
    want = grouped_mm_loop(x, w, counts)
    assert ((got - want).abs().max() / want.abs().max()) < 0.08
    cfg = get_config("mini", num_layers=1)
    shape = MoeShape.mini(cfg.hidden, cfg.vocab)
    w8 = RestWeights.random(shape, 32, torch.float32, torch.device("cpu"), experts="fp8")
    rest = LayerRest(shape, A.AttentionWeights.random(cfg, torch.Generator().manual_seed(0)), w8, 5, 32, 1.0, 1.0)
    assert rest.gemm == "fp8 loop (the CPU's)" and rest.routed().dtype == torch.bfloat16
    assert w8.bytes() > RestWeights.random(shape, 32, torch.float32, torch.device("cpu")).bytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's scaled grouped GEMM is a GPU kernel")
def test_the_fp8_grouped_kernel_equals_its_oracle_on_a_gpu():
    g = torch.Generator(device="cuda").manual_seed(2)
    counts = [16, 0, 48, 32]
    x = torch.randn(sum(counts), 256, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(4, 256, 128, generator=g, device="cuda").to(torch.bfloat16)
    offs = torch.tensor(counts).cumsum(0).to("cuda", torch.int32)
    x8, wq = quantize_rows(x), quantize_columns(w)
    got, want = fp8_grouped_mm(*x8, *wq, offs).float(), fp8_grouped_mm_loop(*x8, *wq, counts).float()
    assert ((got - want).abs().max() / want.abs().max()) < 0.02
