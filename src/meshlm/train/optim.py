"""The step's numerics around the optimizer: the global grad norm, clipping and fp16 loss scaling (the
optimizers themselves live in parallel/optim/; the LR schedule is core/facts/course.py `lr_at`)."""
from __future__ import annotations

import torch

from ..distributed.comm import Comm


def grad_norm(grads: list[torch.Tensor], world: Comm, device: torch.device | str | None = None,
              carry: torch.Tensor | None = None) -> torch.Tensor:
    """Global L2 norm. `grads`: the gradient pieces this rank owns (`Parallelized.norm_grads`: the
    placement records give every element exactly one owner over the world), so one all-reduce of the
    sum of squares over every rank counts each element once, whatever the layout. `carry`: a float32
    tensor summed over the world in the same all-reduce, in place (train/resilience/preempt.py's per-step flag)."""
    sq = torch._foreach_norm(grads, 2.0) if grads else []
    part = torch.stack([n.float() for n in sq]).pow(2).sum() if sq else torch.zeros((), device=device)
    if carry is None:
        world.all_reduce(part)
        return part.sqrt()
    both = torch.cat([part.reshape(1), carry.to(part.device)])
    world.all_reduce(both)
    carry.copy_(both[1:])
    return both[0].sqrt()


@torch.no_grad()
def clip_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    if max_norm <= 0:
        return
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].device) if grads else coef)


class LossScaler:
    """Dynamic loss scaling for fp16: skip the step on inf/nan and halve (never below 1), double after
    `growth_interval` clean steps in a row.

    The scale (fp32, 0-dim) and the clean-step counter (int32) live on the training device and
    `update` runs there (`torch._amp_update_scale_`, as torch.amp.GradScaler), so a step never waits
    for the host to learn whether it overflowed. Disabled (bf16/fp32): the scale is 1.0 and the
    trainer neither multiplies by it nor unscales. `state_dict` reads the device values (checkpoints).
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_interval: int = 1000,
                 device: torch.device | str = "cpu"):
        self.enabled = enabled
        self.growth_interval = growth_interval
        self._scale = torch.full((), init_scale if enabled else 1.0, dtype=torch.float32, device=device)
        self._good_steps = torch.zeros((), dtype=torch.int32, device=device)

    @property
    def scale(self) -> torch.Tensor:
        """The current scale: a 0-dim fp32 tensor on the device (1.0 when disabled)."""
        return self._scale

    @scale.setter
    def scale(self, value: float | torch.Tensor) -> None:
        self._scale.fill_(value)

    def inv_scale(self) -> torch.Tensor:
        return self._scale.reciprocal()

    def update(self, found_inf: torch.Tensor) -> None:
        """`found_inf`: fp32 0-dim on the scale's device, 1.0 if this step's gradients overflowed."""
        if not self.enabled:
            return
        torch._amp_update_scale_(self._scale, self._good_steps, found_inf, 2.0, 0.5, self.growth_interval)
        self._scale.clamp_(min=1.0)

    def state_dict(self) -> dict:
        return {"scale": float(self._scale), "good_steps": int(self._good_steps)}

    def load_state_dict(self, d: dict) -> None:
        self._scale.fill_(float(d["scale"]))
        self._good_steps.fill_(int(d["good_steps"]))
