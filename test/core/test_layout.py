import numpy as np
import pytest
import torch

from ess.core import layout


def test_offsets_are_exact():
    assert (layout.NOPE_OFFSET, layout.SCALE_OFFSET, layout.ROPE_OFFSET, layout.LATENT_ROW_BYTES) == (0, 512, 528, 656)
    assert (layout.INDEX_SCALE_OFFSET, layout.INDEX_ROW_BYTES) == (128, 132)


def test_latent_bytes_and_round_trip():
    g = torch.Generator().manual_seed(0)
    nope = torch.randn(7, 512, generator=g) * torch.logspace(-3, 2, 7).unsqueeze(1)
    rope = torch.randn(7, 64, generator=g)
    rows = layout.quantize_latent(nope, rope)
    assert rows.dtype == torch.uint8 and rows.shape == (7, 656)
    raw = rows.numpy()
    # Scales sit at bytes 512..528 as little-endian float32 and equal amax / 448 per 128-wide tile.
    scales = np.frombuffer(raw[:, 512:528].tobytes(), dtype="<f4").reshape(7, 4)
    expect = (nope.reshape(7, 4, 128).abs().amax(-1) / 448).numpy()
    assert np.array_equal(scales, expect.astype(np.float32))
    # RoPE bytes are the bf16 values, unquantised.
    r = torch.from_numpy(raw[:, 528:].copy()).view(torch.bfloat16)
    assert torch.equal(r, rope.to(torch.bfloat16))
    # NoPE: e4m3 has 3 mantissa bits: relative error <= 2^-4 (normals), absolute <= 2^-10 * scale (subnormals).
    deq_nope, deq_rope = layout.dequantize_latent(rows)
    s = torch.from_numpy(expect).repeat_interleave(128, dim=1)
    assert torch.all((deq_nope - nope).abs() <= nope.abs() * 2**-4 + s * 2**-10 + 1e-12)
    assert torch.equal(deq_rope, rope.to(torch.bfloat16).float())


def test_latent_zero_tile_is_zero_not_nan():
    rows = layout.quantize_latent(torch.zeros(2, 512), torch.zeros(2, 64))
    nope, _ = layout.dequantize_latent(rows)
    assert torch.equal(nope, torch.zeros(2, 512))


def test_index_k_round_trip_ue8m0():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(5, 128, generator=g) * torch.tensor([1e-6, 1e-2, 1.0, 30.0, 1000.0]).unsqueeze(1)
    rows = layout.quantize_index_k(k)
    assert rows.shape == (5, 132)
    scale = torch.from_numpy(rows[:, 128:].numpy().copy()).view(torch.float32).squeeze(1)
    assert torch.all(torch.log2(scale) == torch.round(torch.log2(scale)))  # powers of two (ue8m0)
    amax = k.abs().amax(-1).clamp_min(1e-4)
    assert torch.all(scale >= amax / 448) and torch.all(scale < 2 * amax / 448)
    err = (layout.dequantize_index_k(rows) - k).abs()
    assert torch.all(err <= k.abs() * 2**-4 + scale.unsqueeze(1) * 2**-10 + 1e-12)


def test_index_k_pages_layout():
    rows = torch.randint(0, 256, (128, 132), dtype=torch.uint8)
    pages = layout.index_k_rows_to_pages(rows)
    assert pages.shape == (2, 64 * 132)
    assert torch.equal(pages[0, :128], rows[0, :128])  # token 0's values first
    assert torch.equal(pages[0, 64 * 128 : 64 * 128 + 4], rows[0, 128:])  # then the scales, token 0 first
    assert torch.equal(layout.index_k_pages_to_rows(pages), rows)
    with pytest.raises(ValueError, match="64-token pages"):
        layout.index_k_rows_to_pages(rows[:100])


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="nope"):
        layout.quantize_latent(torch.zeros(1, 500), torch.zeros(1, 64))
    with pytest.raises(TypeError, match="uint8"):
        layout.dequantize_latent(torch.zeros(1, 656))


def test_latent_scale_conventions_are_a_named_choice():
    g = torch.Generator().manual_seed(3)
    nope, rope = torch.randn(5, 512, generator=g) * 3, torch.randn(5, 64, generator=g)
    nope[0, :128] = 0  # an all-zero tile: scale 0 in both conventions
    _, amax_scales, _ = layout.latent_fields(layout.quantize_latent(nope, rope))
    _, pow2_scales, _ = layout.latent_fields(layout.quantize_latent(nope, rope, scale_fmt="ue8m0"))
    assert layout.LATENT_SCALE_FMT == "amax"  # SGLang 0.5.23's: the bytes ESS moves
    amax = nope.reshape(5, 4, 128).abs().amax(-1)
    assert torch.equal(amax_scales, amax / 448)
    assert torch.equal(pow2_scales[amax == 0], torch.zeros_like(pow2_scales[amax == 0]))
    live = pow2_scales[amax > 0]
    assert torch.equal(torch.exp2(torch.log2(live).round()), live)  # powers of two
    assert bool((live >= amax[amax > 0] / 448).all()) and bool((live < 2 * amax[amax > 0] / 448).all())
    with pytest.raises(ValueError, match="latent scale format"):
        layout.quantize_latent(nope, rope, scale_fmt="e8m0")
