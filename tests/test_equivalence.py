"""docs/architecture.md invariant 1: every layout gives the losses of one process. Later dimensions add rows here."""

import pytest

from harness import assert_layout_losses, make_config, rows, run_layout

FP32 = 1e-5
# bf16 compute: data parallelism reduces gradients in fp32, so per-micro-batch compute is identical and
# the measured worst case over 10 steps is ~1e-7; layouts that split matmuls (TP) sum bf16 partials in a
# different order. ZeRO sums the clipping norm over shards, so the clip coefficient differs in its last
# bits and some bf16 roundings of the parameters flip: measured worst 2e-5 (zero3-dp2-bf16) to 3e-4
# (with HSDP and accumulation); with clipping off the same rows agree to 1e-7. Bound: harness.HALF (1e-3),
# following the CPU's own bf16 noise where that is larger (harness.assert_half_losses, issue #45).


CASES = [
    # (name, world, overrides)
    ("dp2", 2, {"parallel__dp": 2}),
    ("dp2-accum", 2, {"parallel__dp": 2, "training__micro_batch": 1}),
    ("dp4-accum", 4, {"parallel__dp": 4, "training__micro_batch": 1}),
    ("dp2-bf16", 2, {"parallel__dp": 2, "training__precision": "bf16"}),
    ("dp4-bf16-accum", 4, {"parallel__dp": 4, "training__micro_batch": 1, "training__precision": "bf16"}),
    ("dp2-small-buckets", 2, {"parallel__dp": 2, "parallel__bucket_mb": 0.05}),
    ("dp2-ac-full", 2, {"parallel__dp": 2, "training__ac": "full"}),
    ("dp2-ac-op", 2, {"parallel__dp": 2, "training__ac": "op"}),
    # ZeRO (issue #3): stages 1-3 over the shard group, HSDP, accumulation, offload, bf16.
    ("zero1-dp2", 2, {"parallel__dp": 2, "parallel__zero": 1}),
    ("zero2-dp2", 2, {"parallel__dp": 2, "parallel__zero": 2}),
    ("zero3-dp2", 2, {"parallel__dp": 2, "parallel__zero": 3}),
    ("zero1-dp4", 4, {"parallel__dp": 4, "parallel__zero": 1}),
    ("zero2-dp4", 4, {"parallel__dp": 4, "parallel__zero": 2}),
    ("zero3-dp4", 4, {"parallel__dp": 4, "parallel__zero": 3}),
    ("hsdp-zero2-dp4-g2", 4, {"parallel__dp": 4, "parallel__zero": 2, "parallel__zero_group": 2}),
    ("hsdp-zero3-dp4-g2", 4, {"parallel__dp": 4, "parallel__zero": 3, "parallel__zero_group": 2}),
    ("zero3-dp2-accum", 2, {"parallel__dp": 2, "parallel__zero": 3, "training__micro_batch": 1}),
    ("zero3-dp2-offload", 2, {"parallel__dp": 2, "parallel__zero": 3, "parallel__offload": "optimizer"}),
    ("zero3-dp2-bf16", 2, {"parallel__dp": 2, "parallel__zero": 3, "training__precision": "bf16"}),
    ("zero3-dp4-g2-bf16-accum-offload", 4, {"parallel__dp": 4, "parallel__zero": 3, "parallel__zero_group": 2,
                                            "training__micro_batch": 1, "training__precision": "bf16",
                                            "parallel__offload": "optimizer"}),
    # Tensor / sequence parallelism (issue #4); more TP rows (bf16, fp16, clipping, padding) in test_tp.py.
    ("tp2", 2, {"parallel__tp": 2}),
    ("tp4", 4, {"parallel__tp": 4}),
    ("tp2-sp", 2, {"parallel__tp": 2, "parallel__sp": True}),
    ("tp2-gqa-kv1", 2, {"parallel__tp": 2, "model__n_kv_heads": 1}),
    ("dp2-tp2", 4, {"parallel__dp": 2, "parallel__tp": 2}),
    ("dp2-tp2-zero3", 4, {"parallel__dp": 2, "parallel__tp": 2, "parallel__zero": 3}),
    ("tp2-ac-full", 2, {"parallel__tp": 2, "training__ac": "full"}),
    ("tp2-sp-ac-op", 2, {"parallel__tp": 2, "parallel__sp": True, "training__ac": "op"}),
    # Pipeline parallelism (issue #5): every schedule at pp = 2 and 4 (4 micro-batches), then with the
    # other dimensions. Interleaved at pp = 4, v = 2 needs 8 stages: an 8-layer model.
    *[(f"pp{p}-{s}", p, {"parallel__pp": p, "parallel__pp_schedule": s}) for p in (2, 4) for s in ("gpipe", "1f1b", "zb-h1")],
    ("pp2-interleaved-v2", 2, {"parallel__pp": 2, "parallel__pp_schedule": "interleaved", "parallel__pp_virtual": 2}),
    ("pp4-interleaved-v2", 4, {"parallel__pp": 4, "parallel__pp_schedule": "interleaved", "parallel__pp_virtual": 2,
                               "model__n_layers": 8}),
    # ZB-V (issue #17): two chunks per rank in a V; rank 0 holds the first and the last stage.
    ("pp2-zbv", 2, {"parallel__pp": 2, "parallel__pp_schedule": "zbv", "parallel__pp_virtual": 2}),
    ("pp4-zbv", 4, {"parallel__pp": 4, "parallel__pp_schedule": "zbv", "parallel__pp_virtual": 2, "model__n_layers": 8}),
    ("pp2-zbv-tied-accum", 2, {"parallel__pp": 2, "parallel__pp_schedule": "zbv", "parallel__pp_virtual": 2,
                               "model__tie_embeddings": True, "training__micro_batch": 1}),
    ("pp2-tied", 2, {"parallel__pp": 2, "model__tie_embeddings": True}),
    # uneven stages, as the mixed-cluster planner splits them by card speed (docs/heterogeneous.md)
    ("pp2-uneven-3-1", 2, {"parallel__pp": 2, "parallel__pp_layers": [3, 1]}),
    # Tied embeddings across pipeline ends with ZeRO (issue #11: the copies' reduction sums over pp_ends).
    ("dp2-pp2-tied-zero1", 4, {"parallel__dp": 2, "parallel__pp": 2, "parallel__zero": 1, "model__tie_embeddings": True}),
    ("dp2-pp2-tied-zero3", 4, {"parallel__dp": 2, "parallel__pp": 2, "parallel__zero": 3, "model__tie_embeddings": True}),
    ("pp4-tied-interleaved-zero2", 4, {"parallel__pp": 4, "parallel__pp_schedule": "interleaved", "parallel__pp_virtual": 2,
                                       "model__n_layers": 8, "parallel__zero": 2, "model__tie_embeddings": True}),
    ("pp2-bf16", 2, {"parallel__pp": 2, "training__precision": "bf16"}),
    ("pp2-zb-h1-ac-full", 2, {"parallel__pp": 2, "parallel__pp_schedule": "zb-h1", "training__ac": "full"}),
    ("dp2-pp2-zero1", 4, {"parallel__dp": 2, "parallel__pp": 2, "parallel__zero": 1}),
    ("dp2-pp2-zero3", 4, {"parallel__dp": 2, "parallel__pp": 2, "parallel__zero": 3}),
    ("tp2-pp2", 4, {"parallel__tp": 2, "parallel__pp": 2}),
    ("tp2-sp-pp2-zb-h1", 4, {"parallel__tp": 2, "parallel__sp": True, "parallel__pp": 2, "parallel__pp_schedule": "zb-h1"}),
    ("dp2-tp2-pp2-1f1b", 8, {"parallel__dp": 2, "parallel__tp": 2, "parallel__pp": 2, "parallel__pp_schedule": "1f1b"}),
    # Context parallelism (issue #12): ring (zig-zag) and Ulysses, then with the other dimensions; more
    # CP rows (AC, bf16, compile, every pipeline schedule, GQA) in test_cp.py.
    ("cp2-ring", 2, {"parallel__cp": 2}),
    ("cp4-ring", 4, {"parallel__cp": 4}),
    ("cp2-ulysses", 2, {"parallel__cp": 2, "parallel__cp_impl": "ulysses"}),
    ("cp4-ulysses", 4, {"parallel__cp": 4, "parallel__cp_impl": "ulysses"}),
    ("cp4-ulysses-kv2", 4, {"parallel__cp": 4, "parallel__cp_impl": "ulysses", "model__n_kv_heads": 2}),
    ("dp2-cp2-zero3", 4, {"parallel__dp": 2, "parallel__cp": 2, "parallel__zero": 3}),
    ("cp2-tp2-sp", 4, {"parallel__cp": 2, "parallel__tp": 2, "parallel__sp": True}),
    ("pp2-cp2-1f1b", 4, {"parallel__pp": 2, "parallel__cp": 2, "parallel__pp_schedule": "1f1b"}),
    ("dp2-cp2-tp2-zero1", 8, {"parallel__dp": 2, "parallel__cp": 2, "parallel__tp": 2, "parallel__zero": 1}),
    ("pp2-cp2-tp2-sp-ulysses", 8, {"parallel__pp": 2, "parallel__cp": 2, "parallel__tp": 2, "parallel__sp": True,
                                   "parallel__cp_impl": "ulysses"}),
    # all-gather CP (Llama 3's): alone with GQA, and with ZeRO-3 over dp×cp (more rows in test_cp.py,
    # document-mask rows in test_data_layouts.py)
    ("cp2-allgather-kv2", 2, {"parallel__cp": 2, "parallel__cp_impl": "allgather", "model__n_kv_heads": 2}),
    ("dp2-cp2-allgather-zero3", 4, {"parallel__dp": 2, "parallel__cp": 2, "parallel__cp_impl": "allgather",
                                    "parallel__zero": 3}),
]

# The pipeline rows keep the debug preset's four blocks (TINY trains two): two blocks a stage at pp 2,
# so the stages' blocks are mapped to the model's as a real pipeline maps them.
CASES = [(n, w, {"model__n_layers": 4, **o} if o.get("parallel__pp", 1) > 1 else o) for n, w, o in CASES]

# `make test-fast` keeps one row per dimension (two ranks each); `make test` runs them all
FAST = {"dp2", "zero3-dp2", "tp2-sp", "pp2-1f1b", "cp2-ring"}


@pytest.mark.parametrize("name,world,overrides", rows(CASES, FAST))
def test_layout_matches_one_process(pools, name, world, overrides):
    single = {k: v for k, v in overrides.items() if not k.startswith("parallel__")}
    got = run_layout(pools, make_config(**overrides), world)
    assert_layout_losses(single, got, FP32)
