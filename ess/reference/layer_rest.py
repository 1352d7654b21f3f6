"""The rest of a DeepSeek-V3.2 decode layer after attention, as one GPU of an expert-parallel (EP) deployment runs it
(docs/gpu.md, "The whole layer"): w_vc and o_proj, the residual and norm, the router, this GPU's routed experts over
the tokens the all-to-all brings it (two grouped GEMMs), the shared expert; or the dense FFN of the first layers; and
the LM head once a step. Random weights: the time does not depend on their values.

The one modelled part is the network: the EP all-to-all (dispatch before the experts, combine after) is a wait of
its modelled length on the layer's stream (`comm_wait`), a spin of one thread block: it holds one SM and leaves the
others to any other stream (a copy stream's H2D, another micro-batch). A wait on a host event would hold no SM at
all but cannot be replayed in a CUDA graph, which is how a decode server runs its step.

Routing is drawn once, at setup (fixed shapes, as a captured graph needs): each of the `ep` GPUs' T tokens picks
`experts_per_token` distinct experts uniformly, and this GPU (experts 0 .. E/ep - 1) receives the pairs that land on
its experts; about T x experts_per_token pairs, unevenly spread over its experts as uniform routing spreads them. The
dispatched tokens' values stand in a fixed buffer (the network writes them there), as does the combine's result.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ess.core import dsv32, layout
from ess.core.streams import Streams
from ess.reference import attention as A
from ess.reference.stages import drain


@dataclasses.dataclass(frozen=True)
class MoeShape:
    hidden: int
    experts: int  # routed experts of the whole model
    experts_per_token: int
    moe_inter: int  # one expert's intermediate width
    shared_experts: int
    dense_inter: int  # the dense layers' FFN width
    vocab: int

    @staticmethod
    def dsv32() -> "MoeShape":
        c = dsv32.CONFIG
        return MoeShape(c["hidden_size"], c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"],
                        c["n_shared_experts"], c["intermediate_size"], c["vocab_size"])

    @staticmethod
    def mini(hidden: int, vocab: int) -> "MoeShape":
        """Narrow experts for the CPU smoke run, routed as the model's (256 experts, 8 per token)."""
        return MoeShape(hidden, 256, 8, 32, 1, 128, vocab)


def local_counts(shape: MoeShape, ep: int, tokens: int, seed: int = 0) -> list[int]:
    """Pairs per local expert (this GPU's E / ep experts) of the ep GPUs' `tokens` tokens each, uniform routing."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(ep * tokens, shape.experts, generator=g).topk(shape.experts_per_token, dim=1).indices
    return torch.bincount(picks.flatten(), minlength=shape.experts)[: shape.experts // ep].tolist()


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[P, K] rows in groups ending at offs (int32) times [G, K, N] weights, group g's rows by w[g]: one grouped GEMM."""
    return torch._grouped_mm(x, w, offs=offs)


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """grouped_mm as one GEMM per group: its oracle, and the fallback where the grouped kernel refuses a device."""
    out, start = x.new_empty(x.shape[0], w.shape[-1]), 0
    for g, n in enumerate(counts):
        out[start:start + n] = x[start:start + n] @ w[g]
        start += n
    return out


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8: x [M, K] as (x8 [M, K] float8_e4m3fn, scale [M] float32), x ~ x8 * scale."""
    scale = (x.float().abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale.unsqueeze(-1)).to(layout.FP8), scale


def quantize_columns(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output column FP8 of weights w [G, K, N]: (wT8, scale [G, N]), wT8 a [G, K, N] column-major view of a
    contiguous [G, N, K] (the layout the scaled grouped GEMM reads), w ~ wT8 * scale."""
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    stored = (w.float() / scale.unsqueeze(1)).transpose(1, 2).contiguous().to(layout.FP8)
    return stored.transpose(1, 2), scale


def fp8_grouped_mm(x8, sa, wT8, sb, offs: torch.Tensor) -> torch.Tensor:
    """grouped_mm in FP8 with row-wise scales (sa per row of x, sb per group and column), bf16 out: one kernel."""
    return torch._scaled_grouped_mm(x8, wT8, sa, sb, offs=offs, out_dtype=torch.bfloat16)


def fp8_grouped_mm_loop(x8, sa, wT8, sb, counts: list[int]) -> torch.Tensor:
    """fp8_grouped_mm's oracle (and its CPU path): grouped_mm_loop over the dequantized operands, bf16 out."""
    x, w = x8.float() * sa.unsqueeze(-1), wT8.float() * sb.unsqueeze(1)
    return grouped_mm_loop(x, w, counts).to(torch.bfloat16)


