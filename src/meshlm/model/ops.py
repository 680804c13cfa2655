"""Block pieces with hand-written backwards, so a block saves only what its backward needs.

Plain autograd would keep the norm's fp32 copies and normalised input, and both silu(gate) and the
SwiGLU product beside gate and up. Here:

- `rms_norm` saves its input (in the compute dtype) and one fp32 rstd per token; the normalised input
  is rebuilt in backward (an element-wise pass).
- `swiglu_down` is w2(silu(gate)·up) in one node: it saves gate and up and rebuilds the product in
  backward for w2's weight gradient.

Each backward computes only the gradients the running backward pass will use (`wanted`): the
zero-bubble pipeline runs a stage's backward twice, once for the input gradient (I) and once for the
weight gradients (W), and each pass must not redo the other's products.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd import Function


def eager_under_compile(fn):
    """torch.compiler.disable(fn), bound on the first call: torch.compiler.disable imports torch._dynamo
    as it decorates, which costs about as long as importing torch (every worker and CLI process paid it
    at import), and an eager run never needs it (docs/architecture.md, "Choices")."""
    return torch._disable_dynamo(fn)


def wanted(ctx, i: int) -> bool:
    """Will the running backward pass use the gradient of input `i`? (autograd.grad(out, [x]) skips
    weights, backward(inputs=weights) skips the input chain; compiled backward graphs want all.)"""
    if not ctx.needs_input_grad[i]:
        return False
    if torch.compiler.is_compiling():
        return True
    node = ctx.next_functions[i][0]
    try:
        return node is not None and torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a leaf under autograd.grad(): torch cannot tell, so compute it
        return True


def edge(w: torch.Tensor) -> torch.Tensor:
    """A weight behind a view node: `wanted` can ask the engine about a view, not about a leaf."""
    return w.view_as(w) if w.requires_grad else w


def weight_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Σ over tokens of gᵀx: a linear layer's weight gradient."""
    return g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """fp32 for 16-bit inputs (the norm's statistics), the input's own precision otherwise."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _sum_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).sum(0)


class _RMSNorm(Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = _upcast(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        xhat = _upcast(x) * rstd
        gx = gw = None
        if wanted(ctx, 1):
            gw = _sum_rows(g * xhat.type_as(x)).to(weight.dtype)
        if wanted(ctx, 0):
            gn = _upcast(g * weight)  # gradient at the normalised input
            # d/dx of x·rstd(x): rstd·(gn − x̂·mean(gn·x̂))
            gx = (rstd * (gn - xhat * (gn * xhat).mean(-1, keepdim=True))).type_as(x)
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x·rsqrt(mean(x²) + eps)·weight, normalised in fp32, saving x and the per-token rstd only."""
    return _RMSNorm.apply(x, edge(weight), eps)


class _SwiGLUDown(Function):
    @staticmethod
    def forward(ctx, gate, up, w2):
        ctx.save_for_backward(gate, up, w2)
        return F.linear(F.silu(gate) * up, w2)

    @staticmethod
    def backward(ctx, g):
        gate, up, w2 = ctx.saved_tensors
        return _swiglu_down_grads(g, gate, up, w2, wanted(ctx, 0) or wanted(ctx, 1), wanted(ctx, 2))


def _swiglu_down_grads(g, gate, up, w2, inputs: bool, weight: bool):
    """Gradients of w2(silu(gate)·up) for gate and up (`inputs`) and for w2 (`weight`), with as few
    element-wise passes as autograd's own (silu rebuilt once, torch's fused silu_backward)."""
    silu = F.silu(gate)
    g_gate = g_up = g_w2 = None
    if inputs:
        gp = g @ w2  # gradient at the product
        g_up = gp * silu
        g_gate = torch.ops.aten.silu_backward(gp.mul_(up), gate)
    if weight:
        g_w2 = weight_grad(g, silu.mul_(up))  # the product, rebuilt in silu's buffer
    return g_gate, g_up, g_w2


@torch.library.custom_op("meshlm::swiglu_down", mutates_args=())
def _swiglu_down_op(gate: torch.Tensor, up: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(gate) * up, w2)


@_swiglu_down_op.register_fake
def _(gate, up, w2):
    return gate.new_empty(gate.shape[:-1] + (w2.shape[0],))


def _swiglu_down_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_down_grad(ctx, g):
    return _swiglu_down_grads(g, *ctx.saved_tensors, True, True)


_swiglu_down_op.register_autograd(_swiglu_down_grad, setup_context=_swiglu_down_setup)


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """w2(silu(gate)·up), saving gate and up only (the product is rebuilt in backward).

    Compiled, the same node is an opaque custom op: inductor's partitioner would otherwise see the
    product feeding w2's weight-gradient matmul in backward and save it (a matmul input is never
    "free" to recompute there), one e·ffn per token more than eager."""
    if torch.compiler.is_compiling():
        return _swiglu_down_op(gate, up, w2)
    return _SwiGLUDown.apply(gate, up, edge(w2))
