"""What optim.name = "muon" adds to a layout's price (docs/muon.md, parallel/muon.py); the memory
terms live in memory.py (`muon_memory`), which this module's GEMM pricing (ops.py) sits above.

- memory: one fp32 momentum per Muon element replaces Adam's two moments (4 bytes less per element,
  per sharded element under ZeRO, whose moments leave Muon's pieces out). Transient: the whole fp32 update of the largest
  matrix (a block's stacked experts at once) with Newton-Schulz's iterate and Gram matrices, and under
  ZeRO a block's pieces on their way to the owners (this rank's shard of its Muon matrices) and the
  owner's matrices (a 1/n share, at least the largest), fp32.
- time: 5 quintic iterations per matrix, each (m×n)(n×m), (m×m)(m×m), (m×m)(m×n) GEMMs with m = min
  side, at the fp32 GEMM rate (`ops.gemm_seconds`). Every TP rank orthogonalises whole matrices; ZeRO
  deals them round-robin over the shard group, so each rank does 1/n of the stage's.
- traffic, once per step after backward (nothing hides it): TP all-gathers each update (fp32) over tp;
  ZeRO runs two all-to-alls per block over the shard group, each carrying this rank's shard of the
  block's Muon matrices in fp32 (to the owners, and the results back; (n-1)/n of it crosses a link).
  Expert matrices count over the same group as the dense ones, as `comm.collectives` counts ZeRO's.
"""
from __future__ import annotations

from . import comm as C
from .hardware import GPU
from .ops import gemm_seconds
from .memory import block_matrices, muon_shard_group
from .spec import Shape, Spec

NS_STEPS = 5  # optim.muon_ns_steps' default


def ns_seconds(rows: int, cols: int, gpu: GPU, steps: int = NS_STEPS) -> float:
    """Newton-Schulz on one whole matrix in fp32."""
    m, n = min(rows, cols), max(rows, cols)
    peak = gpu.peak("fp32")
    one = gemm_seconds(m, m, n, gpu, 4, peak) + gemm_seconds(m, m, m, gpu, 4, peak) + gemm_seconds(m, n, m, gpu, 4, peak)
    return steps * one


def muon_step(shape: Shape, s: Spec, layers: int, gpu: GPU | None,
              comm_efficiency: float = 0.8) -> tuple[float, list]:
    """(Newton-Schulz seconds, [Collective]) of one step on a rank holding `layers` blocks."""
    mats = block_matrices(shape, s.ep)
    n = muon_shard_group(s)
    secs = 0.0 if gpu is None else layers / n * sum(k * ns_seconds(r, c, gpu) for r, c, k in mats)
    colls = []
    if s.tp > 1:
        calls = layers * sum(k for _, _, k in mats)
        whole = layers * sum(r * c * k for r, c, k in mats) * 4
        colls.append(C.make(gpu, "tp", "all_gather", s.tp, 1, calls / n, whole / calls, window="step",
                            per="step", comm_efficiency=comm_efficiency))
    if s.zero and n > 1:  # per block: this rank's shard of its Muon matrices to the owners, the results back
        shard = 4 * sum(r * c * k for r, c, k in mats) / s.tp / n
        colls.append(C.make(gpu, "dp_shard", "all_to_all", n, s.tp, 2 * layers, shard, window="step",
                            per="step", comm_efficiency=comm_efficiency))
    return secs, colls
