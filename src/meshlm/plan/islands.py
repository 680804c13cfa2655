"""DiLoCo's cross-island traffic and when it hides behind compute (parallel.islands, docs/diloco.md).

One formula for the bytes an outer sync books, shared by the runtime's tests (tests/test_islands.py
compares it with what `Comm` counted) and by `meshlm plan` / `estimate --islands` (`outer_plan`).
Pure Python: no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .volume import QUANT_BLOCK

WIRE_ELEM = {"none": 4, "bf16": 2}  # bytes per element of the outer gradient as sent; fp8/int8: 1 + scales


def padded(n: int, quantize: str) -> int:
    """Elements sent for n: the float8 and int8 rows are whole blocks of QUANT_BLOCK, each with its fp32 scale."""
    return n if quantize in WIRE_ELEM else -(-n // QUANT_BLOCK) * QUANT_BLOCK


def payload_bytes(n: int, quantize: str) -> int:
    """Bytes of one island's outer gradient of n fp32 elements on the wire."""
    if quantize in WIRE_ELEM:
        return n * WIRE_ELEM[quantize]
    m = padded(n, quantize)
    return m + 4 * (m // QUANT_BLOCK)


def outer_sync_bytes(n: int, islands: int, quantize: str) -> int:
    """Bytes `Comm` books on one rank for one outer sync of its n elements: fp32 is one all-reduce
    (booked as 2× the tensor, comm.py's unit); a quantised gradient is all-gathered (every island's
    codes and scales, summed in fp32 in island order on every rank), booked as the gathered output."""
    if islands <= 1 or n == 0:
        return 0
    if quantize == "none":
        return 2 * 4 * n
    return islands * payload_bytes(n, quantize)


def bytes_per_step(fragment_sizes: list[int], islands: int, sync_every: int, quantize: str) -> float:
    """Cross-island bytes per inner step on one rank: each fragment (its elements on this rank) is
    synced once every `sync_every` inner steps."""
    return sum(outer_sync_bytes(n, islands, quantize) for n in fragment_sizes) / sync_every


def fragment_sizes(n: int, fragments: int) -> list[int]:
    """A model of n elements cut into `fragments` near-equal parts (the planner's view of the blocks)."""
    return [n // fragments + (k < n % fragments) for k in range(fragments)]


@dataclass(frozen=True)
class OuterPlan:
    """What `meshlm plan/estimate --islands` prints: the traffic, the smallest hiding H, step times."""
    islands: int
    sync_every: int
    fragments: int
    bytes_per_step: float   # cross-island bytes per inner step (one rank, as booked)
    sync_s: float           # one fragment's outer sync on the link (latency + wire bytes / bandwidth)
    step_s: float           # the inner step (compute and in-island communication)
    exposed_step_s: float   # the mean step when the sync is not overlapped (blocking)
    hidden: bool            # the sync of one fragment fits in the H/K inner steps before the next one


def outer_plan(n: int, islands: int, step_s: float, link_gbps: float, latency_ms: float = 0.0,
               quantize: str = "none", fragments: int | None = None) -> OuterPlan:
    """The smallest H (a power of two, with K fragments: K = given, or the smallest of 1, 2, 4, ... up to
    H that hides it) for which one fragment's sync on a link of `link_gbps` (per rank pair, the ring's
    wire bytes) finishes within the H/K inner steps before the next sync starts. n: this rank's elements."""
    best = None
    for h in (2 ** i for i in range(21)):
        for k in ([fragments] if fragments else [2 ** j for j in range(int(math.log2(h)) + 1)]):
            if h % k:
                continue
            sizes = fragment_sizes(n, k)
            wire = outer_sync_bytes(max(sizes), islands, quantize) * (islands - 1) / islands
            sync = latency_ms / 1e3 + wire * 8 / (link_gbps * 1e9)
            hidden = sync <= step_s * h / k
            if hidden or h == 2 ** 20:
                per = bytes_per_step(sizes, islands, h, quantize)
                exposed = step_s + sync * k / h
                best = OuterPlan(islands, h, k, per, sync, step_s, exposed, hidden)
                break
        if best is not None:
            return best
    raise AssertionError("unreachable")
