"""Which AdamW kernel runs, and skipping a step on the device. Shared by train/optim.MasterOptimizer
and parallel/zero_optim.ZeroOptimizer so that one process and ZeRO run the same arithmetic."""
from __future__ import annotations

import torch


def fused_adamw_supported(device: torch.device | str) -> bool:
    """Whether torch has a fused AdamW kernel for `device` (CUDA always; CPU in recent torch). The
    fused kernel reads `found_inf` on the device and skips the whole update there (parameters, moments
    and step count unchanged), so an fp16 overflow needs no host read. MasterOptimizer and
    ZeroOptimizer both choose with this, so one process and ZeRO run the same arithmetic."""
    kind = torch.device(device).type
    if kind == "cuda":
        return True
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        return kind in _get_fused_kernels_supported_devices()
    except ImportError:
        return False


def adamw_step(opt: torch.optim.Optimizer, fused: bool, found_inf: torch.Tensor | None) -> bool:
    """One AdamW step unless `found_inf` (fp32 0-dim, exactly 0.0 or 1.0) is set. Fused: the kernel
    skips itself on the device, no host read. Not fused: read `found_inf` on the host (only where the
    optimizer runs on the CPU anyway). Returns False when it knows the step was skipped."""
    if fused:
        opt.found_inf = found_inf  # torch's _fused_adamw: no update, and the step count is restored
        opt.step()
        return True
    if found_inf is not None and bool(found_inf):
        return False
    opt.step()
    return True
