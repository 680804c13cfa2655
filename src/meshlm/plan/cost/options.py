"""How a layout is priced beyond its Spec: the compute model, the attention kernel and mask, how the
code runs (compile, the chunked loss) and the memory headroom. Below memory.py and estimate.py, which
both take it, so that the search and `meshlm estimate` price a layout with the same assumptions."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..hardware import GIB, GPU, hashed_once

if TYPE_CHECKING:
    from .ops import Rates


@dataclass(frozen=True)
class Options:
    efficiency: float | None = None  # None: per-operation model (plan/cost/ops.py); a number: the flat model
    block_overhead_s: float = 4e-4  # flat model only: launches etc. per block per micro-batch, fwd + bwd
    attn_kernel: str = "cudnn"     # attention kernel (plan/cost/ops.KERNELS): cudnn is what SDPA picked on H100
    attn_dropout: bool = False     # unfused attention with dropout on the probabilities (other frameworks)
    comm_efficiency: float = 0.8   # achieved fraction of link bandwidth
    flash: bool = True             # fused attention (saves log-sum-exp, not the S×S scores)
    attn_math_bytes: int | None = None  # element size of the unfused attention path (None: activations')
    compiled: bool = False         # training.compile: blocks and loss save less (plan/cost/memory.py)
    mem_fraction: float = 0.95     # allocator fragmentation headroom
    reserve_gib: float = 2.0       # CUDA context, cuBLAS / NCCL workspaces
    simulate: bool = True          # pipeline bubble from the schedule simulator when it is available
    rates: Rates | None = None     # a calibrated machine's per-category rates (plan/calibrate/fit.py)
    # ac = "op" under another framework's policy: the block matmuls (wq wk wv wo w1 w3 w2) whose outputs
    # it does not keep, so the recompute runs them again (meshlm's own "op" keeps every one)
    recompute_gemms: tuple = ()
    # how the attention is masked (ops.StageWork.attn_mask): causal; dense = SDPA with a document mask
    # (data.document_mask under model.attn_impl = "sdpa"); flex = a BlockMask (attn_impl "flex", or
    # "auto" with the document mask); doc_tokens: mean document length flex skips blocks by (0: unknown).
    # attn_impl: model.attn_impl, which decides the mask of all-gather CP layouts (spec.allgather_mask);
    # None: another framework's run, whose attention is the causal kernel `attn_kernel` under any CP
    attn_mask: str = "causal"
    attn_impl: str | None = "auto"
    doc_tokens: int = 0
    loss_chunks: int = 0           # training.loss_chunks: logits of one chunk alive at a time (0: off)
    step_overhead_s: float | None = None  # GPU idle per step outside every kernel (None: STEP_GAP_S)
    step_jitter_s: float | None = None   # σ of one rank's step time (None: scale.STEP_JITTER_S on a GPU profile)

    __hash__ = hashed_once  # a key of the search's caches (search.py's micro-times, ops.stage_compute)

    def usable(self, gpu: GPU | None) -> float | None:
        return None if gpu is None else gpu.hbm_bytes * self.mem_fraction - self.reserve_gib * GIB
