"""The quick start: a run of the default model ends by printing its greedy continuation of "def ",
and the model has learnt a Python line: a name, parentheses, a colon. A short run on a slice of the
default corpus (the first standard-library files) stands in for `make train`'s full one."""
import re

import pytest

from meshlm.cli import main
from meshlm.data.build import prepare
from meshlm.data.corpus import stdlib_files

SLICE_BYTES = 100_000
STEPS = 200
DEF_LINE = re.compile(r"def [A-Za-z_]\w*\(.*\).*:")


@pytest.mark.slow  # a couple of hundred steps of the default model: ~30 s on two quiet cores
def test_a_short_run_prints_a_python_line_after_def(tmp_path, capsys):
    data, run_dir = tmp_path / "data", tmp_path / "run"
    prepare(stdlib_files(SLICE_BYTES), "bytes", str(data))
    code = main(["train", "--run-dir", str(run_dir), "--data.path", str(data), "--training.steps", str(STEPS),
                 "--checkpoint.every", str(STEPS), "--training.eval_every", "0", "--metrics.progress", "false"])
    err = capsys.readouterr().err
    assert code == 0, err
    lines = err.splitlines()
    assert lines[0].startswith("meshlm: tiny, 1 worker, precision fp32, compile off, run dir")
    sample = lines[lines.index(next(x for x in lines if x.startswith("meshlm: sample"))) + 1]
    assert DEF_LINE.match(sample), sample
    resolved = (run_dir / "config.toml").read_text()
    assert 'precision = "fp32"' in resolved and "compile = false" in resolved
