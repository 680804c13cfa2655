"""What a step pays for the number of ranks it spans (docs/planner.md, "What grows with the number of
ranks"): every synchronous step waits for the slowest rank, and a ring or tree collective pays one
link latency per hop, so its fixed cost grows with the group.

Both are priced from measured inputs, never from a published run's throughput:
- STEP_JITTER_S, the per-step spread of one GPU's step time, is pooled from our own GPU rows (see
  `jitter_of_rows`; tests/test_plan_scale.py recomputes it from the files);
- the per-call latency a collective pays at two ranks is the link's (comm.latency: a calibrated CPU's
  link probe, else the profile's constant), and `depth` scales it by the hops of the algorithm.
"""
from __future__ import annotations

import math
import statistics

# Expected range of 8 i.i.d. standard normal samples (d2 of the range chart): the headline rows log
# only the min and max of their 8 measured steps, so σ ≈ (max − min) / D2_8.
D2_8 = 2.847

# σ of one GPU's step time, seconds: sqrt of the mean variance over the rows of
# tests/data/h100-run-llama3-1b/metrics.jsonl (steps 3-10 less the profiled step 8: the sample std)
# and bench/results/2026-11-26-nvidia-h200/headline/headline.json (every row with step_s_min/max:
# range / D2_8). Per row 7.8, 5.9, 8.2, 5.7, 4.0, 5.5 ms at steps of 0.47-1.25 s: the spread does not
# grow with the step's length (the 1.25 s rows have the smallest), so it is taken per step.
STEP_JITTER_S = 6.35e-3


def jitter_of_rows(step_series: list[list[float]], ranges: list[tuple[float, float, int]]) -> float:
    """Pooled σ: sample std of each full series, (max − min) / D2_8 of each 8-step (min, max, n) row."""
    var = [statistics.stdev(x) ** 2 for x in step_series]
    for lo, hi, n in ranges:
        if n != 8:
            raise ValueError(f"a range of {n} steps: D2 is tabled here for 8")
        var.append(((hi - lo) / D2_8) ** 2)
    return math.sqrt(sum(var) / len(var))


def straggler_s(sigma: float, n: int) -> float:
    """Expected wait for the slowest of `n` ranks above the mean, i.i.d. normal jitter σ: the
    leading term of E[max of n], σ·sqrt(2 ln n); zero for one rank."""
    return sigma * math.sqrt(2 * math.log(n)) if n > 1 else 0.0


def hops(kind: str, n: int) -> int:
    """Latency hops one call of `kind` over `n` ranks waits through: ring all-gather / reduce-scatter
    n − 1; all-reduce the fewer of ring (2(n − 1)) and tree (2·⌈log2 n⌉, reduce up and broadcast
    down); an all-to-all's and a p2p send's transfers run at once (1)."""
    if n <= 1:
        return 0
    if kind in ("all_reduce", "all_reduce_amax"):
        return min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
    if kind in ("all_gather", "reduce_scatter"):
        return n - 1
    return 1


def depth(kind: str, n: int) -> float:
    """A call's latency over `n` ranks in units of the same call at two ranks (what the per-call
    latency is: a link probe's two-rank all-reduce)."""
    return hops(kind, n) / hops(kind, 2) if n > 1 else 0.0
