"""`meshlm prepare`: documents -> one token stream on disk, streamed end to end.

The reader (data/sources.py) yields documents in a fixed order; batches of about BATCH_CHARS
characters are tokenised by `workers` processes and written back *in order*, so the output is the
same bytes for any worker count. At most 2 × workers batches are in flight: memory is bounded by the
batch size, never by the corpus. The output is built in `OUT.tmp-PID` and renamed when complete, so
an interrupted run leaves no half-written set (docs/data.md).
"""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import shutil
import sys
from collections import deque
from typing import Callable, Iterable, Iterator

import numpy as np

from .shards import DOCS_NAME, INDEX_NAME, INDEX_VERSION, read_index
from .sources import collect_sources, read_documents
from .tokenizer import ByteTokenizer, DocumentFraming, framing, load_tokenizer

__all__ = ["prepare"]

BATCH_CHARS = 1 << 20
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16: few files (and file handles) even at 100 B tokens


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


Task = tuple[list[str], list[bool], list[bool]]  # texts, starts a document, ends a document


def _tasks(sources, field: str) -> Iterator[Task]:
    """Batches of document texts (or pieces of a large text file) with their start/end flags."""
    texts, starts, ends, size, open_doc = [], [], [], 0, False
    for src in sources:
        for text, end in read_documents(src, field):
            if not text and end and not open_doc:
                continue  # an empty document: nothing to learn from, not even its EOS
            texts.append(text)
            starts.append(not open_doc)
            ends.append(end)
            open_doc = not end
            size += len(text)
            if size >= BATCH_CHARS:
                yield texts, starts, ends
                texts, starts, ends, size = [], [], [], 0
    if texts:
        yield texts, starts, ends


class _Encoder:
    """Task -> (tokens of the batch with the documents' framing, offsets where documents start)."""

    def __init__(self, spec: str, frame: DocumentFraming, dtype: str):
        self.tok = load_tokenizer(spec)
        self.prefix = np.asarray(frame.prefix, dtype=np.int64)
        self.suffix = np.asarray(frame.suffix, dtype=np.int64)
        self.dtype = np.dtype(dtype)

    def __call__(self, task: Task) -> tuple[np.ndarray, np.ndarray]:
        texts, starts, ends = task
        parts, doc_starts, n = [], [], 0
        for ids, s, e in zip(self.tok.encode_batch(texts), starts, ends):
            if s:
                doc_starts.append(n)
                parts.append(self.prefix)
                n += len(self.prefix)
            parts.append(ids)
            n += len(ids)
            if e:
                parts.append(self.suffix)
                n += len(self.suffix)
        return np.concatenate(parts).astype(self.dtype), np.asarray(doc_starts, dtype=np.int64)


_WORKER: _Encoder | None = None  # one per worker process (set by its initializer)


def _worker_init(spec: str, frame: DocumentFraming, dtype: str) -> None:
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core; no nested thread pools
    _WORKER = _Encoder(spec, frame, dtype)


def _worker_encode(task: Task):
    return _WORKER(task)


