"""DeepSeek's FP8 checkpoints (e4m3 weights, a scale per 128 x 128 block) on a CPU without AMX.

SGLang's FP8 methods on the CPU run sgl-kernel's AMX kernels as W8A16: FP8 weights, bf16 activations. Without AMX
they refuse at load ("Fp8LinearMethod on CPU requires that CPU has AMX support"). Here the same W8A16 arithmetic is
done once at load: each block-scaled weight is dequantized by SGLang's own `block_quant_dequant` (values x their
block's scale_inv, to bf16) and the layer is handed to SGLang's unquantized method, as a bf16 checkpoint's layer
is. The FP8 checkpoint still goes through SGLang's FP8 loader (its parameters, scales and fused projections); only
the product is in bf16. On a GPU, or a CPU with AMX, SGLang's own FP8 path runs (docs/cpu-path.md).
"""

from __future__ import annotations

import torch

from sglang.srt.plugins.hook_registry import HookType
from sglang_ess.hooks.table import Hook, expected_params

FP8 = "sglang.srt.layers.quantization.fp8"


def _say_once(kind: str) -> None:
    from sglang.srt.utils.common import print_info_once  # SGLang's log-once (one line a message a process)

    print_info_once(f"ESS CPU path: {kind} FP8 block-scaled weights dequantized to bf16 at load (no AMX: W8A16 as "
                    "SGLang's AMX kernels compute it)")


def _dequantized(layer, name: str, scale_name: str, block: list[int]) -> None:
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    weight = getattr(layer, name)
    bf16 = block_quant_dequant(weight.data, getattr(layer, scale_name).data, block, torch.bfloat16)
    setattr(layer, name, torch.nn.Parameter(bf16, requires_grad=False))
    delattr(layer, scale_name)


def _refused_here(method, weight: torch.Tensor) -> bool:
    """SGLang's CPU FP8 path would refuse this layer: block-quantized CPU weights and no AMX."""
    from sglang.srt.utils import cpu_has_amx_support

    return weight.device.type == "cpu" and method.block_quant and not cpu_has_amx_support()


def around_linear_process_weights(original, method, layer):
    """Fp8LinearMethod.process_weights_after_loading: on a CPU without AMX, the weight dequantized to bf16 and the
    layer given SGLang's UnquantizedLinearMethod; elsewhere SGLang's."""
    if not _refused_here(method, layer.weight):
        return original(method, layer)
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    _dequantized(layer, "weight", "weight_scale_inv", method.quant_config.weight_block_size)
    layer.quant_method = UnquantizedLinearMethod()
    _say_once("linear layers'")


def around_moe_process_weights(original, method, layer):
    """Fp8MoEMethod.process_weights_after_loading: on a CPU without AMX, the experts' weights dequantized to bf16 and
    the layer given SGLang's UnquantizedFusedMoEMethod (its runner made as FusedMoE makes it); elsewhere SGLang's."""
    if not _refused_here(method, layer.w13_weight):
        return original(method, layer)
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    block = method.quant_config.weight_block_size
    _dequantized(layer, "w13_weight", "w13_weight_scale_inv", block)
    _dequantized(layer, "w2_weight", "w2_weight_scale_inv", block)
    unquantized = UnquantizedFusedMoEMethod()
    unquantized.create_moe_runner(layer, layer.moe_runner_config)
    layer.quant_method = unquantized
    _say_once("the experts'")


PATCHES = [
    Hook(f"{FP8}.Fp8LinearMethod.process_weights_after_loading", HookType.AROUND, around_linear_process_weights,
         ("self", "layer"), "asserts AMX on the CPU ('Fp8LinearMethod on CPU requires that CPU has AMX support')"),
    Hook(f"{FP8}.Fp8MoEMethod.process_weights_after_loading", HookType.AROUND, around_moe_process_weights,
         ("self", "layer"), "asserts AMX on the CPU ('Fp8MoEMethod on CPU requires that CPU has AMX support')"),
]

EXPECTED_PARAMS = expected_params(PATCHES)  # the tests' view: target -> the parameters its hook reads
