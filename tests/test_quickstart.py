"""The quick start: a run of the default model ends by printing its greedy continuation of "def ",
and the model has learnt a Python line: a name, parentheses, a colon. A short run on a slice of the
default corpus (five small standard-library modules, code only) stands in for
`make train`'s 1200 steps on the whole of it."""
import os
import re
import sysconfig

import pytest

from meshlm.cli import main
from meshlm.data.build import prepare
from meshlm.data.corpus import code_only

SLICE = ("bisect.py", "colorsys.py", "fnmatch.py", "genericpath.py", "glob.py")
STEPS = 300
DEF_LINE = re.compile(r"def [A-Za-z_]\w*\(.*\).*:")


@pytest.mark.slow  # 300 steps of the default model: ~40 s on two quiet cores
def test_a_short_run_prints_a_python_line_after_def(tmp_path, capsys):
    data, run_dir = tmp_path / "data", tmp_path / "run"
    files = []
    for name in SLICE:  # as the default corpus has them: code without docstrings and comments
        with open(os.path.join(sysconfig.get_paths()["stdlib"], name), encoding="utf-8") as f:
            files.append(tmp_path / name)
            files[-1].write_text(code_only(f.read()))
    prepare([str(f) for f in files], "bytes", str(data))
    code = main(["train", "--run-dir", str(run_dir), "--data.path", str(data), "--training.steps", str(STEPS),
                 "--checkpoint.every", str(STEPS), "--training.eval_every", "0"])
    err = capsys.readouterr().err
    assert code == 0, err
    lines = err.splitlines()
    assert lines[0].startswith("meshlm: tiny, 1 worker, precision fp32, compile off, run dir")
    assert "threads alive after the teardown" not in err, err  # the progress bar leaves no thread behind
    sample = lines[lines.index(next(x for x in lines if x.startswith("meshlm: sample"))) + 1]
    assert DEF_LINE.match(sample), sample
    resolved = (run_dir / "config.toml").read_text()
    assert 'precision = "fp32"' in resolved and "compile = false" in resolved


def test_the_progress_bar_starts_no_thread(tmp_path):
    import threading

    from meshlm.train.observe.metrics import MetricsLog
    before = set(threading.enumerate())
    log = MetricsLog(str(tmp_path), True, 3, 0, progress=True)
    log.write({"step": 1, "loss": 1.0, "tokens_per_s": 1.0, "mfu": 0.1})
    log.close()
    assert [t.name for t in set(threading.enumerate()) - before] == []


def test_readme_quotes_the_recorded_make_train_output():
    """The README's quoted `make train` ending is one recorded run's text (docs/make_train_output.txt),
    which keeps each machine's exact output: the numbers vary with the CPU's kernels and threads."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    with open(os.path.join(root, "docs", "make_train_output.txt"), encoding="utf-8") as f:
        recorded = f.read()
    quote = readme.split("a fresh clone printed, on the developers' machine,\n\n```\n", 1)[1].split("```", 1)[0]
    assert quote.strip() and quote in recorded, quote
    assert recorded.count("meshlm: done, step 1200 loss") >= 2  # more than one machine, each as printed
