"""The embedded default corpus: this interpreter's own standard-library sources.

Every Python install carries a few MB of real, varied text, so meshlm can train
out of the box with no download and no data set to ship.
"""

from __future__ import annotations

import os
import sysconfig

from .build import prepare
from .shards import INDEX_NAME

__all__ = ["DEFAULT_CORPUS_NAME", "stdlib_files", "default_cache_dir", "default_data_dir"]

DEFAULT_CORPUS_NAME = "stdlib-bytes-v2"  # v2: index with document starts (docs/data.md)
# Cap keeps first-use preparation to a few seconds.
STDLIB_MAX_BYTES = 6 * 1024 * 1024


def stdlib_files(max_bytes: int = STDLIB_MAX_BYTES) -> list[str]:
    """Sorted top-level stdlib *.py files, stopping once `max_bytes` is reached."""
    stdlib = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(stdlib) if n.endswith(".py"))
    files, total = [], 0
    for name in names:
        path = os.path.join(stdlib, name)
        if not os.path.isfile(path):
            continue
        size = os.path.getsize(path)
        if files and total + size > max_bytes:
            break
        files.append(path)
        total += size
    if not files:
        raise FileNotFoundError(f"data: no standard-library sources found in {stdlib}")
    return files


def default_cache_dir(cache_dir: str | None = None) -> str:
    """`cache_dir`, else $MESHLM_CACHE, else ~/.cache/meshlm."""
    if cache_dir is None:
        cache_dir = os.environ.get("MESHLM_CACHE") or os.path.join("~", ".cache", "meshlm")
    return os.path.abspath(os.path.expanduser(cache_dir))


def default_data_dir(cache_dir: str | None = None) -> str:
    """Path of the prepared default corpus, preparing it on first use.

    Concurrent callers (e.g. several ranks) each build into a private temp dir;
    the first to finish publishes it and the rest reuse that copy.
    """
    out_dir = os.path.join(default_cache_dir(cache_dir), DEFAULT_CORPUS_NAME)
    if not os.path.isfile(os.path.join(out_dir, INDEX_NAME)):
        prepare(stdlib_files(), "bytes", out_dir, overwrite=False)
    return out_dir
