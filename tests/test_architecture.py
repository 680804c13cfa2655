"""The layers of docs/architecture.md hold: import-linter's contracts in pyproject.toml (imports point
downward, no cycle between sibling modules), run as CI runs them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from harness import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    assert exe, "import-linter is a dev dependency (pyproject.toml); install with pip install -e '.[dev]'"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    res = subprocess.run([exe, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "5 kept, 0 broken" in res.stdout, res.stdout[-2000:]


def test_importing_the_package_leaves_the_compiler_and_dcp_out(tmp_path):
    """torch._dynamo costs about as much as torch to import: a process that never builds an optimizer or
    compiles (`meshlm train --nproc`'s launcher, the planner's commands) must not pay it at import
    (model/ops.py eager_under_compile). torch.distributed.checkpoint with DTensor costs 0.4-0.7 CPU-s on
    every worker start: a run that never saves or resumes must not import it (train/checkpoint/pieces.py)."""
    run = ["train", "--run-dir", str(tmp_path / "run"), "--training.steps", "1"]
    run += [x for k, v in TINY.items() if k != "training.steps" for x in (f"--{k}", str(v))]
    code = ("import sys, meshlm.cli, meshlm.train.trainer, meshlm.train.worker, meshlm.parallel.compose, "
            "meshlm.parallel.dims.expert_parallel, meshlm.parallel.dims.context_parallel; "
            "print('torch._dynamo' in sys.modules, 'torch.distributed.checkpoint' in sys.modules); "
            f"assert meshlm.cli.main({run!r}) == 0; print('torch.distributed.checkpoint' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    imported, trained = res.stdout.strip().splitlines()[-2:]
    assert imported == "False False", f"an import pulled in torch._dynamo or DCP: {imported}"
    assert trained == "False", "a run without checkpoints imported torch.distributed.checkpoint"


SRC = os.path.join(ROOT, "src", "meshlm")


def _modules(package_dir: str) -> list[str]:
    out = []
    for d, _, files in os.walk(package_dir):
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), os.path.join(ROOT, "src"))[:-3].replace(os.sep, ".")
                out.append(rel.removesuffix(".__init__"))
    return sorted(out)


def test_core_and_the_planner_run_without_torch(tmp_path):
    """The foundation and the planner building import no torch (docs/architecture.md, "The two
    buildings"): every module of core/, plan/ and explore/ imports, and `meshlm estimate` and
    `meshlm plan` run, in a process where `import torch` fails."""
    mods = _modules(os.path.join(SRC, "core")) + _modules(os.path.join(SRC, "plan")) + _modules(os.path.join(SRC, "explore"))
    code = ("import sys, importlib; sys.modules['torch'] = None\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "from meshlm.cli import main\n"
            "assert main(['estimate', '--config', 'configs/llama3-8b-8xh100.toml', '--gpu', 'h100', '--gpus', '8']) == 0\n"
            "assert main(['plan', '--model', 'llama3-8b', '--gpu', 'h100', '--gpus', '16', '--top', '2']) == 0\n"
            "print('torch' in sys.modules and sys.modules['torch'] is not None)")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), MESHLM_PLAN_WORKERS="1")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "False"


def _module_path(mod: str) -> str:
    rel = mod.replace(".", os.sep)
    path = os.path.join(ROOT, "src", rel + ".py")
    return path if os.path.exists(path) else os.path.join(ROOT, "src", rel, "__init__.py")


def _private_imports(path: str, module: str) -> list[str]:
    """`from X import _name` and `mod._name` for a meshlm module X / mod imported here."""
    import ast
    tree = ast.parse(open(path).read())
    is_pkg = path.endswith("__init__.py")
    package = module if is_pkg else module.rsplit(".", 1)[0]
    found, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if not base.startswith("meshlm"):
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{module}:{node.lineno}: from {base} import {a.name}")
                aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name.startswith("meshlm")}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{module}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_imports_another_modules_private_names():
    """A name with a leading underscore is its module's own: a neighbour that needs it gets a public name
    (docs/architecture.md, "Rules of the house")."""
    found = []
    for mod in _modules(SRC):
        path = _module_path(mod)
        found += _private_imports(path, mod)
    assert not found, "\n".join(found)


def test_the_private_name_rule_can_fail(tmp_path):
    path = tmp_path / "b.py"
    path.write_text("from .a import _hidden, shown\nfrom . import a\nx = a._also\n")
    assert _private_imports(str(path), "meshlm.pkg.b") == ["meshlm.pkg.b:1: from meshlm.pkg.a import _hidden",
                                                           "meshlm.pkg.b:3: a._also"]


def test_files_and_functions_stay_short():
    """No module over 450 lines, no function over 80 (docs/architecture.md, "Rules of the house")."""
    import ast
    long = []
    for mod in _modules(SRC):
        path = _module_path(mod)
        text = open(path).read()
        if text.count("\n") > 450:
            long.append(f"{mod}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{mod}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, "\n".join(long)


def test_trainer_stays_short():
    """The loop reads in one sitting: train/trainer.py at most 250 lines (what it does not own lives in
    the modules it calls)."""
    with open(os.path.join(SRC, "train", "trainer.py")) as f:
        assert sum(1 for _ in f) <= 250
