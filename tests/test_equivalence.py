"""DESIGN invariant 1: every layout gives the losses of one process. Later dimensions add rows here."""
import functools

import pytest

from harness import assert_same_losses, make_config, run_layout, run_local

FP32 = 1e-5
# bf16 compute: data parallelism reduces gradients in fp32, so per-micro-batch compute is identical and
# the measured worst case over 10 steps is ~1e-7; layouts that split matmuls (TP) sum bf16 partials in a
# different order. Stated tolerance: 1e-3.
BF16 = 1e-3


@functools.lru_cache(maxsize=None)
def reference(key: tuple) -> list:
    return run_local(make_config(**dict(key)))


CASES = [
    # (name, world, overrides)
    ("dp2", 2, {"parallel__dp": 2}),
    ("dp2-accum", 2, {"parallel__dp": 2, "training__micro_batch": 1}),
    ("dp4-accum", 4, {"parallel__dp": 4, "training__micro_batch": 1}),
    ("dp2-bf16", 2, {"parallel__dp": 2, "training__precision": "bf16"}),
    ("dp4-bf16-accum", 4, {"parallel__dp": 4, "training__micro_batch": 1, "training__precision": "bf16"}),
    ("dp2-small-buckets", 2, {"parallel__dp": 2, "parallel__bucket_mb": 0.05}),
    ("dp2-ac-full", 2, {"parallel__dp": 2, "training__ac": "full"}),
]


@pytest.mark.parametrize("name,world,overrides", CASES, ids=[c[0] for c in CASES])
def test_layout_matches_one_process(pools, name, world, overrides):
    single = {k: v for k, v in overrides.items() if not k.startswith("parallel__")}
    ref = reference(tuple(sorted(single.items())))
    got = run_layout(pools, make_config(**overrides), world)
    tol = BF16 if overrides.get("training__precision") == "bf16" else FP32
    assert_same_losses(ref, got, tol)
