"""DiLoCo's cross-island traffic and when it hides behind compute (parallel.islands, docs/diloco.md).

One formula for the bytes an outer sync books, shared by the runtime's tests (tests/test_islands.py
compares it with what `Comm` counted) and by `meshlm plan` / `estimate --islands` (`outer_plan`).
Pure Python: no torch.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

from ...core.facts.islands import TWO_STEP_FROM, WIRE_ELEM, padded, two_step_rows
from ...core.facts.quant import QUANT_BLOCK
from ..spec import PlanError


def payload_bytes(n: int, quantize: str) -> int:
    """Bytes of one island's outer gradient of n fp32 elements on the wire."""
    if quantize in WIRE_ELEM:
        return n * WIRE_ELEM[quantize]
    m = padded(n, quantize)
    return m + 4 * (m // QUANT_BLOCK)


def outer_sync_bytes(n: int, islands: int, quantize: str) -> int:
    """Bytes `Comm` books on one rank for one outer sync of its n elements: fp32 is one all-reduce
    (booked as 2× the tensor, comm.py's unit); bf16, and fp8 / int8 between two islands, are all-gathered
    (every island's values, summed in fp32 in island order on every rank), booked as the gathered output;
    fp8 / int8 from TWO_STEP_FROM islands are reduced in two steps, as ZeRO++'s qgZ: an all-to-all of
    1/N chunks (booked as sent), each island sums its chunk and quantises it again, an all-gather of the
    sums (booked as gathered): 2·payload instead of N·payload."""
    if islands <= 1 or n == 0:
        return 0
    if quantize == "none":
        return 2 * WIRE_ELEM["none"] * n
    if quantize in WIRE_ELEM or islands < TWO_STEP_FROM:
        return islands * payload_bytes(n, quantize)
    return 2 * islands * payload_bytes(two_step_rows(n, islands) // islands * QUANT_BLOCK, quantize)


def bytes_per_step(fragment_sizes: list[int], islands: int, sync_every: int, quantize: str) -> float:
    """Cross-island bytes per inner step on one rank: each fragment (its elements on this rank) is
    synced once every `sync_every` inner steps."""
    return sum(outer_sync_bytes(n, islands, quantize) for n in fragment_sizes) / sync_every


def fragment_sizes(n: int, fragments: int) -> list[int]:
    """A model of n elements cut into `fragments` near-equal parts (the planner's view of the blocks)."""
    return [n // fragments + (k < n % fragments) for k in range(fragments)]


@dataclass(frozen=True)
class OuterPlan:
    """The smallest H (and K) whose outer sync a link hides behind compute, with its traffic."""
    sync_every: int
    fragments: int
    bytes_per_step: float   # cross-island bytes per inner step (one rank, as booked)
    sync_s: float           # one fragment's outer sync on the link (latency + wire bytes / bandwidth)
    hidden: bool            # the sync of one fragment fits in the H/K inner steps before the next one


def sync_seconds(n: int, islands: int, quantize: str, link_gbps: float, latency_ms: float) -> float:
    """One outer sync of n elements per rank over the inter-island link (GB/s per GPU and direction, as
    --ib-gbps): latency plus the ring's wire bytes, (islands-1)/islands of what is booked."""
    return latency_ms / 1e3 + outer_sync_bytes(n, islands, quantize) * (islands - 1) / islands / (link_gbps * 1e9)


def outer_plan(n: int, islands: int, step_s: float, link_gbps: float, latency_ms: float = 0.0,
               quantize: str = "none") -> OuterPlan:
    """The smallest H (powers of two) and, for it, the fewest fragments K for which one fragment's sync
    fits in the H/K inner steps before the next sync starts (what an overlapped sync needs)."""
    for h in (2 ** i for i in range(21)):
        for k in (2 ** j for j in range(h.bit_length())):
            sizes = fragment_sizes(n, k)
            sync = sync_seconds(max(sizes), islands, quantize, link_gbps, latency_ms)
            if sync <= step_s * h / k:
                return OuterPlan(h, k, bytes_per_step(sizes, islands, h, quantize), sync, True)
    sizes = [n]
    return OuterPlan(h, 1, bytes_per_step(sizes, islands, h, quantize),
                     sync_seconds(n, islands, quantize, link_gbps, latency_ms), False)


# -- the command line (`meshlm plan` / `estimate`): a few flags and lines of their own --------------------
def add_flags(p) -> None:
    g = p.add_argument_group("DiLoCo islands (docs/diloco.md)")
    g.add_argument("--islands", type=int, help="islands the GPUs are split into (default: parallel.islands); "
                                                "the layout is one island's, --gpus the whole job's")
    g.add_argument("--link-gbps", type=float, help="inter-island bandwidth per GPU per direction, GB/s")
    g.add_argument("--link-latency-ms", type=float, default=0.0, help="inter-island latency (default 0)")


def islands_flag(args, cfg) -> int:
    """--islands (or parallel.islands) written into the config; the island count, checked."""
    n = args.islands if getattr(args, "islands", None) is not None else cfg.parallel.islands
    if n < 1 or (getattr(args, "gpus", None) and args.gpus % n):
        raise PlanError(f"--islands: must be >= 1 and divide --gpus {getattr(args, 'gpus', None)}, got {n}")
    if getattr(args, "link_gbps", None) is not None and not args.link_gbps > 0:
        raise PlanError(f"--link-gbps: must be > 0, got {args.link_gbps}")
    cfg.parallel.islands = n
    return n


def refuse_mixed(args, cfg) -> None:
    """A mixed cluster's search prices one job of stages or replicas by card type, not islands: the two
    are not combined (docs/diloco.md), so asking for both is one line, not a silent drop of --islands."""
    n = args.islands if getattr(args, "islands", None) is not None else cfg.parallel.islands
    if n > 1:
        raise PlanError("--islands: not with a mixed cluster (--gpu TYPE:COUNT,...): the mixed search prices "
                        "one island")


def report(est: dict, islands: int, outer, link_gbps: float | None, latency_ms: float = 0.0) -> dict:
    """Cross-island traffic of an estimate's layout (one island's) under training.outer `outer`, and with a
    link the step times: synchronous DP across the link, DiLoCo's blocking sync at the configured H and
    K, and the smallest H that an overlapped sync would hide behind."""
    lay = est["layout"]
    n = est["params"] // (lay["tp"] * lay["pp"] * (lay["zero_group"] * lay["cp"] if lay["zero"] else 1))
    sizes = fragment_sizes(n, outer.fragments)
    out = {"islands": islands, "elements_per_gpu": n, "sync_every": outer.sync_every, "fragments": outer.fragments,
           "quantize": outer.quantize, "dp_bytes_per_step": outer_sync_bytes(n, islands, "none"),
           "bytes_per_step": bytes_per_step(sizes, islands, outer.sync_every, outer.quantize)}
    if link_gbps and est.get("step_s"):
        step = est["step_s"]
        per_sync = sync_seconds(max(sizes), islands, outer.quantize, link_gbps, latency_ms)
        best = outer_plan(n, islands, step, link_gbps, latency_ms, outer.quantize)
        out.update(step_s=step, sync_dp_step_s=step + sync_seconds(n, islands, "none", link_gbps, latency_ms),
                   blocking_step_s=step + per_sync * outer.fragments / outer.sync_every,
                   **overlapped(per_sync, step, outer.sync_every, outer.fragments),
                   hiding_sync_every=best.sync_every, hiding_fragments=best.fragments, hidden=best.hidden,
                   hiding_bytes_per_step=best.bytes_per_step)
    return out


def overlapped(per_sync: float, step: float, h: int, k: int) -> dict:
    """training.outer.delay τ (the runtime's overlap, parallel/dims/islands.py): the τ that covers one sync
    with inner steps (at most H − 1), and the step time then. A fragment syncs every H/K steps, so the link
    keeps up only if one sync fits in H/K steps; the step is then the compute alone, else the link's."""
    tau = min(max(1, math.ceil(per_sync / step)), h - 1) if h > 1 else 0
    if tau == 0:
        return {"delay": 0, "delayed_step_s": step + per_sync * k / h}
    late = max(0.0, per_sync - tau * step)  # what the landing still waits for, once per sync
    return {"delay": tau, "delayed_step_s": max(step + late * k / h, per_sync * k / h)}


def describe(r: dict) -> str:
    """`report` as the lines `meshlm plan` / `estimate` print."""
    lines = [(f"islands: {r['islands']}; the outer sync moves {_size(r['bytes_per_step'])} per inner step per GPU "
              f"(H {r['sync_every']}, {r['fragments']} fragment(s), {r['quantize']}) vs synchronous DP's "
              f"{_size(r['dp_bytes_per_step'])}")]
    if "step_s" in r:
        lines.append(f"  step: {r['step_s']:.3f} s with the sync hidden, {r['blocking_step_s']:.3f} s with it blocking "
                     f"(training.outer.delay = 0), {r['sync_dp_step_s']:.3f} s as synchronous DP over the link")
        lines.append(f"  with training.outer.delay = {r['delay']} (each sync overlapped with the next inner steps): "
                     f"{r['delayed_step_s']:.3f} s per step" if r["delay"] else
                     "  training.outer.delay needs sync_every > 1: the sync blocks")
        how = "hides" if r["hidden"] else "does not hide even at"
        lines.append(f"  the smallest H that {how} the sync behind compute: {r['hiding_sync_every']} "
                     f"(fragments {r['hiding_fragments']}, {_size(r['hiding_bytes_per_step'])} per inner step)")
    return "\n".join(lines)


def _size(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"
