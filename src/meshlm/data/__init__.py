"""Data layer: tokenizers, on-disk token shards, the default corpus, batch sampling.

Plain Python/numpy/torch only (no torch.distributed): ranks are passed in explicitly.
"""

from .corpus import DEFAULT_CORPUS_NAME, default_cache_dir, default_data_dir, stdlib_files
from .prepare import prepare
from .sampler import Batch, GlobalBatchSampler, MixtureSampler, WindowOrder, apportion, eval_batches
from .shards import TokenShards
from .tokenizer import ByteTokenizer, HFTokenizer, framing, load_tokenizer

__all__ = [
    "ByteTokenizer", "HFTokenizer", "load_tokenizer", "framing",
    "prepare", "TokenShards",
    "DEFAULT_CORPUS_NAME", "default_cache_dir", "default_data_dir", "stdlib_files",
    "GlobalBatchSampler", "MixtureSampler", "WindowOrder", "Batch", "apportion", "eval_batches",
]
