"""Exact byte formats of DeepSeek-V3.2's two decode caches, as SGLang 0.5.23 writes them.

Latent (MLA) row, 656 bytes per token per layer, the FP8 layout of FlashMLA's sparse decode:
    bytes [  0, 512)  512 float8_e4m3fn NoPE values, 4 tiles of 128
    bytes [512, 528)  4 float32 scales, one per tile (dequant: value = fp8 * scale)
    bytes [528, 656)  64 bfloat16 RoPE values, stored unquantised
Scale convention (LATENT_SCALE_FMT, a named choice so that following a later SGLang is one line):
    "amax"   SGLang 0.5.23's, which writes the bytes ESS moves: `sglang/kernels/ops/quantization/dsa_quant_k_cache.py`,
             `_quantize_k_cache_fast_kernel` (called by `quantize_k_cache` / `quantize_k_cache_separate`):
             scale = amax(|tile|) / 448 (no epsilon), stored as float32
    "ue8m0"  a power of two, scale = 2 ** ceil(log2(amax / 448)): DeepSeek's official inference code and FlashMLA's
             newer tests
    q = clamp(x * (1 / scale), -448, 448) cast to e4m3fn in both.
An all-zero tile gives scale 0 and 0 * inf = NaN there; we store zeros for such a tile instead (our only
deviation, and SGLang's NaN row would be unusable anyway).

Index-K row, 132 bytes per token per layer: 128 float8_e4m3fn values + 1 float32 scale.
Scale convention: `sglang/kernels/ops/quantization/act_quant_triton.py`, `act_quant(x, 128, "ue8m0")` as the
DSA `Indexer` calls it (`scale_fmt="ue8m0"` in `deepseek_v2.py`):
    amax = max(amax(|x|), 1e-4);  scale = 2 ** ceil(log2(amax / 448));  q = clamp(x / scale, -448, 448).
SGLang stores index-K paged (`IndexKeyCache`: per 64-token page, 64 x 128 fp8 bytes then 64 fp32 scales);
`index_k_rows_to_pages` / `index_k_pages_to_rows` convert between our row form and that page form.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

# Latent row.
NOPE_DIM = 512
ROPE_DIM = 64
TILE = 128
NUM_TILES = NOPE_DIM // TILE
NOPE_OFFSET = 0
SCALE_OFFSET = NOPE_DIM  # 512
ROPE_OFFSET = SCALE_OFFSET + 4 * NUM_TILES  # 528
LATENT_ROW_BYTES = ROPE_OFFSET + 2 * ROPE_DIM  # 656

# Index-K row.
INDEX_DIM = 128
INDEX_SCALE_OFFSET = INDEX_DIM
INDEX_ROW_BYTES = INDEX_DIM + 4  # 132
INDEX_PAGE_TOKENS = 64

assert LATENT_ROW_BYTES == 656 and INDEX_ROW_BYTES == 132

LATENT_SCALE_FMTS = ("amax", "ue8m0")
LATENT_SCALE_FMT = "amax"  # SGLang 0.5.23's (see the module docstring)


def latent_scale(amax: torch.Tensor, fmt: str = LATENT_SCALE_FMT) -> torch.Tensor:
    """The FP8 scale of latent tiles whose largest magnitude is amax, in the named convention (0 for an all-zero tile)."""
    if fmt == "amax":
        return amax / FP8_MAX
    if fmt == "ue8m0":
        return torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX))), torch.zeros_like(amax))
    raise ValueError(f"latent scale format must be one of {LATENT_SCALE_FMTS}, got {fmt!r}")


def _check_last_dim(x: torch.Tensor, dim: int, name: str) -> None:
    if x.shape[-1] != dim:
        raise ValueError(f"{name}: expected last dimension {dim}, got shape {tuple(x.shape)}")


def quantize_latent(nope: torch.Tensor, rope: torch.Tensor, scale_fmt: str = LATENT_SCALE_FMT) -> torch.Tensor:
    """Pack [..., 512] NoPE and [..., 64] RoPE values into [..., 656] uint8 latent rows."""
    _check_last_dim(nope, NOPE_DIM, "nope")
    _check_last_dim(rope, ROPE_DIM, "rope")
    lead = nope.shape[:-1]
    tiles = nope.float().reshape(*lead, NUM_TILES, TILE)
    scale = latent_scale(tiles.abs().amax(dim=-1), scale_fmt)  # [..., 4] float32
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = (tiles * inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch.empty(*lead, LATENT_ROW_BYTES, dtype=torch.uint8, device=nope.device)
    out[..., NOPE_OFFSET:SCALE_OFFSET] = q.reshape(*lead, NOPE_DIM).view(torch.uint8)
    out[..., SCALE_OFFSET:ROPE_OFFSET] = scale.contiguous().view(torch.uint8).reshape(*lead, 4 * NUM_TILES)
    out[..., ROPE_OFFSET:] = rope.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(*lead, 2 * ROPE_DIM)
    return out


def latent_fields(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Typed views of [..., 656] uint8 rows: (fp8 NoPE [..., 512], fp32 scales [..., 4], bf16 RoPE [..., 64])."""
    _check_last_dim(rows, LATENT_ROW_BYTES, "latent rows")
    if rows.dtype != torch.uint8:
        raise TypeError(f"latent rows must be uint8, got {rows.dtype}")
    rows = rows.contiguous()
    nope = rows[..., NOPE_OFFSET:SCALE_OFFSET].view(FP8)
    scales = rows[..., SCALE_OFFSET:ROPE_OFFSET].contiguous().view(torch.float32)
    rope = rows[..., ROPE_OFFSET:].contiguous().view(torch.bfloat16)
    return nope, scales, rope


