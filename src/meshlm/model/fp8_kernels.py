"""Which float8 kernels this torch has (docs/fp8.md, "Where each path runs"): torch._scaled_mm for the
block linears (torchao's Float8Linear: CUDA from compute capability 8.9, and the CPU in torch builds that
register one, 2.13's among them) and torch._scaled_grouped_mm for the MoE experts (CUDA only: the CPU
experts run the emulated grouped GEMMs of model/fp8_grouped.py).

Whether a backend registers an op is not exposed, so the CPU is asked by running it once on a tiny
input, with the recipe's scale shapes and operand dtypes, and checking the answer."""
from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_scaled_mm_missing(recipe: str) -> str | None:
    """None where torch._scaled_mm runs `recipe` (tensorwise: one scale per tensor, e4m3 and e5m2
    operands; rowwise: one per row of each operand) on the CPU; else what is missing, in words."""
    if not hasattr(torch, "_scaled_mm"):
        return f"torch._scaled_mm (torch {torch.__version__} has none)"
    a = torch.full((16, 32), 2.0)
    rows = recipe == "rowwise"
    sa, sb = (torch.full((16, 1), 0.5), torch.full((1, 16), 0.25)) if rows else (torch.tensor(0.5), torch.tensor(0.25))
    try:
        for da, db in ((torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e5m2, torch.float8_e4m3fn)):
            out = torch._scaled_mm(a.to(da), a.to(db).t(), sa, sb, out_dtype=torch.bfloat16)
            if not torch.equal(out, torch.full((16, 16), 4.0 * 32 * 0.125, dtype=torch.bfloat16)):
                return f"a correct {recipe} torch._scaled_mm on the CPU (torch {torch.__version__}'s is off)"
    except (RuntimeError, NotImplementedError) as e:
        why = str(e).splitlines()[0][:120]
        return f"a {recipe} torch._scaled_mm on the CPU (torch {torch.__version__}: {why})"
    return None


def grouped_kernel(device_type: str) -> bool:
    """torch._scaled_grouped_mm runs the experts' products: CUDA with a torch that has it (the CPU build
    registers none in torch 2.13: 'Could not run aten::_scaled_grouped_mm ... CPU backend')."""
    return device_type == "cuda" and hasattr(torch, "_scaled_grouped_mm")


def fp8_path(device_type: str, recipe: str, emulate: bool, moe: bool) -> str:
    """The start-up line's words for which float8 code runs: production (torch._scaled_mm under torchao's
    Float8Linear) or torchao's emulation, and the experts' grouped GEMMs where the model has them."""
    if emulate:
        return f"float8 {recipe} emulated (training.fp8_emulate)"
    line = f"float8 {recipe} through torch._scaled_mm on {device_type}"
    if moe:
        line += ("; experts through torch._scaled_grouped_mm" if grouped_kernel(device_type)
                 else f"; experts emulated (no torch._scaled_grouped_mm on {device_type})")
    return line


def check_fp8_device(training, moe: bool) -> None:
    """training.precision = "fp8" against this process's device (`training`, the training section; `moe`:
    the model has experts): the CPU needs a working torch._scaled_mm for the recipe (its experts emulate
    whatever is asked), a GPU compute capability 8.9 (9.0 and torch._scaled_grouped_mm for experts).
    One line naming what is missing, with training.fp8_emulate as the way to run anyway; emulation runs
    anywhere."""
    from ..core.errors import ConfigError
    t = training
    if t.precision != "fp8" or t.fp8_emulate:
        return
    hint = "(training.fp8_emulate = true runs torchao's emulation instead)"
    if t.device == "cpu" or not torch.cuda.is_available():  # the CPU's experts emulate (model/fp8_kernels.py)
        missing = cpu_scaled_mm_missing(t.fp8_recipe)
        if missing:
            raise ConfigError(f"training.precision: fp8 on the CPU needs {missing} {hint}")
        return
    if torch.cuda.get_device_capability() < (8, 9):
        cap = ".".join(map(str, torch.cuda.get_device_capability()))
        raise ConfigError(f"training.precision: fp8 needs compute capability >= 8.9 (Ada, Hopper or newer); "
                          f"{torch.cuda.get_device_name()} has {cap} {hint}")
    if moe:  # the experts' float8 grouped GEMMs (model/fp8_grouped.py)
        if not hasattr(torch, "_scaled_grouped_mm"):
            raise ConfigError(f"training.precision: fp8 for mixture-of-experts models needs torch._scaled_grouped_mm "
                              f"for the experts' float8 grouped GEMMs; torch {torch.__version__} has none {hint}")
        if torch.cuda.get_device_capability() < (9, 0):
            raise ConfigError(f"training.precision: fp8 for mixture-of-experts models needs compute capability "
                              f">= 9.0 (torch._scaled_grouped_mm: Hopper or newer); {torch.cuda.get_device_name()} "
                              f"has {'.'.join(map(str, torch.cuda.get_device_capability()))} {hint}")
