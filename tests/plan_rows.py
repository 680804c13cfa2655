"""`meshlm plan --emit-config FILE --emit-rank N` for rows 1..N in-process: the files the explorer's
export must equal after loading row N (tests/test_explore_api.py, tests/test_explore_browser.py)."""
from __future__ import annotations

import os
import tempfile
from unittest import mock

from meshlm.cli import main
from meshlm.plan import cli as cli_cmds


def emitted_rows(argv: list[str], rows: int) -> list[str]:
    """The TOML of rows 1..`rows` of `meshlm plan ARGV`. The search is the same for every row, so it runs
    once (memoised); the CLI's own row choice and config writing run for each."""
    real, memo, out = cli_cmds.plan, {}, []

    def once(*a, **k):
        key = repr((a, k))
        if key not in memo:
            memo[key] = real(*a, **k)
        return memo[key]
    with tempfile.TemporaryDirectory() as d, mock.patch.object(cli_cmds, "plan", once):
        for n in range(1, rows + 1):
            path = os.path.join(d, f"row{n}.toml")
            code = main(["plan", *argv, "--json", "--emit-config", path, "--emit-rank", str(n)])
            assert code == 0, (argv, n)
            with open(path) as f:
                out.append(f.read())
    return out
