"""The zero-bubble split of a stage's backward into I (input gradient) and W (weight gradients).

I runs `autograd.grad(out, [x])`: autograd then computes only the input-gradient chain and skips every
weight-gradient product. W must do those products later without redoing the chain. Before I we find,
for every parameter, its *boundary*: the first node above the parameter's gradient accumulator that
lies on the input chain (for a linear layer, its matmul; for a norm gain, its multiply). I records the
gradient arriving at each boundary (a node pre-hook); W then runs one `autograd.backward` per boundary
from exactly there (`GradientEdge` roots) with `inputs=` that boundary's parameters, so only the
weight side executes, gradients accumulate through the usual hooks (DP buckets, ZeRO) and the result
is bit-identical to a plain backward.

When that is not safe or not cheaper — a parameter meeting the input chain twice (the same weight
used at two depths: starting from both would count one use twice), or full activation checkpointing
(each separate backward call would recompute the block again) — W falls back to
`autograd.backward(out, inputs=params)`, which walks the chain a second time (about 1.5× a plain B).
"""
from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


def _boundaries(out: torch.Tensor, x: torch.Tensor, params: list) -> dict | None:
    """{(boundary nodes...): [params]} in parameter order, or None when a split is unsafe."""
    root = out.grad_fn
    parents: dict = {}
    stack, seen = [root], {root}
    while stack:
        n = stack.pop()
        for c, _ in n.next_functions:
            if c is None:
                continue
            parents.setdefault(c, []).append(n)
            if c not in seen:
                seen.add(c)
                stack.append(c)
    x_node = get_gradient_edge(x).node
    chain, stack = {x_node}, [x_node]  # nodes from which x's gradient is reachable
    while stack:
        for q in parents.get(stack.pop(), []):
            if q not in chain:
                chain.add(q)
                stack.append(q)
    groups: dict = {}
    for p in params:
        acc = get_gradient_edge(p).node
        if acc not in parents:
            continue  # not used by this micro-batch's graph
        found, stack, visited = [], [acc], {acc}
        while stack:
            for q in parents.get(stack.pop(), []):
                if q in chain:
                    if q not in found:
                        found.append(q)
                elif q not in visited:
                    visited.add(q)
                    stack.append(q)
        if len(found) != 1:
            return None
        groups.setdefault(found[0], []).append(p)
    return groups


class SplitBackward:
    """State between a stage's I and W for one micro-batch."""

    def __init__(self, out: torch.Tensor, grad: torch.Tensor | None, params: list, groups: dict | None):
        self.out, self.grad, self.params, self.groups = out, grad, params, groups
        self.captured: dict = {}

    def weight(self) -> None:
        """W: accumulate the parameters' gradients."""
        if self.groups is None:
            torch.autograd.backward(self.out, self.grad, inputs=self.params)
            return
        for node, ps in self.groups.items():
            grads = self.captured.get(node)
            if grads is None:
                continue
            roots = [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
            if roots:
                torch.autograd.backward(roots, [g for g in grads if g is not None], inputs=ps, retain_graph=True)


def input_backward(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None, params: list,
                   split: bool = True) -> tuple[torch.Tensor | None, SplitBackward]:
    """I: the gradient of the stage input `x` (None on the first stage, which has no input gradient),
    and what W needs later."""
    if x is None:
        return None, SplitBackward(out, grad, params, None)
    groups = _boundaries(out, x, params) if split else None
    state = SplitBackward(out, grad, params, groups)
    hooks = []
    for node in groups or ():
        hooks.append(node.register_prehook(lambda g, node=node: state.captured.__setitem__(node, g)))
    try:
        (gx,) = torch.autograd.grad(out, [x], grad, retain_graph=True)
    finally:
        for h in hooks:
            h.remove()
    if groups is not None:  # W starts at the boundaries: the output side of the graph and the
        state.out = state.grad = None  # received gradient need not wait for it (as torch's detach_)
    return gx, state
