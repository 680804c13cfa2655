"""Inductor's kernel cache, one directory per CPU capability (meshlm/parallel/compile_cache.py): torch 2.13's
FX-graph cache key leaves out the vector instruction set, so a graph compiled under one ATEN_CPU_CAPABILITY
and reloaded under another from one directory is wrong (AVX-512 loops on AVX2 vectors ran non-finite; on a
host whose own capability is AVX2, AVX2 code rebuilt without vector support does not compile).

Independent of how the directory name is built: each process below compiles the model's RMSNorm (a custom
autograd Function, the graph that showed it) in a fresh interpreter and reports inductor's own cache
counters. The two capabilities are the machine's own and `default` (no vector ISA), which every x86 host
has, so the test runs everywhere. The control shares one directory between them and must show the hazard
(the other capability's graph is served, or fails); keyed, each capability misses its own cache once,
computes what eager computes, and hits it the next time. Removing the key makes the keyed run the control,
which fails the test."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

PROBE = """
import os, sys, torch
from meshlm.parallel.compile_cache import capability_dir
os.environ["TORCHINDUCTOR_CACHE_DIR"] = capability_dir(sys.argv[1]) if sys.argv[2] == "keyed" else sys.argv[1]
from torch._dynamo.utils import counters
from meshlm.model.ops import rms_norm
torch.manual_seed(0)
x = torch.randn(2, 32, 64, requires_grad=True)
w = torch.nn.Parameter(torch.randn(64))
f = lambda a, b: rms_norm(a, b, 1e-5)
err = float((torch.compile(f, dynamic=False)(x, w) - f(x, w)).abs().max())
c = counters["inductor"]
print("capability", torch.backends.cpu.get_cpu_capability(), "hit", c["fxgraph_cache_hit"], "miss",
      c["fxgraph_cache_miss"], "err", err)
from meshlm.core.process import exit_frozen
exit_frozen(0 if err < 1e-5 else 1)  # as every meshlm process ends: torch is not freed one by one
"""


def _compile_in(base: str, mode: str, capability: str | None) -> tuple[int, dict]:
    """(exit status, the probe's report) of one compile in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR")}
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    proc = subprocess.run([sys.executable, "-c", PROBE, base, mode], env=env, capture_output=True, text=True)
    m = re.search(r"capability (\S+) hit (\d+) miss (\d+) err (\S+)", proc.stdout)
    said = {"cap": m.group(1), "hit": int(m.group(2)), "miss": int(m.group(3))} if m else {}
    return proc.returncode, {**said, "log": proc.stdout + proc.stderr[-1500:]}


@pytest.mark.slowest  # five compiles in fresh interpreters, two at a time: half a minute on two cores
def test_cache_is_per_capability_and_sharing_one_is_the_hazard(tmp_path):
    """The shared and the keyed directories are independent, so their compiles run side by side (each
    is one process bound by one core); within a directory the order is kept."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    own = torch.backends.cpu.get_cpu_capability()
    assert own != "DEFAULT", "run the suite without ATEN_CPU_CAPABILITY=default: the test needs a second family"
    shared, keyed = str(tmp_path / "shared"), str(tmp_path / "keyed")
    with ThreadPoolExecutor(2) as two:
        (rc, first), (rc_own, said_own) = two.map(lambda a: _compile_in(*a), [(shared, "shared", None),
                                                                              (keyed, "keyed", None)])
        (rc_other, other), (rc_def, said_def) = two.map(lambda a: _compile_in(*a), [(shared, "shared", "default"),
                                                                                     (keyed, "keyed", "default")])
    assert rc == 0 and first["miss"] == 1, first["log"]
    assert rc_other != 0 or other.get("hit", 0) > 0, \
        f"one shared cache no longer serves {own}'s graph to `default`: torch keys the ISA now, and " \
        f"compile_cache.py may go\n{other['log']}"
    for rc_k, said, want in ((rc_own, said_own, own), (rc_def, said_def, "DEFAULT")):
        assert rc_k == 0 and said["cap"] == want and said["miss"] == 1 and said["hit"] == 0, said["log"]
    rc, again = _compile_in(keyed, "keyed", None)  # the cache works: the own family's graph is found
    assert rc == 0 and again["hit"] == 1 and again["miss"] == 0, again["log"]


def test_a_compiled_run_keys_the_cache_and_keeps_a_chosen_one(monkeypatch, tmp_path):
    """parallelize() keys the cache before its first compile (torch.compile is lazy: building the Trainer
    compiles nothing); a directory the user chose is kept; torch's own unkeyed default is keyed."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from harness import make_config
    from meshlm.distributed.mesh import init_context, pick_device
    from harness import build_layout
    from meshlm.parallel.compile_cache import ENV, capability_dir, key_inductor_cache
    from meshlm.train.trainer import Trainer

    for before, after in ((None, capability_dir()), (default_cache_dir(), capability_dir()),
                          (str(tmp_path / "mine"), str(tmp_path / "mine"))):
        if before is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, before)
        assert key_inductor_cache() == after and os.environ[ENV] == after
    monkeypatch.delenv(ENV)
    cfg = make_config(training__compile=True, training__steps=1)
    layout = build_layout(cfg, 1)
    Trainer(cfg, str(tmp_path / "run"), init_context(layout.shape(), pick_device("cpu")), layout)
    assert os.environ[ENV] == capability_dir()
    monkeypatch.delenv(ENV)
    Trainer(make_config(training__steps=1), str(tmp_path / "eager"), init_context(layout.shape(), pick_device("cpu")),
            layout)
    assert ENV not in os.environ  # an eager run leaves inductor alone
