"""Tokenised corpora on disk: raw token files, document starts and a JSON index (docs/data.md).

Raw little-endian token arrays: every rank opens the same files without loading them and a random window
costs one positioned read; nothing here grows with the corpus (files are opened on first use, document
starts are searched in a memory map).

Index version 2 (written by data/build.py): one stream of `files`, `doc_starts` (int64 offsets of
every document's first token) and `splits` as token ranges of that stream. Version 1 (per-split file
lists, no document starts) is still read.
"""
from __future__ import annotations

import json
import os
from bisect import bisect_right

import numpy as np

__all__ = ["TokenShards", "INDEX_NAME", "INDEX_VERSION", "DOCS_NAME", "read_index"]

INDEX_NAME = "index.json"
INDEX_VERSION = 2
DOCS_NAME = "docs.bin"


def read_index(out_dir: str) -> dict:
    with open(os.path.join(out_dir, INDEX_NAME)) as f:
        return json.load(f)


class TokenShards:
    """Read-only view of one split as a single contiguous token stream."""

    def __init__(self, dir: str, split: str = "train"):
        self.dir = os.path.abspath(os.path.expanduser(str(dir)))
        if not os.path.isfile(os.path.join(self.dir, INDEX_NAME)):
            raise FileNotFoundError(f"data.path: no prepared data at {dir} (run `meshlm prepare`)")
        index = read_index(self.dir)
        version = index.get("version")
        if version not in (1, INDEX_VERSION):
            raise ValueError(f"data.path: unsupported index version {version} in {dir}")
        if split not in index["splits"]:
            raise ValueError(f"data.path: split '{split}' not in {sorted(index['splits'])} at {dir}")
        self.split, self.index = split, index
        self.tokenizer: str = index["tokenizer"]
        self.vocab_size: int = int(index["vocab_size"])
        self.dtype = np.dtype(index["dtype"])
        if version == 1:  # per-split files, no document starts
            files, self._lo, self._len = index["splits"][split], 0, None
            self._docs_path = None
        else:
            files, rng = index["files"], index["splits"][split]
            self._lo, self._len = int(rng["start"]), int(rng["tokens"])
            self._docs_path = os.path.join(self.dir, index["doc_starts"])
        self._files = [(os.path.join(self.dir, e["file"]), int(e["tokens"])) for e in files if int(e["tokens"])]
        self._starts = list(np.cumsum([0] + [n for _, n in self._files])[:-1].tolist())
        stream = sum(n for _, n in self._files)
        if self._len is None:
            self._len = stream
        if self._lo + self._len > stream:
            raise ValueError(f"data.path: index of {dir} names more tokens than its files hold")
        for path, n in self._files:
            size = os.path.getsize(path) if os.path.exists(path) else -1
            if size != n * self.dtype.itemsize:
                raise ValueError(f"data.path: shard {path} is missing or has the wrong size")
        self._fds: dict[int, int] = {}
        self._docs: np.ndarray | None = None

    def __len__(self) -> int:
        return self._len

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)

    def _read(self, k: int, lo: int, n: int) -> np.ndarray:
        """Tokens [lo, lo+n) of file k: one positioned read (no mapping, so RSS does not grow with the
        windows a long run has touched, and a cold window costs one I/O)."""
        if k not in self._fds:
            self._fds[k] = os.open(self._files[k][0], os.O_RDONLY)
        size = self.dtype.itemsize
        return np.frombuffer(os.pread(self._fds[k], n * size, lo * size), dtype=self.dtype)

    def get(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the split as int64 (may span files)."""
        start, length = int(start), int(length)
        if start < 0 or length < 0 or start + length > self._len:
            raise IndexError(f"data: window [{start}, {start + length}) outside "
                             f"{self.split} split of {self._len} tokens")
        out = np.empty(length, dtype=np.int64)
        pos = self._lo + start
        k = bisect_right(self._starts, pos) - 1
        done = 0
        while done < length:
            lo = pos + done - self._starts[k]
            n = min(length - done, self._files[k][1] - lo)
            out[done:done + n] = self._read(k, lo, n)
            done += n
            k += 1
        return out

    def require_documents(self) -> None:
        """Document masking needs the starts that only index version 2 records."""
        if self._docs_path is None:
            raise ValueError(f"data.document_mask: {self.dir} was prepared without document starts "
                             f"(index version 1); run `meshlm prepare` again")

    def doc_ids(self, start: int, length: int) -> np.ndarray:
        """Per token of [start, start+length): which document it belongs to, counted from 0 at the
        window's first token (what a document mask compares). Two searches in the on-disk starts."""
        self.require_documents()
        if self._docs is None:
            n = os.path.getsize(self._docs_path) // 8
            self._docs = np.memmap(self._docs_path, dtype="<i8", mode="r", shape=(n,)) if n else \
                np.zeros(0, dtype=np.int64)
        lo = self._lo + int(start)
        a, b = np.searchsorted(self._docs, [lo + 1, lo + int(length)], side="left")
        out = np.zeros(int(length), dtype=np.int64)
        out[np.asarray(self._docs[a:b]) - lo] = 1  # a document starts here: the id steps up by one
        return np.cumsum(out)

    def __repr__(self) -> str:
        return (f"TokenShards({self.dir!r}, split={self.split!r}, tokens={self._len}, "
                f"vocab_size={self.vocab_size})")