@functools.cache
def _spin_cycles_per_us(device_index: int) -> float:
    """The GPU clock as torch.cuda._sleep counts it: one 20 ms spin, timed with CUDA events after a warm-up."""
    with torch.cuda.device(device_index):
        torch.cuda._sleep(1_000_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 40_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) * 1e3)


def spin_cycles_per_us(device: torch.device) -> float | None:
    return _spin_cycles_per_us(device.index or 0) if device.type == "cuda" else None


def comm_wait(us: float, device: torch.device) -> None:
    """A wait of `us` microseconds on the current stream, holding one SM (module docstring). The CPU run times
    nothing: no wait there."""
    if us > 0 and device.type == "cuda":
        torch.cuda._sleep(max(1, int(us * spin_cycles_per_us(device))))


class Comm:
    """Where the all-to-all's waits run: inline on the compute stream (`stream` False: a serial layer), or on a stream
    of their own (two-batch overlap: one micro-batch's dispatch or combine beside the other's compute; the two
    micro-batches' waits queue on it, as their transfers share the network). launch returns what `wait` takes."""

    def __init__(self, device: torch.device, stream: bool = False):
        self.device = device
        self.streams = Streams(device) if stream else None

    def launch(self, us: float):
        if self.streams is None:
            comm_wait(us, self.device)
            return None
        return self.streams.copy_after(lambda: comm_wait(us, self.device))

    def wait(self, done) -> None:
        if self.streams is not None:
            self.streams.wait(done)


def _silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@dataclasses.dataclass
class RestWeights:
    """The rest's weights, every one [in, out] (x @ w): made once on the device and shared by every stack of a run
    (made per stack, the routed experts alone took seconds)."""

    norm: torch.Tensor
    gate: torch.Tensor  # the router [hidden, experts]
    w13: torch.Tensor  # this GPU's routed experts [E / ep, hidden, 2 x moe_inter]
    w2: torch.Tensor  # [E / ep, moe_inter, hidden]
    s13: torch.Tensor  # the shared expert(s)
    s2: torch.Tensor
    d13: torch.Tensor  # the dense FFN
    d2: torch.Tensor
    head: torch.Tensor  # the LM head [hidden, vocab]
    fp8: dict | None = None  # the routed experts in FP8 (quantize_columns): {"w13": (wT8, scale), "w2": ...}

    @staticmethod
    def random(shape: MoeShape, ep: int, dtype: torch.dtype, device: torch.device, seed: int = 0,
               experts: str = "bf16") -> "RestWeights":
        """experts "fp8": the routed experts also in FP8 (the deployment's precision), beside the bf16 ones."""
        if ep < 1 or shape.experts % ep:
            raise ValueError(f"ep {ep}: must divide the {shape.experts} routed experts")
        g = torch.Generator(device=device).manual_seed(seed)

        def rand(fan_in: int, *size: int) -> torch.Tensor:
            return (torch.randn(*size, generator=g, device=device) * fan_in**-0.5).to(dtype)

        H, I, here = shape.hidden, shape.moe_inter, shape.experts // ep
        shared, dense = shape.shared_experts * I, shape.dense_inter
        w = RestWeights(torch.ones(H, device=device, dtype=dtype), rand(H, H, shape.experts),
                        rand(H, here, H, 2 * I), rand(I, here, I, H), rand(H, H, 2 * shared),
                        rand(shared, shared, H), rand(H, H, 2 * dense), rand(dense, dense, H),
                        rand(H, H, shape.vocab))
        if experts not in EXPERTS:
            raise ValueError(f"experts: one of {EXPERTS}, got {experts!r}")
        if experts == "fp8":
            w.fp8 = {"w13": quantize_columns(w.w13), "w2": quantize_columns(w.w2)}
        return w

    def bytes(self) -> int:
        tensors = [getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "fp8"]
        tensors += [t for pair in (self.fp8 or {}).values() for t in pair]
        return sum(t.numel() * t.element_size() for t in tensors)


EXPERTS = ("bf16", "fp8")  # the routed experts' precision


