"""Data layer: tokenizers, on-disk token shards, the default corpus, batch sampling.

Plain Python/numpy/torch only (no torch.distributed): ranks are passed in explicitly. Names are
imported on first use, so `meshlm prepare`'s tokenising workers start without importing torch.
"""
from __future__ import annotations

import importlib

_WHERE = {
    "ByteTokenizer": "tokenizer", "HFTokenizer": "tokenizer", "load_tokenizer": "tokenizer", "framing": "tokenizer",
    "prepare": "build", "TokenShards": "shards",
    "DEFAULT_CORPUS_NAME": "corpus", "default_cache_dir": "corpus", "default_data_dir": "corpus",
    "stdlib_files": "corpus",
    "GlobalBatchSampler": "sampler", "MixtureSampler": "sampler", "WindowOrder": "sampler", "Batch": "sampler",
    "apportion": "sampler", "eval_batches": "sampler",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
