"""All-gather context parallelism (parallel.cp_impl = "allgather"), the Llama 3 paper's CP (§3.3.2).

Each CP rank all-gathers k and v (at their kv-head count, before any GQA expansion) over the cp group
and attends its own queries to the whole sequence's keys. Backward reduce-scatters dk, dv to their
owners (`functional.gather_seq`'s conjugate). The gather is on the critical path, exposed: the price
of an attention that is a plain masked SDPA, so any mask works (data.document_mask), and with GQA the
gathered k, v are small next to q.

The split is the ring's zig-zag (rank i holds chunks i and 2c-1-i): causal work is balanced and
`CPSplit.positions` gives RoPE. Gathered pieces arrive in rank order and are put back in sequence
order, so the mask is causal by true positions: rows are this rank's tokens, columns the sequence.
With document masking the model builds that mask itself (`model.llama.document_mask` with
`positions`), given the whole sequence's document ids, which a forward pre-hook all-gathers once
per forward (the model's `docs` argument holds only this rank's tokens).
"""
from __future__ import annotations

import torch
from torch import nn

from ...distributed.comm import Comm
from ...distributed.functional import all_gather_dim, gather_seq
from ...model.flex import flex_block_mask
from ...model.ops import eager_under_compile


def sequence_order(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The zig-zag chunks of every rank in rank order (rank r's two chunks at 2r, 2r+1) concatenated
    in sequence order along `dim`: chunk j < c is rank j's first, chunk j >= c rank 2c-1-j's second."""
    c = len(pieces) // 2
    order = [2 * j if j < c else 2 * (2 * c - 1 - j) + 1 for j in range(2 * c)]
    return torch.cat([pieces[i] for i in order], dim)


class CausalRows:
    """The causal mask of this rank's queries [S/c] against the sequence's keys [S], by true positions,
    one mask shared by every layer (so the blocks save one mask, not one each): a dense boolean one
    for SDPA, or with `flex` (model.attn_kernel = "flex") a BlockMask that skips the key blocks above
    each query block's diagonal. `split`: the context_parallel.CPSplit (zig-zag) of this rank."""

    def __init__(self, split, flex: bool = False):
        self.split, self.flex, self.mask, self.key = split, flex, None, None

    def __call__(self, local: int, device: torch.device):
        if self.key != (local, device):
            rows = self.split.positions(local, device)
            keys = local * self.split.size
            self.mask = (flex_block_mask(None, local, device, rows, keys) if self.flex
                         else rows[:, None] >= torch.arange(keys, device=device)[None, :])
            self.key = (local, device)
        return self.mask


class AllGatherAttentionCore(nn.Module):
    """q, k, v: [B, H, S/c, D] this rank's zig-zag chunks; k and v are gathered to [B, Hkv, S, D] and the
    model's own core (`inner`: SDPA, or flex under a BlockMask) attends under `mask` (rows: these
    queries, columns: the sequence; the model's document mask, ModelArgs.mask_rows = "local") or,
    without documents, the causal rows."""

    def __init__(self, comm: Comm, inner: nn.Module, causal: CausalRows):
        super().__init__()
        self.comm, self.inner, self.causal = comm, inner, causal

    @eager_under_compile  # collectives inside: compiled blocks call it eagerly
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        kv = gather_seq(torch.stack((k, v)).unsqueeze(0), self.comm, 0)  # [c, 2, B, Hkv, S/c, D]
        kv = sequence_order([p for r in kv.unbind(0) for p in r.chunk(2, -2)], -2)
        if mask is None:
            mask = self.causal(q.shape[2], q.device)
        return self.inner(q, kv[0], kv[1], mask)


def gather_docs_hook(comm: Comm, zigzag: bool = True):
    """A forward pre-hook on the model: replace `docs` (this rank's tokens) with the whole sequence's
    document ids, in sequence order (`zigzag`: each rank holds two chunks, all-gather's split; else one
    contiguous chunk, Ulysses'), so the model's mask covers every key."""
    def hook(model, args, kwargs):
        docs = kwargs.get("docs")
        if docs is not None:
            full = all_gather_dim(docs.contiguous(), comm, 1)
            if zigzag:
                full = sequence_order(list(full.chunk(2 * comm.size, 1)), 1)
            kwargs = dict(kwargs, docs=full)
        return args, kwargs
    return hook
