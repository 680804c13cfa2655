"""What optim.name = "muon" adds to a layout's price (docs/muon.md, parallel/optim/muon.py): its memory
(`muon_memory`, which memory.stage_memory adds), time and traffic (`muon_step`, estimate's).

- memory: one fp32 momentum per Muon element replaces Adam's two moments (4 bytes less per element,
  per sharded element under ZeRO, whose moments leave Muon's pieces out). Transient: the whole fp32
  update of the largest matrix (a block's stacked experts at once) with Newton-Schulz's iterate and
  Gram matrices, and under ZeRO a block's pieces on their way to the owners (this rank's shard of its Muon matrices) and the
  owner's matrices (a 1/n share, at least the largest), fp32; under TP the owner exchange's buffers
  (this rank's slices of the split updates and the slices of the matrices it owns: one bucket's,
  `muon_tp_bucket_bytes`; under ZeRO a block's owned 1/n).
- time: 5 quintic iterations per matrix, each (m×n)(n×m), (m×m)(m×m), (m×m)(m×n) GEMMs with m = min
  side, at the fp32 GEMM rate (`ops.gemm_seconds`). Each matrix is orthogonalised on one rank: the
  runtime deals a stage's matrices round-robin in order of decreasing cost over tp (the TP-split ones)
  and, under ZeRO, the shard group times tp (`parallel/optim/muon.deal`); the busiest rank's share is the
  first of that deal (`ns_share`: whole matrices counted singly, a MoE block's stacked experts as their
  experts). A kv matrix that one kv head leaves unsplit runs on every TP rank.
- traffic, once per step after backward (nothing hides it): TP sends each owner the slices of its
  matrices and returns the results, two all-to-alls over tp per bucket (`muon_tp_buckets`) of
  this rank's slices of every TP-split update (fp32; under ZeRO per block, of the matrices this rank
  owns in the shard group); ZeRO runs two
  all-to-alls per block over the shard group, each carrying this rank's shard of the block's Muon
  matrices in fp32 (to the owners, and the results back; (n-1)/n of it crosses a link).
  Expert matrices count over the same group as the dense ones, as `comm.collectives` counts ZeRO's.
"""
from __future__ import annotations

from functools import lru_cache

from . import comm as C
from ..hardware import GPU, MIB
from .ops import gemm_seconds
from ..spec import Shape, Spec

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
    a, n = shape.args, s.shard_group
    split, unsplit = [], []
    for r, c, k in block_matrices(shape, s.ep):
        kv_whole = s.tp_enabled and a.n_kv_heads == 1 and (r, c) == (a.head_dim, a.dim)
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
    n = s.shard_group
    secs = 0.0 if gpu is None else sum(ns_seconds(r, c, gpu) for r, c in ns_share(shape, s, layers))
    colls = []
    if s.tp_enabled:  # this rank's slices to the owners and the results back; under ZeRO per block, its owned 1/n
        local = 4 * layers * sum(r * c * k for r, c, k in mats) / s.tp / n
        calls = 2 * (layers if s.zero_enabled else muon_tp_buckets(shape, s.tp, s.ep, s.bucket_mb, layers))
        colls.append(C.make(gpu, "tp", "all_to_all", s.tp, 1, calls, 2 * local / calls, window="step",
                            per="step", comm_efficiency=comm_efficiency))
    if s.zero_enabled:  # per block: this rank's shard of its Muon matrices to the owners, the results back
        shard = 4 * sum(r * c * k for r, c, k in mats) / s.tp / n
        colls.append(C.make(gpu, "dp_shard", "all_to_all", n, s.tp, 2 * layers, shard, window="step",
                            per="step", comm_efficiency=comm_efficiency))
    return secs, colls


# ---------------------------------------------------------------------------------- memory

def block_matrices(shape: Shape, ep: int = 1) -> list[tuple[int, int, float]]:
    """(rows, cols, matrices per block on one rank) of Muon's matrices, whole (before TP); MoE blocks
    averaged over the blocks as `stages.block_params_local` does; experts split over ep."""
    a = shape.args
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    out = [(q, a.dim, 1.0), (kv, a.dim, 2.0), (a.dim, q, 1.0)]
    frac = a.n_moe_blocks / a.n_layers if shape.moe else 0.0
    if frac < 1:
        out += [(a.ffn_dim, a.dim, 2 * (1 - frac)), (a.dim, a.ffn_dim, 1 - frac)]
    if frac > 0:
        experts = -(-shape.num_experts // ep) + shape.shared_experts
        out += [(a.expert_dim, a.dim, 2 * frac * experts), (a.dim, a.expert_dim, frac * experts)]
    return out


def muon_memory(shape: Shape, s: Spec, layers: int) -> tuple[float, float]:
    """(optimizer-state bytes added, negative when saved; transient buffer bytes) on a rank holding
    `layers` blocks."""
    mats = block_matrices(shape, s.ep)
    block = sum(r * c * k for r, c, k in mats) / s.tp  # one block's Muon elements on this TP rank
    n = s.shard_group
    state = -4 * layers * block / n  # one momentum for Adam's two moments, on this rank's shard under ZeRO
    r, c, batch = _largest_matrix(mats)
    m = min(r, c)
    buf = 4 * batch * (2 * r * c + 2 * m * m)
    if s.zero_enabled:  # a block's pieces to their owners (its shard) and the owner's matrices (>= the largest)
        buf += 4 * (block / n + max(block / n, batch * r * c / s.tp))
    if s.tp_enabled:  # the owner exchange over tp: this rank's slices, its owned matrices' (under ZeRO a block's)
        buf += 8 * block / n if s.zero_enabled else muon_tp_bucket_bytes(shape, s, layers)
    return state, buf


def _largest_matrix(mats: list[tuple[int, int, float]]) -> tuple[int, int, float]:
    """(rows, cols, batch) of the largest tensor NS runs on: stacked experts are orthogonalised together."""
    r, c, k = max(mats, key=lambda x: x[0] * x[1] * (x[2] if x[2] > 2 else 1))
    return r, c, k if k > 2 else 1


@lru_cache(maxsize=4096)
def muon_tp_buckets(shape: Shape, tp: int, ep: int, bucket_mb: float, layers: int) -> int:
    """Without ZeRO: how many buckets the tp owner exchange packs a step's split matrices into, filling
    each to max(bucket_mb, the largest slice) in block order (the runtime's receive limit left out)."""
    mats = block_matrices(shape, ep)
    sizes = [r * c / tp for r, c, k in mats for _ in range(max(1, round(k)))] * layers
    cap, out, at = max(bucket_mb * MIB / 4, max(sizes)), 1, 0.0
    for sz in sizes:
        if at and at + sz > cap:
            out, at = out + 1, 0.0
        at += sz
    return out


def muon_tp_bucket_bytes(shape: Shape, s: Spec, layers: int) -> float:
    """Without ZeRO: the largest bucket of the tp owner exchange (parallel/optim/muon.py `buckets`), its send
    buffer (this rank's slices: within max(bucket_mb, the largest slice), at most the step's) and its
    receive buffer (the whole matrices this rank owns: within max(bucket_mb, the largest matrix), at
    most about the step's share, a slice per matrix, plus one matrix), fp32."""
    mats = block_matrices(shape, s.ep)
    step = layers * sum(r * c * k for r, c, k in mats) / s.tp
    r, c, batch = _largest_matrix(mats)
    whole, cap = batch * r * c, s.bucket_mb * MIB / 4
    return 4 * (min(step, max(cap, whole / s.tp)) + min(step + whole, max(cap, whole)))