class LayerRest:
    """The rest of one decode layer for T tokens, and the LM head: one per stack (its layers share it, as they share
    the attention weights), run after each layer's attention. dispatch_us / combine_us: the all-to-all's modelled
    halves."""

    def __init__(self, shape: MoeShape, attn: A.AttentionWeights, w: RestWeights, tokens: int, ep: int,
                 dispatch_us: float, combine_us: float, seed: int = 0):
        device, dtype = w.norm.device, w.norm.dtype
        self.shape, self.attn, self.w, self.device = shape, attn, w, device
        self.dispatch_us, self.combine_us = dispatch_us, combine_us
        self.counts = local_counts(shape, ep, tokens, seed)
        self.offs = torch.tensor(self.counts, dtype=torch.int64).cumsum(0).to(device, torch.int32)
        g = torch.Generator(device=device).manual_seed(seed)
        pairs = sum(self.counts)
        # what the network writes: the dispatched tokens, and the combine's result
        self.recv = torch.randn(pairs, shape.hidden, generator=g, device=device).to(dtype)
        self.combined = torch.randn(tokens, shape.hidden, generator=g, device=device).to(dtype)
        self.gemm = self._kernel(pairs)

    def _kernel(self, pairs: int) -> str:
        """The experts' GEMMs on this device, tried on a few rows: FP8 grouped (with fp8 weights), else bf16 grouped
        (Hopper or newer on a GPU), else one GEMM per expert; FP8 on the CPU runs its oracle, the same math."""
        few, refused = min(pairs, 8), ""
        offs = self.offs.clamp(max=few)
        if self.w.fp8 is not None:
            if self.device.type == "cpu":
                return "fp8 loop (the CPU's)"
            try:
                fp8_grouped_mm(*quantize_rows(self.recv[:few]), *self.w.fp8["w13"], offs)
                return "fp8 grouped"
            except (RuntimeError, TypeError, ValueError) as e:
                refused = f" (fp8 refused: {type(e).__name__}: {str(e)[:100]})"
        try:
            grouped_mm(self.recv[:few], self.w.w13, offs)
            return "bf16 grouped" + refused
        except (RuntimeError, TypeError, ValueError) as e:
            return f"bf16 loop ({type(e).__name__}: {str(e)[:100]})" + refused

    def experts(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """x through this GPU's experts' `which` ("w13" or "w2") GEMMs, each row by its expert."""
        if self.gemm.startswith("fp8"):
            x8, sa = quantize_rows(x)
            wT8, sb = self.w.fp8[which]
            if self.gemm == "fp8 grouped":
                return fp8_grouped_mm(x8, sa, wT8, sb, self.offs)
            return fp8_grouped_mm_loop(x8, sa, wT8, sb, self.counts)
        w = getattr(self.w, which)
        if self.gemm.startswith("bf16 grouped"):
            return grouped_mm(x, w, self.offs)
        return grouped_mm_loop(x, w, self.counts)

    def routed(self) -> torch.Tensor:
        """This GPU's routed experts over the dispatched tokens: [pairs, hidden], sent back by the combine."""
        return self.experts(_silu_mul(self.experts(self.recv, "w13")), "w2")

    def stages(self, o_latent: torch.Tensor, h: torch.Tensor, comm: Comm):
        """The MoE layer's rest for attention output o_latent [T, heads, 512] and layer input h [T, hidden], in the
        stages of SGLang's two-batch overlap of a decode layer (ess.reference.stages): o_proj, norm and router end
        attention's core stage; the dispatch's launch and the shared expert; the wait for it, the experts and the
        combine's launch; the wait for the combine; the output (which starts the next layer's first stage)."""
        w = self.w
        x = A.rms_norm(A.attn_output(self.attn, o_latent.to(h.dtype)) + h, w.norm)
        (x @ w.gate).float().sigmoid().topk(self.shape.experts_per_token, dim=-1)  # the router (routing: the setup's)
        yield
        dispatched = comm.launch(self.dispatch_us)
        shared = _silu_mul(x @ w.s13) @ w.s2
        yield
        comm.wait(dispatched)
        self.routed()
        combined = comm.launch(self.combine_us)
        yield
        comm.wait(combined)
        yield
        return x + shared + self.combined

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        return _silu_mul(x @ self.w.d13) @ self.w.d2

    def __call__(self, o_latent: torch.Tensor, h: torch.Tensor, dense: bool = False) -> torch.Tensor:
        """The layer's output, serially (the waits inline); dense: the dense FFN in place of the MoE."""
        if dense:
            x = A.rms_norm(A.attn_output(self.attn, o_latent.to(h.dtype)) + h, self.w.norm)
            return x + self.dense(x)
        return drain(self.stages(o_latent, h, Comm(self.device)))

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.w.head
