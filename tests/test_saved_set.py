"""Issue 17: the bytes a block saves for backward, measured with saved-tensor hooks on the real
parallelized model, against the documented per-token formula (plan/cost/memory.py minimal_block_bytes)."""
import pytest
from harness import make_config
from test_tp import activation_task

from meshlm.core import config as C
from meshlm.core.config.model import model_args
from meshlm.plan.cost.activations import minimal_block_bytes

SHAPE = {"model__dim": 128, "model__n_layers": 2, "model__n_heads": 8, "model__n_kv_heads": 2,
         "model__ffn_dim": 256, "model__max_seq_len": 64, "data__seq_len": 64, "training__micro_batch": 2}


def saved_task(cfg_dict: dict) -> tuple[int, bool]:
    """Bytes block 0 saves in one forward on this rank, and whether that block is compiled."""
    parts, compiled = activation_task(cfg_dict, True)
    return sum(parts.values()), compiled


LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]
# (tp, sp, precision, compiled): every layout eager in both precisions; compiled (CPU inductor, slow to
# build on 2 cores) every layout in bf16 and the two ends in fp32
CASES = [(t, s, p, False) for t, s in LAYOUTS for p in ("fp32", "bf16")] + \
    [(t, s, "bf16", True) for t, s in LAYOUTS] + [(1, False, "fp32", True), (4, True, "fp32", True)]


@pytest.mark.parametrize("tp,sp,precision,compiled", CASES,
                         ids=[f"tp{t}{'-sp' if s else ''}-{p}{'-compiled' if c else ''}" for t, s, p, c in CASES])
def test_saved_bytes_meet_formula(pools, tp, sp, precision, compiled):
    cfg = make_config(parallel__tp=tp, parallel__sp=sp, training__precision=precision,
                      training__compile=compiled, **SHAPE)
    a, e = model_args(cfg), 4 if precision == "fp32" else 2
    got, is_compiled = pools(tp).run(saved_task, C.to_dict(cfg))[0]
    assert is_compiled == compiled
    tokens, seq = cfg.training.micro_batch * cfg.data.seq_len, cfg.data.seq_len
    rope = 2 * 4 * (a.head_dim // 2) * seq  # cos and sin for the sequence, shared by every block
    want = tokens * minimal_block_bytes(a.dim, a.ffn_dim, a.n_heads, a.n_kv_heads, a.head_dim, tp, sp, e) + rope
    print(f"tp{tp} sp={sp} {precision}: measured {got} B, formula {want:.0f} B ({got / want:.3f}x)")
    assert 0.95 * want <= got <= 1.1 * want, (got, want)


@pytest.mark.parametrize("tp,sp,ac,compiled", [(2, True, "selective", True), (2, True, "op", True),
                                               (2, False, "op", True), (2, False, "op", False)])
def test_ac_modes_meet_planner(pools, tp, sp, ac, compiled):
    """Recomputation modes with TP against the planner (plan/cost/memory.py), compiled or not."""
    from meshlm.plan.cost.activations import block_activation_bytes
    from meshlm.plan.spec import shape_from_config
    cfg = make_config(parallel__tp=tp, parallel__sp=sp, training__precision="bf16", training__compile=compiled,
                      training__ac=ac, **SHAPE)
    got, is_compiled = pools(tp).run(saved_task, C.to_dict(cfg))[0]
    assert is_compiled == (compiled and not (ac == "op" and tp > 1))  # parallel/compose.py
    seq = cfg.data.seq_len
    a = model_args(cfg)
    rope = 2 * 4 * (a.head_dim // 2) * seq
    want = block_activation_bytes(shape_from_config(cfg), cfg.training.micro_batch * seq, seq, 2, tp, sp, ac,
                                  compiled=compiled) + rope
    print(f"tp{tp} sp={sp} {ac} compiled: measured {got} B, planner {want:.0f} B ({got / want:.3f}x)")
    assert got == pytest.approx(want, rel=0.05)
