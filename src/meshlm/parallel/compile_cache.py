"""Inductor's on-disk kernel cache, one directory per CPU capability (docs/architecture.md, "Compiled code and
its cache"). torch 2.13's FX-graph cache key leaves out the CPU's vector instruction set: a graph compiled
under one ATEN_CPU_CAPABILITY (16-lane AVX-512 loops) and reloaded under another (AVX2) from one cache ran
non-finite from the first step. The capability appended to the directory keeps each family's kernels apart;
tests/test_isa_cache.py shows both the hazard (one shared directory serves the other capability's graph)
and the cure."""
from __future__ import annotations

import os

ENV = "TORCHINDUCTOR_CACHE_DIR"


def capability_dir(base: str | None = None) -> str:
    """`base` (torch's default cache directory if None) with this process's CPU capability appended."""
    import torch
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return f"{base or default_cache_dir()}-{torch.backends.cpu.get_cpu_capability().lower()}"


def key_inductor_cache() -> str:
    """Before this process's first compile: point inductor at its capability's directory. A directory the
    user chose (TORCHINDUCTOR_CACHE_DIR set to anything but torch's own default) is kept as it is: keeping
    it apart per capability is then theirs (docs/training.md)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(ENV)
    if not chosen or chosen == default_cache_dir():
        os.environ[ENV] = capability_dir()
    return os.environ[ENV]
