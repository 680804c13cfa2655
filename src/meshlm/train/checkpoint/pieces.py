"""This rank's pieces of each full tensor: rectangles with their offsets, and whether this rank writes
them. Plain data with no DCP import, so that a worker that never saves or resumes does not import DCP
(0.4 s of CPU with DTensor, on every worker start); dcp_io.py hands pieces to DCP's planners."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

# One-process runs use DCP without a process group on purpose (set here, where the package is imported).
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@dataclass
class Pieces:
    """This rank's rectangles of one full tensor: (offsets, tensor) each, and whether it writes them
    (one copy of each element writes; every copy reads)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: list[tuple[tuple[int, ...], torch.Tensor]]
    write: bool
    # Where the parts are meta tensors (offload = "nvme"): what reads and writes their values, one part
    # at a time (parallel/optim/nvme.FileRange: `read(view) -> tensor`, `write(view, tensor)`)
    backing: object | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.parts) if self.write else 0

    def to_host(self) -> "Pieces":
        """A snapshot in host memory (pinned on CUDA) for a background write."""
        if self.backing is not None:
            raise ValueError("pieces kept in files are written synchronously (Checkpointer.save)")
        pin = torch.cuda.is_available()
        return Pieces(self.shape, self.dtype, [(o, t.detach().to("cpu", copy=True).pin_memory() if pin else
                                               t.detach().to("cpu", copy=True)) for o, t in self.parts], self.write)
