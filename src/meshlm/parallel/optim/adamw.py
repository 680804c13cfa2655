"""The optimizer interface the trainer drives, which AdamW kernel runs, and skipping a step on the
device. Shared by parallel/optim/master.MasterOptimizer (whole tensors) and optim/zero_adamw.ZeroOptimizer and
NvmeOptimizer (this rank's flat shards), so that one process and ZeRO run the same arithmetic."""
from __future__ import annotations

from typing import Protocol

import torch


class Optimizer(Protocol):
    """What `Parallelized.optimizer` is, whichever layout built it. tests/test_optim_protocol.py checks
    that every implementation has these methods with these parameters."""

    def set_lr(self, lr: float) -> None:
        """The learning rate of the coming step (every parameter group)."""

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """One AdamW update of this rank's masters, skipped when `found_inf` is set (`adamw_step`);
        the updated values reach the parameters the model computes with."""

    def param_tensors(self) -> list[torch.Tensor]:
        """The parameter storage this rank keeps between steps (memory accounting)."""

    def state_bytes(self) -> int:
        """Bytes of optimizer-only tensors on this rank: Adam moments and separate fp32 masters."""

    def step_count(self) -> int:
        """Adam steps taken (the bias-correction step), as a checkpoint records it."""

    def state_storage(self) -> list[tuple[str, str, torch.Tensor]]:
        """(parameter name, kind: master / exp_avg / exp_avg_sq, tensor): this rank's own pieces, laid
        out as the parameter's placement says, which checkpoints write and load in place."""

    def loaded(self, step: int) -> None:
        """`state_storage` was filled from a checkpoint: set the step count, publish the masters."""

    def backing(self, name: str, kind: str) -> object | None:
        """Where a meta tensor of `state_storage` lives (offload = "nvme": a stretch of a state file that
        checkpoints read and write through: nvme.FileRange); None for optimizers whose state is in memory."""

    def close(self) -> None:
        """Release what outlives the run otherwise (nvme: the scratch files); nothing for the others."""


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
