"""MasterOptimizer's flat groups and GradBuckets' copy-first accumulation, on a handful of tensors."""
import pytest
import torch
from torch import nn

from meshlm.core.config import OptimConfig
from meshlm.parallel.dims.data_parallel import GradBuckets
from meshlm.parallel.dims.grad_sync import Reduction, decays, flat_groups
from meshlm.parallel.optim.master import MasterOptimizer

SHAPES = [("emb", (16, 8)), ("norm", (8,)), ("experts", (4, 6, 8)), ("bias", (6,)), ("head", (16, 8))]
LOCAL = Reduction(None, ())  # one rank: the buffers are just the gradient storage


def named(dtype):
    g = torch.Generator().manual_seed(0)
    return [(n, nn.Parameter(torch.randn(s, generator=g).to(dtype))) for n, s in SHAPES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_step_equals_per_tensor_adamw(dtype):
    """Three steps over two flat groups equal the same AdamW kernel over one fp32 tensor per parameter (decay on
    >= 2-D only); the parameters are views of one buffer per group; checkpoints see per-parameter views."""
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    ps = named(dtype)
    opt = MasterOptimizer(ps, cfg, torch.device("cpu"))
    ref_masters = [p.detach().float().clone() for _, p in ps]
    ref = torch.optim.AdamW([{"params": [m for m in ref_masters if decays(m.shape)], "weight_decay": 0.1},
                             {"params": [m for m in ref_masters if not decays(m.shape)], "weight_decay": 0.0}],
                            lr=1e-2, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            **({"fused": True} if opt.fused else {"foreach": True}))
    assert sorted(len(g) for g in opt.groups) == [2, 3]
    for group in opt.groups:
        storages = {opt.params[i].untyped_storage().data_ptr() for i in group}
        assert len(storages) == 1
    bufs = [torch.zeros(opt.flat_masters[k].numel()) for k in range(len(opt.groups))]
    opt.bind_grads(bufs)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for k, group in enumerate(opt.groups):
            bufs[k].copy_(torch.randn(bufs[k].numel(), generator=g))
            off = 0
            for i in group:
                n = ref_masters[i].numel()
                ref_masters[i].grad = bufs[k][off:off + n].view(ref_masters[i].shape).clone()
                off += n
        opt.step()
        ref.step()
    for (name, p), m in zip(ps, ref_masters):
        torch.testing.assert_close(p.float(), m.to(dtype).float(), rtol=0, atol=0, msg=name)
    kinds = [(n, k, tuple(t.shape)) for n, k, t in opt.state_storage()]
    assert kinds == [(n, k, s) for n, s in SHAPES for k in ("master", "exp_avg", "exp_avg_sq")]
    assert opt.step_count() == 3


def test_first_gradient_is_copied_and_a_missing_one_is_zero():
    """Two micro-batches accumulate in fp32 from bf16 gradients; a parameter with no gradient in a step
    reads zero after finish(), not its previous step's gradient."""
    a, b = (nn.Parameter(torch.ones(4, dtype=torch.bfloat16)) for _ in range(2))
    sync = GradBuckets([a, b], [LOCAL, LOCAL], bucket_bytes=1 << 20)
    views = dict((id(p), g) for p, g in sync.param_grads())
    x = torch.arange(4, dtype=torch.bfloat16)
    sync.begin_step()
    for i in range(2):
        sync.set_sync(i == 1)
        ((a * x).sum() + (b * 2 * x).sum()).backward()
    sync.finish()
    assert views[id(a)].dtype == torch.float32 and a.grad is None
    assert torch.equal(views[id(a)], 2 * x.float()) and torch.equal(views[id(b)], 4 * x.float())
    sync.begin_step()
    sync.set_sync(True)
    (a * x).sum().backward()
    sync.finish()
    assert torch.equal(views[id(a)], x.float()) and torch.equal(views[id(b)], torch.zeros(4))


def test_flat_groups_follow_backward_order_and_the_size_cap():
    """Groups by key, each in reverse registration order, cut where the next parameter would pass the
    cap; a parameter larger than the cap stands alone."""
    keys, numels = ["a", "b", "a", "a", "b", "a"], [4, 1, 4, 9, 1, 4]
    assert flat_groups(keys, numels) == [[5, 3, 2, 0], [4, 1]]
    assert flat_groups(keys, numels, cap=8) == [[5], [3], [2, 0], [4, 1]]


def test_zero_unit_steps_runs_of_equal_decay():
    """A ZeRO unit's optimizer runs merge neighbouring pieces with the same weight decay over the
    alignment padding between them; the padding is what the gradient buffer zeroes (`gaps`)."""
    from types import SimpleNamespace

    from meshlm.parallel.dims.zero.units import Unit
    ps = [nn.Parameter(torch.zeros(s)) for s in [(3,), (5, 4), (6, 4), (3,), (7,)]]  # fp32: 4-element align
    one_rank = Reduction(SimpleNamespace(size=1, rank=0, name="x"), ())
    u = Unit("u", ps, [f"p{i}" for i in range(5)], None, None, one_rank)
    assert u.offsets == [0, 4, 24, 48, 52] and u.padded == 60
    assert u.decay_runs() == [(False, 0, 3), (True, 4, 48), (False, 48, 59)]
    assert u.gaps == [(3, 4), (51, 52), (59, 60)]
