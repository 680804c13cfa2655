"""Saving on preemption (`checkpoint.on_signal`): Slurm and Kubernetes send a signal some seconds before
they kill a job; the run saves a checkpoint at a step boundary every rank agrees on and exits with
PREEMPTED_BASE + the signal's number (docs/fault_tolerance.md, "Preemption").

The handler, installed in the main thread, only remembers the signal. Agreement costs no collective
of its own: each rank's flag (1.0 once it got a signal) rides in the gradient-norm all-reduce every
step runs anyway (optim.grad_norm's `carry`: one more float32 in the same call), so a signal that
reached one rank stops every rank at the same step. Reading the summed flag:
- CPU (gloo): the all-reduce already ran on the host; the flag is read after the step it rode in.
- CUDA: a host read would wait for the whole step. The summed flag is copied to pinned memory
  without blocking, and the boundary after step N reads the copy of step N-1 (an event wait that is
  over unless the host ran more than a step ahead of the device). The run then stops one step after
  the signal, on every rank alike."""
from __future__ import annotations

import signal
import threading

import torch

PREEMPTED_BASE = 128  # the shell's convention for "ended by a signal": SIGTERM -> 143


def exit_status(name: str) -> int:
    """The status of a run that saved and stopped on signal `name`."""
    return PREEMPTED_BASE + int(signal.Signals[name])


def message(name: str, step: int, saved: bool = True) -> str:
    return f"preempted by {name} at step {step}, " + ("checkpoint saved" if saved else "the checkpoint failed")


class Preemption:
    def __init__(self, names: list[str], device: torch.device):
        self.got = 0  # the number of the first signal received, 0 before
        self.device = device
        self.lagged = device.type == "cuda"
        self.pending: tuple[torch.cuda.Event, torch.Tensor] | None = None  # CUDA: the last step's copy
        self.previous: dict[int, object] = {}
        if names and threading.current_thread() is threading.main_thread():
            for name in names:
                num = int(signal.Signals[name])
                self.previous[num] = signal.signal(num, self._handler)

    def _handler(self, signum, frame) -> None:
        self.got = self.got or signum

    def flag(self) -> torch.Tensor:
        """This rank's flag for the step about to run (summed over the world by the step)."""
        return torch.full((1,), 1.0 if self.got else 0.0, dtype=torch.float32, device=self.device)

    def agreed(self, summed: torch.Tensor) -> bool:
        """After a step whose all-reduce summed the flags into `summed`: stop now? The same answer on
        every rank (CUDA: from the previous step's sum, see the module's docstring)."""
        if not self.lagged:
            return float(summed[0]) > 0
        host = torch.empty(1, dtype=torch.float32, pin_memory=True)
        host.copy_(summed, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        last, self.pending = self.pending, (done, host)
        if last is None:
            return False
        last[0].synchronize()
        return float(last[1][0]) > 0

    def name(self, world) -> str:
        """The signal to report: the largest number any rank received (one small all-reduce, once)."""
        num = int(world.all_reduce_scalars([float(self.got)], op=torch.distributed.ReduceOp.MAX)[0])
        return signal.Signals(num).name

    def close(self) -> None:
        """The handlers that were there before (a run inside another program leaves them as found)."""
        for num, old in self.previous.items():
            signal.signal(num, old)
        self.previous = {}
