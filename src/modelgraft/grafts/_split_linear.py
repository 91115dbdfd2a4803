"""One linear layer whose output comes back in parts, with a backward that never concatenates.

``fused(x).split(sizes, -1)`` is the obvious way to run a fused QKV or gate/up layer, but its
backward first concatenates the part gradients into one ``(tokens, out_features)`` tensor, and
on the CPU one matmul over the whole fused width is no faster than a matmul per part, often
slower (6-7% for a Llama gate/up forward, hidden 1024, measured with MKL). :func:`split_linear`
computes each part with its own matmul, like the separate layers did, and its backward writes
each part's weight gradient straight into its rows of one gradient buffer and accumulates the
input gradient in place, so it does the plain model's work minus the copies and additions.

Example:
    >>> import torch
    >>> x = torch.randn(5, 4, requires_grad=True)
    >>> weight = torch.randn(7, 4, requires_grad=True)
    >>> a, b = split_linear(x, weight, None, (3, 4))
    >>> torch.allclose(torch.cat([a, b], -1), x @ weight.T)
    True
    >>> (a.sum() + 2 * b.sum()).backward()
    >>> scale = torch.tensor([1.0] * 3 + [2.0] * 4)
    >>> torch.allclose(weight.grad, scale[:, None] * x.detach().sum(0))
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

__all__ = ["split_linear"]


def _parts(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: tuple[int, ...]
) -> tuple[torch.Tensor, ...]:
    # Tensor.split is untyped in torch
    biases = bias.split(sizes) if bias is not None else (None,) * len(sizes)  # type: ignore[no-untyped-call]
    return tuple(F.linear(x, w, b) for w, b in zip(weight.split(sizes), biases, strict=True))  # type: ignore[no-untyped-call]


class _SplitLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias).split(sizes, -1)``, one matmul per part each way."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: tuple[int, ...]
    ) -> tuple[torch.Tensor, ...]:
        parts = _parts(x, weight, bias, sizes)
        ctx.sizes = sizes
        ctx.has_bias = bias is not None
        # A part that feeds nothing differentiable gets None, not a tensor of zeros to multiply.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight)
        return parts

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        sizes: tuple[int, ...] = ctx.sizes
        if torch.is_grad_enabled():
            return _differentiable_backward(ctx, x, weight, grads)
        flat = [None if g is None else g.reshape(-1, size) for g, size in zip(grads, sizes, strict=True)]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # addmm_ sums the parts' contributions inside the matmul, with no extra tensor per part.
            for g, w in zip(flat, weight.split(sizes), strict=True):
                if g is None:
                    continue
                if grad_x is None:
                    grad_x = g @ w
                else:
                    grad_x.addmm_(g, w)
            if grad_x is not None:
                grad_x = grad_x.view(x.shape)
        if ctx.needs_input_grad[1]:
            flat_x = x.reshape(-1, x.shape[-1])
            grad_w = weight.new_empty(weight.shape)
            for g, rows in zip(flat, grad_w.split(sizes), strict=True):
                if g is None:
                    rows.zero_()
                else:
                    torch.mm(g.t(), flat_x, out=rows)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = weight.new_empty(weight.shape[0])
            for g, rows in zip(flat, grad_b.split(sizes), strict=True):
                if g is None:
                    rows.zero_()
                else:
                    torch.sum(g, dim=0, out=rows)
        return grad_x, grad_w, grad_b, None


def _differentiable_backward(
    ctx: Any, x: torch.Tensor, weight: torch.Tensor, grads: tuple[torch.Tensor | None, ...]
) -> tuple[torch.Tensor | None, ...]:
    # backward(create_graph=True) (gradient penalties, Hessian-vector products): out= and in-place
    # matmuls are not differentiable, so concatenate and let autograd record ordinary ops.
    parts = [
        torch.zeros((*x.shape[:-1], size), dtype=weight.dtype, device=weight.device) if g is None else g
        for g, size in zip(grads, ctx.sizes, strict=True)
    ]
    g = torch.cat(parts, dim=-1).reshape(-1, weight.shape[0])
    grad_x = (g @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
    grad_w = g.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b, None


def split_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: tuple[int, ...]
) -> tuple[torch.Tensor, ...]:
    """``F.linear(x, weight, bias).split(sizes, dim=-1)``, computed and differentiated per part.

    Args:
        x: the input, ``(..., in_features)``.
        weight: the fused weight, ``(sum(sizes), in_features)``, a plain floating tensor.
        bias: the fused bias, ``(sum(sizes),)``, or None.
        sizes: the width of each part, in order.

    Returns:
        One tensor per part, ``(..., size)``, each contiguous.

    Example:
        >>> x, weight = torch.randn(2, 3, 4), torch.randn(5, 4)
        >>> [tuple(p.shape) for p in split_linear(x, weight, torch.zeros(5), (2, 3))]
        [(2, 3, 2), (2, 3, 3)]
    """
    sizes = tuple(sizes)
    params = (x, weight) if bias is None else (x, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in params):
        parts: tuple[torch.Tensor, ...] = _SplitLinear.apply(x, weight, bias, sizes)  # type: ignore[no-untyped-call]
        return parts
    return _parts(x, weight, bias, sizes)  # nothing to differentiate: skip the autograd node
