"""Data layer: tokenizers, on-disk token shards, the default corpus, batch sampling.

Plain Python/numpy/torch only (no torch.distributed): ranks are passed in explicitly.
"""

from .corpus import DEFAULT_CORPUS_NAME, default_cache_dir, default_data_dir, stdlib_files
from .sampler import GlobalBatchSampler, eval_batches
from .shards import TokenShards, prepare
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer", "HFTokenizer", "load_tokenizer",
    "prepare", "TokenShards",
    "DEFAULT_CORPUS_NAME", "default_cache_dir", "default_data_dir", "stdlib_files",
    "GlobalBatchSampler", "eval_batches",
]
