"""model/ops.py: the hand-written backwards equal plain autograd's gradients, eager and compiled (the
custom op), whole and split into the zero-bubble schedules' input (I) and weight (W) passes."""
import pytest
import torch
import torch.nn.functional as F

from meshlm.model.ops import rms_norm, swiglu_down


def _reference(x, w_norm, w1, w3, w2):
    xf = x.float()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * w_norm
    return F.linear(F.silu(F.linear(h, w1)) * F.linear(h, w3), w2)


def _ours(x, w_norm, w1, w3, w2):
    h = rms_norm(x, w_norm, 1e-5)
    return swiglu_down(F.linear(h, w1), F.linear(h, w3), w2)


def _leaves(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 8, 16), (16,), (24, 16), (24, 16), (16, 24)]
    return [(torch.randn(s, generator=g) * (1.0 if i != 1 else 0.1) + (1.0 if i == 1 else 0.0)).to(dtype)
            .requires_grad_() for i, s in enumerate(shapes)]


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_equal_autograd(dtype, compiled):
    ref_in, our_in = _leaves(dtype), _leaves(dtype)
    fn = torch.compile(_ours, dynamic=False) if compiled else _ours
    out_ref, out = _reference(*ref_in), fn(*our_in)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out_ref.backward(gy)
    out.backward(gy)
    # bf16: inductor keeps fused intermediates in fp32, eager rounds each op: compare at the tensor's scale
    rel = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in [(out, out_ref)] + [(a.grad, b.grad) for a, b in zip(our_in, ref_in)]:
        torch.testing.assert_close(a, b, atol=rel * b.abs().max().item(), rtol=rel)


def test_split_input_and_weight_passes():
    """autograd.grad for the input only (I), then backward over the weights only (W): each pass
    computes its own gradients and together they equal one full backward."""
    ref_in, our_in = _leaves(torch.float32), _leaves(torch.float32)
    _reference(*ref_in).sum().backward()
    out = _ours(*our_in)
    (gx,) = torch.autograd.grad(out.sum(), [our_in[0]], retain_graph=True)
    assert all(p.grad is None for p in our_in[1:])
    out.sum().backward(inputs=our_in[1:])
    torch.testing.assert_close(gx, ref_in[0].grad, atol=1e-5, rtol=1e-5)
    for a, b in zip(our_in[1:], ref_in[1:]):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
