"""What optim.name = "muon" adds to a layout's price (docs/muon.md, parallel/optim/muon.py); the memory
terms live in memory.py (`muon_memory`), which this module's GEMM pricing (ops.py) sits above.

- memory: one fp32 momentum per Muon element replaces Adam's two moments (4 bytes less per element,
  per sharded element under ZeRO, whose moments leave Muon's pieces out). Transient: the whole fp32
  update of the largest matrix (a block's stacked experts at once) with Newton-Schulz's iterate and
  Gram matrices, and under ZeRO a block's pieces on their way to the owners (this rank's shard of its Muon matrices) and the
  owner's matrices (a 1/n share, at least the largest), fp32; under TP the owner exchange's buffers
  (this rank's slices of the split updates and the slices of the matrices it owns: one bucket's,
  `memory.muon_tp_bucket_bytes`; under ZeRO a block's owned 1/n).
- time: 5 quintic iterations per matrix, each (m×n)(n×m), (m×m)(m×m), (m×m)(m×n) GEMMs with m = min
  side, at the fp32 GEMM rate (`ops.gemm_seconds`). Each matrix is orthogonalised on one rank: the
  runtime deals a stage's matrices round-robin in order of decreasing cost over tp (the TP-split ones)
  and, under ZeRO, the shard group times tp (`parallel/muon.deal`); the busiest rank's share is the
  first of that deal (`ns_share`: whole matrices counted singly, a MoE block's stacked experts as their
  experts). A kv matrix that one kv head leaves unsplit runs on every TP rank.
- traffic, once per step after backward (nothing hides it): TP sends each owner the slices of its
  matrices and returns the results, two all-to-alls over tp per bucket (`memory.muon_tp_buckets`) of
  this rank's slices of every TP-split update (fp32; under ZeRO per block, of the matrices this rank
  owns in the shard group); ZeRO runs two
  all-to-alls per block over the shard group, each carrying this rank's shard of the block's Muon
  matrices in fp32 (to the owners, and the results back; (n-1)/n of it crosses a link).
  Expert matrices count over the same group as the dense ones, as `comm.collectives` counts ZeRO's.
"""
from __future__ import annotations

from . import comm as C
from .hardware import GPU
from .ops import gemm_seconds
from .memory import block_matrices, muon_shard_group, muon_tp_buckets
from .spec import Shape, Spec

NS_STEPS = 5  # optim.muon_ns_steps' default


def ns_gemms(rows: int, cols: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of each GEMM of one quintic iteration on a rows×cols matrix."""
    m, n = min(rows, cols), max(rows, cols)
    return [(m, m, n), (m, m, m), (m, n, m)]


def ns_seconds(rows: int, cols: int, gpu: GPU, steps: int = NS_STEPS) -> float:
    """Newton-Schulz on one whole matrix in fp32."""
    peak = gpu.peak("fp32")
    return steps * sum(gemm_seconds(m, n, k, gpu, 4, peak) for m, n, k in ns_gemms(rows, cols))


def ns_share(shape: Shape, s: Spec, layers: int) -> list[tuple[int, int]]:
    """The whole matrices (rows, cols) the busiest rank orthogonalises in one step on a rank holding
    `layers` blocks: every n·tp-th of the stage's matrices in order of decreasing cost (n: the ZeRO
    shard group), as the runtime deals them; unsplit kv matrices every n-th, on each TP rank."""
    a, n = shape.args, muon_shard_group(s)
    split, unsplit = [], []
    for r, c, k in block_matrices(shape, s.ep):
        kv_whole = s.tp > 1 and a.n_kv_heads == 1 and (r, c) == (a.head_dim, a.dim)
        (unsplit if kv_whole else split).extend([(r, c)] * round(layers * k))

    def first(mats: list[tuple[int, int]], g: int) -> list[tuple[int, int]]:
        return sorted(mats, key=lambda m: -ns_flops(*m))[0::g]
    return first(split, n * s.tp) + first(unsplit, n)


def ns_flops(rows: int, cols: int, steps: int = NS_STEPS) -> float:
    """Newton-Schulz's GEMM FLOPs on one whole matrix."""
    return steps * sum(2 * m * n * k for m, n, k in ns_gemms(rows, cols))


def muon_step(shape: Shape, s: Spec, layers: int, gpu: GPU | None,
              comm_efficiency: float = 0.8) -> tuple[float, list]:
    """(Newton-Schulz seconds, [Collective]) of one step on a rank holding `layers` blocks."""
    mats = block_matrices(shape, s.ep)
    n = muon_shard_group(s)
    secs = 0.0 if gpu is None else sum(ns_seconds(r, c, gpu) for r, c in ns_share(shape, s, layers))
    colls = []
    if s.tp > 1:  # this rank's slices to the owners and the results back; under ZeRO per block, its owned 1/n
        local = 4 * layers * sum(r * c * k for r, c, k in mats) / s.tp / n
        calls = 2 * (layers if s.zero and n > 1 else muon_tp_buckets(shape, s.tp, s.ep, s.bucket_mb, layers))
        colls.append(C.make(gpu, "tp", "all_to_all", s.tp, 1, calls, 2 * local / calls, window="step",
                            per="step", comm_efficiency=comm_efficiency))
    if s.zero and n > 1:  # per block: this rank's shard of its Muon matrices to the owners, the results back
        shard = 4 * sum(r * c * k for r, c, k in mats) / s.tp / n
        colls.append(C.make(gpu, "dp_shard", "all_to_all", n, s.tp, 2 * layers, shard, window="step",
                            per="step", comm_efficiency=comm_efficiency))
    return secs, colls
