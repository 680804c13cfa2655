"""Documents out of the files people actually have: text files, JSON Lines (plain, .gz, .zst), Parquet
and `datasets`' save_to_disk directories. One text file, one JSON line or one row is one document.

Everything streams: a reader holds one batch of rows (or one line) at a time, never a whole file, so
preparing a 100 GB corpus needs no more memory than a 100 MB one. A problem (a format we do not read,
a malformed line, a missing or non-text field) is a `ValueError` of one line naming the file and the
line or row.
"""
from __future__ import annotations

import gzip
import io
import json
import os
from dataclasses import dataclass
from typing import Iterator

from ..core.files import json_field

__all__ = ["Source", "collect_sources", "read_documents", "TEXT_SUFFIXES", "JSONL_SUFFIXES"]

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".text")
# `.json` is read as JSON Lines, as `datasets.load_dataset("json")` does: published dumps use both names.
JSONL_SUFFIXES = tuple(f"{base}{comp}" for base in (".jsonl", ".json", ".ndjson") for comp in ("", ".gz", ".zst"))
PARQUET_SUFFIXES = (".parquet",)
# A text file larger than this is tokenised in pieces cut at line ends (still one document).
TEXT_PIECE_BYTES = 8 * 1024 * 1024
ROWS_PER_BATCH = 1024


@dataclass(frozen=True)
class Source:
    """One input: `kind` is text, jsonl, parquet or arrow (a save_to_disk shard)."""
    path: str
    kind: str


def _kind_of(path: str) -> str | None:
    name = path.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


def _saved_dataset(path: str) -> list[Source] | None:
    """The arrow shards of a `Dataset.save_to_disk` directory (a DatasetDict: its `train` split)."""
    state = os.path.join(path, "state.json")
    if os.path.isfile(state):
        entries = json_field(state, "_data_files", "a datasets save_to_disk state file")
        try:
            files = [d["filename"] for d in entries]
        except (KeyError, TypeError) as e:
            raise ValueError(f"{state}: not a datasets save_to_disk state file ({e})") from None
        return [Source(os.path.join(path, f), "arrow") for f in files]
    splits = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(splits):
        names = json_field(splits, "splits", "a datasets DatasetDict file")
        if "train" not in names:
            raise ValueError(f"{path}: a DatasetDict without a 'train' split (has {', '.join(names)}); "
                             f"pass the split's directory")
        return _saved_dataset(os.path.join(path, "train"))
    return None


def collect_sources(inputs: list[str]) -> list[Source]:
    """Files and directories -> sources in a fixed order (directories walked recursively, sorted), so
    the token stream is the same on every machine. A file named explicitly must be a known format."""
    out: list[Source] = []
    for item in inputs:
        path = os.path.abspath(os.path.expanduser(str(item)))
        if not os.path.exists(path):
            raise FileNotFoundError(f"data: input path does not exist: {item}")
        if os.path.isfile(path):
            kind = _kind_of(path)
            if kind is None:
                raise ValueError(f"{path}: unsupported input format (text {', '.join(TEXT_SUFFIXES)}; JSON Lines "
                                 f".jsonl/.json[.gz|.zst]; .parquet; or a datasets save_to_disk directory)")
            out.append(Source(path, kind))
            continue
        saved = _saved_dataset(path)
        if saved is not None:
            out.extend(saved)
            continue
        found = []
        for root, dirs, names in os.walk(path):
            dirs.sort()
            inner = _saved_dataset(root) if root != path else None
            if inner is not None:
                found.extend((s.path, s.kind) for s in inner)
                dirs.clear()
                continue
            for name in names:
                full = os.path.join(root, name)
                kind = _kind_of(full)
                if kind is not None:
                    found.append((full, kind))
        out.extend(Source(p, k) for p, k in sorted(found))
    return out


def _open_text(path: str):
    """A text stream over a plain, gzip or zstandard file."""
    low = path.lower()
    if low.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    if low.endswith(".zst"):
        import zstandard
        raw = open(path, "rb")
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True),
                                encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _text_value(value, field: str, where: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        raise ValueError(f"{where}: field '{field}' is missing (--text-field names the text column)")
    raise ValueError(f"{where}: field '{field}' is {type(value).__name__}, not text")


def _jsonl(path: str, field: str) -> Iterator[str]:
    try:
        with _open_text(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{n}: a JSON line must be an object with a '{field}' field")
                yield _text_value(row.get(field), field, f"{path}:{n}")
    except (OSError, EOFError) as e:  # gzip/zstd: a truncated or corrupt file
        raise ValueError(f"{path}: cannot read ({e})") from None
    except Exception as e:  # noqa: BLE001 - zstandard raises its own ZstdError
        if isinstance(e, ValueError):
            raise
        raise ValueError(f"{path}: cannot read ({type(e).__name__}: {e})") from None


def _column_batches(path: str, batches, field: str, names: list[str]) -> Iterator[str]:
    if field not in names:
        raise ValueError(f"{path}: no column '{field}' (columns: {', '.join(names)}; --text-field picks one)")
    row = 0
    for batch in batches:
        for value in batch.column(field).to_pylist():
            row += 1
            yield _text_value(value, field, f"{path}: row {row}")


def _parquet(path: str, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    names = pf.schema_arrow.names
    yield from _column_batches(path, pf.iter_batches(batch_size=ROWS_PER_BATCH,
                                                     columns=[field] if field in names else None),
                               field, names)


def _arrow(path: str, field: str) -> Iterator[str]:
    """A save_to_disk shard: Arrow IPC stream format, memory-mapped (batches are read lazily)."""
    import pyarrow as pa
    try:
        reader = pa.ipc.open_stream(pa.memory_map(path, "r"))
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Arrow file ({e})") from None
    yield from _column_batches(path, reader, field, reader.schema.names)


def _text(path: str) -> Iterator[str]:
    """The whole file as one document, in pieces of about TEXT_PIECE_BYTES cut at line ends; pieces of
    one file carry no separator between them (see prepare's `pieces`)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        while True:
            piece = f.read(TEXT_PIECE_BYTES)
            if not piece:
                return
            rest = f.readline()
            yield piece + rest


def read_documents(src: Source, field: str = "text") -> Iterator[tuple[str, bool]]:
    """(text, ends_document) pairs of one source; only a large text file yields pieces with False."""
    if src.kind == "text":
        prev = None
        for piece in _text(src.path):
            if prev is not None:
                yield prev, False
            prev = piece
        if prev is not None:
            yield prev, True
        return
    reader = {"jsonl": _jsonl, "parquet": _parquet, "arrow": _arrow}[src.kind]
    for doc in reader(src.path, field):
        yield doc, True
