"""The embedded default corpus: this interpreter's own standard-library code.

Every Python install carries a few MB of real, varied code, so meshlm can train out of the box with
no download and no data set to ship. Docstrings and comments are left out (each module goes through
`ast` and back): the English in them is a third of the bytes, and a model trained for two minutes
on the mixture continues "def " with "the the the" instead of code (docs/architecture.md).
"""

from __future__ import annotations

import ast
import os
import sysconfig
import tempfile

from .build import prepare
from .shards import INDEX_NAME

__all__ = ["DEFAULT_CORPUS_NAME", "code_only", "stdlib_files", "default_cache_dir", "default_data_dir"]

DEFAULT_CORPUS_NAME = "stdlib-code-v3"  # v3: code without docstrings and comments (docs/data.md)
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


def code_only(source: str) -> str:
    """A module's code without its docstrings and comments (ast.unparse: comments do not survive, and
    every module, class and function body loses a leading string; an emptied body gets `pass`)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree) + "\n"


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
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(out_dir), prefix=".code-") as tmp:
            files = []
            for path in stdlib_files():
                with open(path, encoding="utf-8", errors="replace") as f:
                    try:
                        code = code_only(f.read())
                    except (SyntaxError, ValueError, RecursionError):  # not this interpreter's syntax
                        continue
                files.append(os.path.join(tmp, os.path.basename(path)))
                with open(files[-1], "w", encoding="utf-8") as f:
                    f.write(code)
            prepare(files, "bytes", out_dir, overwrite=False)
    return out_dir
