"""The CPU as --calibrate sees it: ranks share the machine's cores (docs/planner.md, "Calibration from
a run"). A rank keeps min(threads, cores / ranks) cores busy, and both its math and its gloo transfers
(memory copies done by the same cores) run at that share, so calibrate.py fits numbers per core and a
layout gets `core_share` of them per rank (`cpu_device`)."""
from __future__ import annotations

import dataclasses

from ..hardware import GB, GPU, get_gpu


def threads_per_rank(ranks: int, cores: int) -> int:
    """Torch threads per rank when `meshlm train --nproc` starts `ranks` workers on `cores` cores
    without OMP_NUM_THREADS set (train/launch.py: cores // ranks, at least one)."""
    return max(1, cores // ranks)


def core_share(ranks: int, cores: int, threads: int | None = None, load: float = 0.0) -> float:
    """Cores one rank keeps busy. Linux gives every runnable thread the same share of the cores, so
    with `ranks` × `threads` of ours and `load` other runnable threads each of ours gets
    min(1, cores / (ranks·threads + load)) of a core. cores = 0: one device per rank (a GPU), share 1."""
    if not cores:
        return 1.0
    threads = threads_per_rank(ranks, cores) if threads is None else threads
    return threads * min(1.0, cores / (ranks * threads + load))


def external_load(available: float | None, ranks: int, cores: int, threads: int) -> float:
    """Other programs' runnable threads implied by the share of a core our threads got while
    runnable (`available`, from the run's schedstat seconds): the inverse of core_share."""
    if not available or not cores:
        return 0.0
    return max(0.0, cores / min(available, 1.0) - ranks * threads)


def cpu_device(rate_flops: float, link_bytes_s: float, ranks: int, cores: int, threads: int | None = None,
               load: float = 0.0, latency: tuple[float, float] | None = None) -> GPU:
    """The CPU as the planner sees it for `ranks` ranks of `threads` threads on `cores` cores beside
    `load` other runnable threads: the per-core rate and link bandwidth times the cores each rank
    keeps busy (core_share). `latency` (wall, core seconds per collective call, read_probe): a call
    takes its wall time or its core work at that share, whichever is longer (with fewer cores than
    ranks the waiting part is filled by the other ranks, the core work is stretched)."""
    share = core_share(ranks, cores, threads, load)
    ram = 64.0  # GB; the calibration predicts time, memory stays the planner's own model
    gpu = get_gpu("custom", peak_tflops=rate_flops * share / 1e12, hbm_gb=ram,
                  nvlink_gbps=link_bytes_s * share / GB, ib_gbps=link_bytes_s * share / GB, gpus_per_node=1024,
                  overlap_slowdown=0.0)  # a CPU's collectives are priced by core share (core_share) instead
    if latency is None:
        return gpu
    return dataclasses.replace(gpu, link_latency_s=max(latency[0], latency[1] / share))