def _ordered_map(fn: Callable, tasks: Iterable, workers: int, init, initargs) -> Iterator:
    """fn over tasks in `workers` processes, results in task order, at most 2·workers in flight."""
    ctx = mp.get_context("spawn")  # no fork of a parent that may hold threads (torch, tokenizers)
    with ctx.Pool(workers, initializer=init, initargs=initargs) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.apply_async(fn, (task,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _StreamWriter:
    """Appends tokens to `tokens_NNNNN.bin` files of at most `shard_tokens`, document starts to
    docs.bin (int64 offsets into the whole stream)."""

    def __init__(self, out: str, shard_tokens: int):
        self.out, self.shard_tokens = out, shard_tokens
        self.files: list[dict] = []
        self.total = self.n_docs = 0
        self._file = None
        self._docs = open(os.path.join(out, DOCS_NAME), "wb")

    def write(self, tokens: np.ndarray, doc_starts: np.ndarray) -> None:
        self._docs.write((doc_starts + self.total).astype("<i8").tobytes())
        self.n_docs += len(doc_starts)
        pos = 0
        while pos < len(tokens):
            if self._file is None or self.files[-1]["tokens"] == self.shard_tokens:
                self._roll()
            take = min(len(tokens) - pos, self.shard_tokens - self.files[-1]["tokens"])
            self._file.write(tokens[pos:pos + take].tobytes())
            self.files[-1]["tokens"] += take
            self.total += take
            pos += take

    def _roll(self) -> None:
        if self._file is not None:
            self._file.close()
        name = f"tokens_{len(self.files):05d}.bin"
        self._file = open(os.path.join(self.out, name), "wb")
        self.files.append({"file": name, "tokens": 0})

    def close(self) -> None:
        for f in (self._file, self._docs):
            if f is not None:
                f.close()


def _progress(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(unit=" tok", unit_scale=True, desc="prepare", file=sys.stderr, mininterval=1.0)


def prepare(inputs: list[str], tokenizer_spec: str, out_dir: str, val_fraction: float = 0.01,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, min_val_tokens: int = 1025, overwrite: bool = True,
            text_field: str = "text", workers: int | None = None, eos: str | None = None,
            progress: bool = False) -> dict:
    """Tokenise `inputs` (files/directories of text, JSON Lines, Parquet, save_to_disk) into `out_dir`;
    return the index. The val split is the *last* tokens of the stream (at least `min_val_tokens`, never
    more than half). With overwrite=False an existing prepared `out_dir` wins (racing ranks on a cache)."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data: val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise ValueError(f"data: shard_tokens must be >= 1, got {shard_tokens}")
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"--workers: must be >= 1, got {workers}")
    out_dir = os.path.abspath(os.path.expanduser(str(out_dir)))
    if not overwrite and os.path.exists(os.path.join(out_dir, INDEX_NAME)):
        return read_index(out_dir)
    sources = collect_sources(list(inputs))
    if not sources:
        raise ValueError(f"data: no documents found in {list(inputs)} (text, JSON Lines, Parquet or a "
                         f"datasets save_to_disk directory)")
    tok = load_tokenizer(tokenizer_spec)
    frame = framing(tok, eos)
    dtype = _dtype_for(tok.vocab_size)
    spec = "bytes" if isinstance(tok, ByteTokenizer) else tok.name

    tmp = f"{out_dir.rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    bar = None
    try:  # from the directory's creation on: a SIGTERM right after it (cli: KeyboardInterrupt) removes it too
        os.makedirs(tmp)
        bar = _progress(progress)
        writer = _StreamWriter(tmp, shard_tokens)
        tasks = _tasks(sources, text_field)
        initargs = (spec, frame, dtype.str)
        if workers == 1 or isinstance(tok, ByteTokenizer):  # bytes: encoding costs less than a hand-off
            results = map(_Encoder(*initargs), tasks)
        else:
            results = _ordered_map(_worker_encode, tasks, workers, _worker_init, initargs)
        for tokens, starts in results:
            writer.write(tokens, starts)
            if bar is not None:
                bar.update(len(tokens))
        writer.close()
        if writer.total == 0:
            raise ValueError(f"data: no text found in {list(inputs)}")
        index = _index(spec, tok.vocab_size, dtype, frame, writer, val_fraction, min_val_tokens)
        with open(os.path.join(tmp, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=1)
        _publish(tmp, out_dir, overwrite)
    finally:
        if bar is not None:
            bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return read_index(out_dir) if not overwrite else index


def _index(spec: str, vocab_size: int, dtype: np.dtype, frame: DocumentFraming, writer: _StreamWriter,
           val_fraction: float, min_val_tokens: int) -> dict:
    total = writer.total
    n_val = min(max(math.ceil(total * val_fraction), min_val_tokens), total // 2) if val_fraction > 0 else 0
    return {
        "version": INDEX_VERSION, "tokenizer": spec, "vocab_size": int(vocab_size), "dtype": dtype.name,
        "documents": writer.n_docs, "tokens": total, "framing": frame.to_dict(),
        "files": writer.files, "doc_starts": DOCS_NAME,
        "splits": {"train": {"start": 0, "tokens": total - n_val},
                   "val": {"start": total - n_val, "tokens": n_val}},
    }


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