def dequantize_latent(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 656] uint8 rows -> (NoPE float32 [..., 512], RoPE float32 [..., 64])."""
    nope_q, scales, rope = latent_fields(rows)
    lead = rows.shape[:-1]
    nope = nope_q.float().reshape(*lead, NUM_TILES, TILE) * scales.unsqueeze(-1)
    return nope.reshape(*lead, NOPE_DIM), rope.float()


def quantize_index_k(k: torch.Tensor) -> torch.Tensor:
    """[..., 128] index keys -> [..., 132] uint8 rows (fp8 values, then one ue8m0-rounded fp32 scale)."""
    _check_last_dim(k, INDEX_DIM, "index key")
    lead = k.shape[:-1]
    x = k.float()
    amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch.empty(*lead, INDEX_ROW_BYTES, dtype=torch.uint8, device=k.device)
    out[..., :INDEX_DIM] = q.view(torch.uint8)
    out[..., INDEX_SCALE_OFFSET:] = scale.contiguous().view(torch.uint8).reshape(*lead, 4)
    return out


def dequantize_index_k(rows: torch.Tensor) -> torch.Tensor:
    """[..., 132] uint8 index-K rows -> float32 [..., 128]."""
    _check_last_dim(rows, INDEX_ROW_BYTES, "index-K rows")
    rows = rows.contiguous()
    q = rows[..., :INDEX_DIM].view(FP8).float()
    scale = rows[..., INDEX_SCALE_OFFSET:].contiguous().view(torch.float32)
    return q * scale


def index_k_rows_to_pages(rows: torch.Tensor) -> torch.Tensor:
    """[n_pages * 64, 132] rows -> [n_pages, 64 * 132] bytes in SGLang's IndexKeyCache page order."""
    if rows.shape[0] % INDEX_PAGE_TOKENS:
        raise ValueError(f"index-K rows: {rows.shape[0]} tokens is not a whole number of 64-token pages")
    pages = rows.reshape(-1, INDEX_PAGE_TOKENS, INDEX_ROW_BYTES)
    return torch.cat([pages[:, :, :INDEX_DIM].flatten(1), pages[:, :, INDEX_DIM:].flatten(1)], dim=1)


def index_k_pages_to_rows(pages: torch.Tensor) -> torch.Tensor:
    """Inverse of `index_k_rows_to_pages`."""
    _check_last_dim(pages, INDEX_PAGE_TOKENS * INDEX_ROW_BYTES, "index-K pages")
    n = pages.shape[0]
    values = pages[:, : INDEX_PAGE_TOKENS * INDEX_DIM].reshape(n, INDEX_PAGE_TOKENS, INDEX_DIM)
    scales = pages[:, INDEX_PAGE_TOKENS * INDEX_DIM :].reshape(n, INDEX_PAGE_TOKENS, 4)
    return torch.cat([values, scales], dim=2).reshape(n * INDEX_PAGE_TOKENS, INDEX_ROW_BYTES)
