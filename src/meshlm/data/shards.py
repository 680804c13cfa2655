"""Tokenised corpora on disk: raw binary shards plus a JSON index.

Raw little-endian token arrays are memory-mappable, so every rank can open the
same files without loading them and random windows cost one page fault.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from bisect import bisect_right

import numpy as np

from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["prepare", "TokenShards", "TEXT_SUFFIXES", "INDEX_NAME"]

TEXT_SUFFIXES = (".py", ".txt", ".md", ".json", ".rst")
INDEX_NAME = "index.json"
INDEX_VERSION = 1
# Documents from the byte tokenizer are separated by a blank line.
BYTE_DOC_SEPARATOR = np.array([10, 10], dtype=np.int64)


def _collect_files(inputs: list[str]) -> list[str]:
    """Expand directories (recursively, sorted) so preparation is deterministic."""
    files: list[str] = []
    for item in inputs:
        path = os.path.abspath(os.path.expanduser(str(item)))
        if not os.path.exists(path):
            raise FileNotFoundError(f"data: input path does not exist: {item}")
        if os.path.isfile(path):
            files.append(path)
            continue
        found = []
        for root, dirs, names in os.walk(path):
            dirs.sort()
            for name in names:
                if name.endswith(TEXT_SUFFIXES):
                    found.append(os.path.join(root, name))
        files.extend(sorted(found))
    return files


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def _write_split(out_dir: str, split: str, tokens: np.ndarray, shard_tokens: int) -> list[dict]:
    entries = []
    for k, start in enumerate(range(0, len(tokens), shard_tokens)):
        chunk = tokens[start:start + shard_tokens]
        name = f"{split}_{k:05d}.bin"
        chunk.tofile(os.path.join(out_dir, name))
        entries.append({"file": name, "tokens": int(len(chunk))})
    return entries


def _read_index(out_dir: str) -> dict:
    with open(os.path.join(out_dir, INDEX_NAME)) as f:
        return json.load(f)


def prepare(inputs: list[str], tokenizer_spec: str, out_dir: str,
            val_fraction: float = 0.01, shard_tokens: int = 2**24,
            min_val_tokens: int = 1025, overwrite: bool = True) -> dict:
    """Tokenise text files into train/val shards under `out_dir`; return the index.

    The val split is the *last* tokens of the stream (at least `min_val_tokens`,
    but never more than half). Output is built in a temp dir and renamed, so a
    crash never leaves a half-written index. With overwrite=False an existing
    prepared `out_dir` wins (used when several processes race on a cache).
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data: val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise ValueError(f"data: shard_tokens must be >= 1, got {shard_tokens}")
    out_dir = os.path.abspath(os.path.expanduser(str(out_dir)))
    if not overwrite and os.path.exists(os.path.join(out_dir, INDEX_NAME)):
        return _read_index(out_dir)

    files = _collect_files(list(inputs))
    tok = load_tokenizer(tokenizer_spec)
    dtype = _dtype_for(tok.vocab_size)
    pieces: list[np.ndarray] = []
    n_docs = 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if not text:
            continue
        ids = tok.encode_array(text)
        if len(ids) == 0:
            continue
        if isinstance(tok, ByteTokenizer):
            ids = np.concatenate([ids, BYTE_DOC_SEPARATOR])
        pieces.append(ids.astype(dtype))
        n_docs += 1
    if not pieces:
        raise ValueError(f"data: no text found in {list(inputs)} "
                         f"(looked for {', '.join(TEXT_SUFFIXES)} files)")
    stream = np.concatenate(pieces)
    del pieces
    total = len(stream)
    n_val = 0
    if val_fraction > 0:
        n_val = min(max(math.ceil(total * val_fraction), min_val_tokens), total // 2)
    train, val = stream[:total - n_val], stream[total - n_val:]

    spec = "bytes" if isinstance(tok, ByteTokenizer) else tok.name
    tmp = f"{out_dir.rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        index = {
            "version": INDEX_VERSION,
            "tokenizer": spec,
            "vocab_size": int(tok.vocab_size),
            "dtype": dtype.name,
            "documents": n_docs,
            "splits": {
                "train": _write_split(tmp, "train", train, shard_tokens),
                "val": _write_split(tmp, "val", val, shard_tokens),
            },
        }
        with open(os.path.join(tmp, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=1)
        _publish(tmp, out_dir, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _read_index(out_dir) if not overwrite else index


def _publish(tmp: str, out_dir: str, overwrite: bool) -> None:
    """Move the finished temp dir into place (rename is atomic on one filesystem)."""
    parent = os.path.dirname(out_dir)
    if parent:
        os.makedirs(parent, exist_ok=True)
    old = None
    if os.path.exists(out_dir):
        if not overwrite and os.path.exists(os.path.join(out_dir, INDEX_NAME)):
            return  # someone else finished first: keep theirs
        old = f"{out_dir.rstrip(os.sep)}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # Lost a race with another process that published meanwhile.
        if not os.path.exists(os.path.join(out_dir, INDEX_NAME)):
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class TokenShards:
    """Read-only view of one split as a single contiguous token stream."""

    def __init__(self, dir: str, split: str = "train"):
        self.dir = os.path.abspath(os.path.expanduser(str(dir)))
        index_path = os.path.join(self.dir, INDEX_NAME)
        if not os.path.isfile(index_path):
            raise FileNotFoundError(
                f"data.path: no prepared data at {dir} (run `meshlm prepare`)")
        index = _read_index(self.dir)
        if index.get("version") != INDEX_VERSION:
            raise ValueError(f"data.path: unsupported index version {index.get('version')} in {dir}")
        if split not in index["splits"]:
            raise ValueError(f"data.path: split '{split}' not in {sorted(index['splits'])} at {dir}")
        self.split = split
        self.index = index
        self.tokenizer: str = index["tokenizer"]
        self.vocab_size: int = int(index["vocab_size"])
        self.dtype = np.dtype(index["dtype"])
        self._arrays: list[np.ndarray] = []
        self._starts: list[int] = []
        total = 0
        for entry in index["splits"][split]:
            n = int(entry["tokens"])
            if n == 0:
                continue
            path = os.path.join(self.dir, entry["file"])
            size = os.path.getsize(path) if os.path.exists(path) else -1
            if size != n * self.dtype.itemsize:
                raise ValueError(f"data.path: shard {path} is missing or has the wrong size")
            self._arrays.append(np.memmap(path, dtype=self.dtype, mode="r", shape=(n,)))
            self._starts.append(total)
            total += n
        self._len = total

    def __len__(self) -> int:
        return self._len

    def get(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the split as int64 (may span shards)."""
        start, length = int(start), int(length)
        if start < 0 or length < 0 or start + length > self._len:
            raise IndexError(f"data: window [{start}, {start + length}) outside "
                             f"{self.split} split of {self._len} tokens")
        out = np.empty(length, dtype=np.int64)
        k = bisect_right(self._starts, start) - 1
        done = 0
        while done < length:
            arr, base = self._arrays[k], self._starts[k]
            lo = start + done - base
            n = min(length - done, len(arr) - lo)
            out[done:done + n] = arr[lo:lo + n]
            done += n
            k += 1
        return out

    def __repr__(self) -> str:
        return (f"TokenShards({self.dir!r}, split={self.split!r}, tokens={self._len}, "
                f"vocab_size={self.vocab_size})")
