"""Issue 17: the bytes a block saves for backward, measured with saved-tensor hooks on the real
parallelized model, against the documented per-token formula (plan/memory.py minimal_block_bytes)."""
import pytest
from harness import make_config
from test_tp import activation_task

from meshlm import config as C
from meshlm.layout import model_args
from meshlm.plan.memory import minimal_block_bytes

SHAPE = {"model__dim": 128, "model__n_layers": 2, "model__n_heads": 8, "model__n_kv_heads": 2,
         "model__ffn_dim": 256, "model__max_seq_len": 64, "data__seq_len": 64, "training__micro_batch": 2}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True), (4, False), (4, True)])
def test_saved_bytes_meet_formula(pools, tp, sp, precision):
    cfg = make_config(parallel__tp=tp, parallel__sp=sp, training__precision=precision, **SHAPE)
    a, e = model_args(cfg), 4 if precision == "fp32" else 2
    got = sum(pools(tp).run(activation_task, C.to_dict(cfg))[0].values())
    tokens, seq = cfg.training.micro_batch * cfg.data.seq_len, cfg.data.seq_len
    rope = 2 * 4 * (a.head_dim // 2) * seq  # cos and sin for the sequence, shared by every block
    want = tokens * minimal_block_bytes(a.dim, a.ffn_dim, a.n_heads, a.n_kv_heads, a.head_dim, tp, sp, e) + rope
    print(f"tp{tp} sp={sp} {precision}: measured {got} B, formula {want:.0f} B ({got / want:.3f}x)")
    assert 0.95 * want <= got <= 1.1 * want, (got, want)
