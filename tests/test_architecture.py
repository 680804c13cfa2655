"""The layers of docs/architecture.md hold: import-linter's contracts in pyproject.toml (imports point
downward, no cycle between sibling modules), run as CI runs them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    assert exe, "import-linter is a dev dependency (pyproject.toml); install with pip install -e '.[dev]'"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    res = subprocess.run([exe, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "2 kept, 0 broken" in res.stdout, res.stdout[-2000:]


def test_importing_the_package_leaves_the_compiler_out():
    """torch._dynamo costs about as much as torch to import: a process that never builds an optimizer or
    compiles (`meshlm train --nproc`'s launcher, the planner's commands) must not pay it at import
    (model/ops.py eager_under_compile)."""
    code = ("import sys, meshlm.cli, meshlm.train.trainer, meshlm.parallel.compose, meshlm.parallel.dims.expert_parallel, "
            "meshlm.parallel.dims.context_parallel; print('torch._dynamo' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "False", "an import pulled in torch._dynamo (torch.compiler.disable at import?)"
