"""What a run reports: MFU against the device's peak, per-rank memory, collective bytes and time,
one JSON line per logged step (global rank 0), a progress bar and optional TensorBoard."""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch

# Dense bf16 tensor-core peaks (FLOP/s), from the vendors' datasheets.
PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "B200": 2250e12,
}


def device_peak(device: torch.device) -> tuple[float, str]:
    """(peak FLOP/s per device, label). On CPU the peak is measured once with an fp32 matmul."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in PEAK_FLOPS.items():
            if key in name:
                return flops, f"{name} (datasheet bf16)"
        return 0.0, f"{name} (unknown peak)"
    return measure_cpu_peak(), "cpu (measured fp32 matmul)"


def measure_cpu_peak(n: int = 512, seconds: float = 0.3) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2.0 * n ** 3 * reps / (time.perf_counter() - t0)


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (views and tied weights counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return int(kb) * 1024


class MetricsLog:
    """Rank 0 writes; other ranks hold a disabled instance so call sites need no rank checks."""

    def __init__(self, run_dir: str, enabled: bool, total_steps: int, start_step: int,
                 progress: bool = True, tensorboard: bool = False):
        self.enabled = enabled
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a") if enabled else None
        self.bar = None
        self.tb = None
        if enabled and progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            file=sys.stderr, disable=None)
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError("metrics.tensorboard: needs the `tensorboard` package "
                                   "(pip install 'meshlm[tensorboard]')") from e
            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, record["step"])
                elif isinstance(v, dict) and k == "mem":
                    for mk, mv in v.items():
                        self.tb.add_scalar(f"mem/{mk}", mv, record["step"])
        if self.bar is not None and "loss" in record:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                 mfu=f"{100 * record['mfu']:.1f}%", refresh=False)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.file is not None:
            self.file.close()
