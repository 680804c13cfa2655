"""What the trainer reads: one prepared set (`data.path`) or a weighted mixture (`data.mix`), with its
sampler, held-out split and document ids when masking. One object so the trainer has one code path."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .sampler import Batch, GlobalBatchSampler, MixtureSampler, eval_batches
from .shards import TokenShards

__all__ = ["TrainingData", "open_data"]


@dataclass
class TrainingData:
    train: list[TokenShards]
    val: list[TokenShards]
    weights: list[float] | None  # None: one set
    sampler: GlobalBatchSampler | MixtureSampler
    docs: bool  # document ids with every batch (data.document_mask)

    @property
    def vocab_size(self) -> int:
        return max(s.vocab_size for s in self.train)

    def next_batch(self, dp_rank: int, dp_size: int, rows: tuple[int, ...] = ()) -> Batch:
        """`rows`: sequences of each dp rank when they differ (parallel.dp_weights)."""
        shards = self.train if self.weights else self.train[0]
        return self.sampler.next_batch(shards, dp_rank, dp_size, self.docs, rows)

    def eval_batches(self, batch: int, n_batches: int) -> list[Batch]:
        return eval_batches(self.val if self.weights else self.val[0], self.sampler.seq_len, batch, n_batches,
                            self.weights, self.docs)


def open_data(path: str, mix: list, seq_len: int, global_batch: int, seed: int,
              document_mask: bool = False, rampup: list[int] = ()) -> TrainingData:
    """Open `path` (or every set of `mix`, all tokenised alike) and build the sampler (`rampup`:
    training.batch_rampup)."""
    dirs = [p for p, _ in mix] if mix else [path]
    train = [TokenShards(d, "train") for d in dirs]
    val = [TokenShards(d, "val") for d in dirs]
    for d, s in zip(dirs[1:], train[1:]):
        if (s.tokenizer, s.vocab_size) != (train[0].tokenizer, train[0].vocab_size):
            raise ValueError(f"data.mix: {d} was tokenised with {s.tokenizer} (vocab {s.vocab_size}), "
                             f"{dirs[0]} with {train[0].tokenizer} (vocab {train[0].vocab_size})")
    if document_mask:
        for s in train:
            s.require_documents()
    if not mix:
        sampler = GlobalBatchSampler.for_shards(train[0], seq_len, global_batch, seed, rampup)
        return TrainingData(train, val, None, sampler, document_mask)
    names = [os.path.normpath(d) for d in dirs]
    sampler = MixtureSampler([len(s) for s in train], names, [w for _, w in mix], seq_len, global_batch, seed,
                             rampup)
    return TrainingData(train, val, [w for _, w in mix], sampler, document_mask)
