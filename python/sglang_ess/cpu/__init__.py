"""The CPU path: SGLang 0.5.23 serving a DeepSeek-V3.2 (DSA) model with `--device cpu`, for stock and ESS launches.

Stock SGLang runs DeepSeek-V3.2's sparse attention through CUDA kernels only (FlashMLA, DeepGEMM's FP8 MQA logits,
Triton and sgl-kernel ops), and its CPU engine expects sgl-kernel's CPU build. This room puts a torch implementation
in place of each kernel where SGLang calls it and sets the launch settings a CPU needs, so that
`python -m sglang.launch_server --model-path M --device cpu` serves the model, otherwise unchanged:
    resolution.py           launch settings, inside SGLang's argument resolution (the switch of the whole path)
    standin/sgl_kernel      sgl_kernel's stand-in: importable, every kernel raises if called
    flash_mla_interface.py  SGLang's FlashMLA interface module, computed in torch
    patches.py              every other patch point: a named SGLang target, its hook, the parameters it reads, and why
    fp8.py                  DeepSeek's FP8 checkpoints where SGLang's CPU FP8 path needs AMX: dequantized at load
Every target is checked by the tests to exist in the installed version, as the plugin's hook table is; every
replacement keeps SGLang's contract, and one that takes tensors runs only for CPU tensors (a CUDA tensor goes to
SGLang's own kernel). docs/cpu-path.md.
"""

import importlib
import os
import sys

from sglang_ess.cpu.resolution import CPU_ENGINE_ENV


def kernels_needed() -> bool:
    """This process may run SGLang's DSA kernels on CPU tensors: it runs SGLang's CPU engine (the launcher's CPU path
    set it for the scheduler processes), or no CUDA device is present (no CUDA kernel can run)."""
    import torch

    return os.environ.get(CPU_ENGINE_ENV) == "1" or not torch.cuda.is_available()


def install_flash_mla_interface() -> bool:
    """SGLang's FlashMLA interface module, or where it cannot load (FlashMLA's CUDA library, no driver) the CPU path's.
    Returns whether the CPU path's took its place."""
    from sglang_ess.cpu import flash_mla_interface

    name = flash_mla_interface.NAME
    if sys.modules.get(name) is flash_mla_interface:
        return True
    try:
        importlib.import_module(name)
        return False
    except (ImportError, OSError):
        sys.modules.pop(name, None)
        sys.modules[name] = flash_mla_interface
        return True


def install() -> None:
    """Register the CPU path's resolution steps (each a no-op unless a DSA model runs on the CPU); where the kernels
    may be needed (kernels_needed), its patches and SGLang's FlashMLA interface too. On a GPU server nothing is
    patched."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    from sglang_ess.hooks import table
    from sglang_ess.cpu import fp8, hisparse
    from sglang_ess.cpu.patches import PATCHES
    from sglang_ess.cpu.resolution import RESOLUTION_STEPS

    for step, wrapper in RESOLUTION_STEPS.items():
        register_resolution_hook(step)(wrapper)
    if kernels_needed():
        table.register(PATCHES)
        table.register(hisparse.PATCHES)
        table.register(fp8.PATCHES)
        install_flash_mla_interface()
