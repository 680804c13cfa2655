"""Checkpoint size, save time and goodput (the useful fraction of wall time) under failures.

First-order model (Young 1974, Daly 2006): with a blocking checkpoint cost C and a job mean time
between failures M, checkpointing every τ = √(2·C·M) loses, per unit of time, C/τ to saving and
(τ/2 + R)/M to failures (half an interval of work redone, plus the restart R: detect, relaunch,
reload). Goodput = 1 − C/τ − (τ/2 + R)/M. M = 1 / (λ · GPUs) for a per-GPU failure rate λ.

Documented example: Llama 3 405B pre-training saw 419 unexpected interruptions in a 54-day snapshot
on 16,384 H100s (Llama 3 paper, §3.3.4), λ ≈ 1.97e-5 per GPU-hour: one failure every ≈3.1 h for the
job. The paper reports > 90% effective training time; `meshlm plan --model llama3-405b --gpus 16384`
predicts it from λ, the checkpoint size and the two bandwidth assumptions below.

After a node is lost the job can wait for a replacement (`spare_min` until one is up; 0 = a hot
spare) or resize (torchrun's elastic agent, docs/fault_tolerance.md): restart at once on the nodes
left, run at (nodes-1)/nodes of the throughput until the node is back (`repair_h`), then restart once
more to grow back, losing the work since the last checkpoint again. Per failure:
  wait:   τ/2 + R + W
  resize: τ/2 + R + (τ/2 + R) + repair · gpus_per_node / gpus
The planner reports both and picks the better (`policy`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...core.facts.checkpoint import checkpoint_bytes

LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)


@dataclass(frozen=True)
class Resilience:
    failures_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR
    node_write_gbps: float = 5.0  # GB/s one node writes (host copy + local NIC / NVMe)
    storage_gbps: float = 2000.0  # GB/s the shared file system sustains (Llama 3's Tectonic: 2 TB/s)
    restart_min: float = 10.0  # detect the failure, restart every worker, reload the checkpoint
    spare_min: float = 0.0  # minutes until a replacement node is up (0: a hot spare is ready)
    repair_h: float = 4.0  # hours until a lost node is back (resize: the job runs smaller meanwhile)


def save_seconds(nbytes: float, gpus: int, gpus_per_node: int, r: Resilience) -> float:
    """Every rank writes its own shard (DCP writes each tensor once): nodes in parallel, capped by the
    file system's aggregate bandwidth."""
    nodes = max(1, math.ceil(gpus / gpus_per_node))
    return nbytes / (min(nodes * r.node_write_gbps, r.storage_gbps) * 1e9)


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * cost_s * mtbf_s)


def goodput(num_params: int, gpus: int, gpus_per_node: int, r: Resilience) -> dict:
    size = checkpoint_bytes(num_params)
    cost = save_seconds(size, gpus, gpus_per_node, r)
    if r.failures_per_gpu_hour <= 0:
        return {"checkpoint_bytes": size, "save_s": cost, "mtbf_h": math.inf, "interval_s": math.inf,
                "goodput": 1.0, "failures_per_gpu_hour": 0.0}
    mtbf_s = 3600.0 / (r.failures_per_gpu_hour * gpus)
    tau = young_daly_s(cost, mtbf_s)
    restart = 60.0 * r.restart_min
    per_failure = {"wait": tau / 2 + restart + 60.0 * r.spare_min,
                   "resize": 2 * (tau / 2 + restart) + 3600.0 * r.repair_h * min(1.0, gpus_per_node / gpus)}
    good = {k: max(0.0, 1.0 - cost / tau - v / mtbf_s) for k, v in per_failure.items()}
    if gpus <= gpus_per_node:  # one node: nothing to resize onto
        good["resize"] = 0.0
    policy = max(good, key=lambda k: (good[k], k == "wait"))
    return {"checkpoint_bytes": size, "save_s": cost, "mtbf_h": mtbf_s / 3600.0, "interval_s": tau,
            "goodput": good[policy], "policy": policy, "goodput_wait": good["wait"],
            "goodput_resize": good["resize"], "failures_per_gpu_hour": r.failures_per_gpu_hour,
            "restart_min": r.restart_min, "spare_min": r.spare_min, "repair_h": r.repair_h}


def describe(g: dict) -> str:
    return (f"checkpoint {g['checkpoint_bytes'] / 1e9:,.1f} GB (fp32 masters + Adam moments), save ≈ "
            f"{g['save_s']:.1f} s; {g['failures_per_gpu_hour']:.3g} failures per GPU-hour -> job MTBF "
            f"{g['mtbf_h']:.2f} h, Young/Daly interval {g['interval_s'] / 60:.1f} min, goodput "
            f"{g['goodput']:.1%} (restart {g.get('restart_min', 0):g} min)"
            + (f"; after a lost node: {g['policy']} (waiting {g.get('spare_min', 0):g} min for a spare "
               f"{g['goodput_wait']:.1%}, resizing until it is back in {g.get('repair_h', 0):g} h "
               f"{g['goodput_resize']:.1%})" if "policy" in g else ""))
