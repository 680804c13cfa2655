"""Inductor's cache is keyed by CPU capability in the suite (tests/conftest.py `inductor_cache_dir`): a
kernel compiled under the machine's default capability and reloaded under ATEN_CPU_CAPABILITY=avx2 from one
shared cache runs AVX-512-wide loops on 8-lane vectors (torch 2.13), and every compiled test then fails
non-finite at step 1 under `make test-isa`-style runs. Each process here compiles the RMSNorm of the
model (a custom autograd Function, the graph that showed it) with its input needing a gradient, in
the cache directory the suite gives its capability, and compares with eager."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import os, sys, torch
sys.path.insert(0, sys.argv[2])
from conftest import inductor_cache_dir
os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir(sys.argv[1])
from meshlm.model.ops import rms_norm
torch.manual_seed(0)
x = torch.randn(2, 32, 64, requires_grad=True)
w = torch.nn.Parameter(torch.randn(64))
f = lambda a, b: rms_norm(a, b, 1e-5)
err = float((torch.compile(f, dynamic=False)(x, w) - f(x, w)).abs().max())
print("capability", torch.backends.cpu.get_cpu_capability(), "err", err)
sys.exit(0 if err < 1e-5 else 1)
"""


def _compile_in(cache_base: str, capability: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    return subprocess.run([sys.executable, "-c", PROBE, cache_base, os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True)


@pytest.mark.slowest  # two compiles in fresh interpreters: a minute on two cores
def test_suite_cache_is_per_capability(tmp_path):
    import torch
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        pytest.skip("this CPU's default capability is avx2 already: there is no second kernel family to mix")
    base = str(tmp_path / "inductor")
    first = _compile_in(base, None)  # the machine's own kernels fill their cache
    assert first.returncode == 0, first.stdout + first.stderr[-2000:]
    second = _compile_in(base, "avx2")  # then AVX2 compiles in a directory of its own
    assert second.returncode == 0, second.stdout + second.stderr[-2000:]
    assert "AVX2" in second.stdout, second.stdout
    assert os.listdir(base + "-avx2") and os.listdir(base + "-" + torch.backends.cpu.get_cpu_capability().lower())
