"""ZeRO stages 1-3 and HSDP (parallel.zero, parallel.zero_group) as a small package:

- units.py: which parameters share a flat buffer, and this rank's range of it;
- sync.py: `ZeroSync`, the gradient synchroniser that gathers, frees and reduces units around forward and
  backward, driven by named switches rather than stage numbers;
- zeropp.py / quantize.py: ZeRO++ (qwZ, hpZ, qgZ) hooks into sync.py's gathers and reductions;
- float8.py: zero 3's gathers of units holding float8-multiplied weights, in float8 (training.fp8_comm).

The optimizers over these shards live with the other optimizers (parallel/optim/zero_adamw.py,
zero_muon.py, nvme.py): they read units, the units never read them.
"""
from __future__ import annotations

from dataclasses import dataclass

from .sync import ZeroSync
from .units import Unit
from .zeropp import ZeroPP

__all__ = ["ZeroSwitches", "SWITCHES", "ZeroSync", "Unit", "shard_model"]


@dataclass(frozen=True)
class ZeroSwitches:
    """What is sharded over the shard group. The optimizer state always is (that is ZeRO-1)."""
    shard_grads: bool = False     # gradients live as shards; full buffers only while a unit's backward runs
    shard_params: bool = False    # parameters live as shards; gathered around each use
    reshard_after_forward: bool = True  # with shard_params: free after forward, gather again for backward


SWITCHES = {1: ZeroSwitches(), 2: ZeroSwitches(shard_grads=True),
            3: ZeroSwitches(shard_grads=True, shard_params=True)}


def shard_model(model, named, parallel, plan, split_tied: bool, reduction_of, reduce_dtype, ctx=None,
                float8=None) -> ZeroSync:
    """The synchroniser `parallelize` uses for zero >= 1 (its optimizer: optim/zero_adamw.py `ZeroOptimizer`);
    `ctx`: the mesh, whose ZeRO++ groups (if any) turn ZeRO++ on; `float8`: (ids of the parameters
    zero 3 gathers in float8, their float8 dtype) or None (float8.py)."""
    zpp = ZeroPP.for_job(ctx, parallel) if ctx is not None else None
    return ZeroSync(model, named, SWITCHES[parallel.zero], plan, split_tied, reduction_of, reduce_dtype, zpp, float8)
