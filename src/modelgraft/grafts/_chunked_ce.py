"""Linear layer + cross-entropy computed a chunk of tokens at a time, never all logits at once.

``cross_entropy(F.linear(hidden, weight, bias), targets)`` holds a ``(tokens, vocab)`` logits tensor,
its log-softmax and, in backward, its gradient: three times ``tokens * vocab`` floats, far more than
the rest of a small model's activations. :func:`linear_cross_entropy` computes the same loss ``chunk``
rows at a time. In training it also computes, chunk by chunk, the gradients with respect to
``hidden``, ``weight`` and ``bias`` right away (softmax minus one-hot, through the family's logit
transform, then two matmuls), keeps those and drops the chunk's logits; backward only scales them by
the incoming gradient. It does the matmuls plain autograd does (one forward, two backward), so it
costs about the same time.

The arithmetic follows the plain computation step by step: logits in the weight's dtype (or the
autocast dtype), the family's scale and soft-capping in that dtype, then ``float()`` and the
cross-entropy in float32; ``ignore_index`` rows contribute nothing; the sum is divided by the number
of counted rows (``mean``) or by ``num_items_in_batch``. In float32 the results equal plain to
rounding (sums run in another order). With bfloat16/float16 weights each chunk's weight-gradient
product is rounded to that dtype and the chunks are summed in float32.

Example:
    >>> import torch
    >>> from torch.nn import functional as F
    >>> hidden = torch.randn(10, 8, requires_grad=True)
    >>> weight = torch.randn(32, 8, requires_grad=True)
    >>> targets = torch.tensor([1, 5, -100, 7, 31, 0, 2, -100, 9, 4])
    >>> loss = linear_cross_entropy(hidden, weight, None, targets, chunk_size=3)
    >>> expected = F.cross_entropy(hidden @ weight.T, targets)
    >>> torch.allclose(loss, expected)
    True
    >>> loss.backward()
    >>> torch.allclose(hidden.grad, torch.autograd.grad(expected, hidden)[0], atol=1e-6)
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from modelgraft.errors import DoubleBackwardError, LossInputError

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "DoubleBackwardError",
    "LogitTransform",
    "LossInputError",
    "default_chunk_size",
    "linear_cross_entropy",
]

#: A chunk holds at most this many logits (128 MiB in float32) unless a chunk size is given.
DEFAULT_CHUNK_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class LogitTransform:
    """What a family does to ``lm_head``'s output before the loss, in the order it does it.

    Attributes:
        scale_op: ``"mul"`` (Cohere's ``logits * logit_scale``), ``"div"`` (Granite's
            ``logits / logits_scaling``) or ``None``.
        scale: the factor or divisor.
        softcap: Gemma 2/3's ``final_logit_softcapping``: ``tanh(logits / cap) * cap``; ``None`` for none.

    Example:
        >>> t = LogitTransform(softcap=2.0)
        >>> t.apply(torch.tensor([[0.0, 100.0]]))[0]
        tensor([[0., 2.]])
    """

    scale_op: str | None = None
    scale: float = 1.0
    softcap: float | None = None

    def apply(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The transformed logits, and the ``tanh`` output that soft-capping's gradient needs."""
        if self.scale_op == "mul":
            logits = logits * self.scale
        elif self.scale_op == "div":
            logits = logits / self.scale
        tanh = None
        if self.softcap is not None:
            tanh = torch.tanh(logits / self.softcap)
            logits = tanh * self.softcap
        return logits, tanh

    def backward(self, grad: torch.Tensor, tanh: torch.Tensor | None) -> torch.Tensor:
        """The gradient with respect to ``lm_head``'s output, by the steps autograd would take."""
        if self.softcap is not None:
            grad = torch.ops.aten.tanh_backward(grad * self.softcap, tanh) / self.softcap
        if self.scale_op == "mul":
            grad = grad * self.scale
        elif self.scale_op == "div":
            grad = grad / self.scale
        return grad


def default_chunk_size(vocab: int) -> int:
    """Tokens per chunk when none is given: :data:`DEFAULT_CHUNK_ELEMENTS` logits per chunk.

    Example:
        >>> default_chunk_size(65536), default_chunk_size(10**9)
        (512, 1)
    """
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(1, vocab))


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    # Under autocast, F.linear runs in the autocast dtype; the plain lm_head call would too.
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and weight.is_floating_point():
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    transform: LogitTransform,
    ignore_index: int,
    chunk: int,
    scale: torch.Tensor | None,
    needs: tuple[bool, bool, bool],
    loss_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The summed loss over counted rows and, where ``needs`` asks, the gradients times ``scale``."""
    dtype = _compute_dtype(hidden, weight)
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    needs_h, needs_w, needs_b = needs
    grad_h = torch.empty_like(hidden) if needs_h else None
    # Gradients of the weight and bias are summed over chunks in float32 at least.
    acc = torch.promote_types(dtype, torch.float32)
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs_w else None
    grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if needs_b and bias is not None else None
    total = torch.zeros((), dtype=loss_dtype, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        x = hidden[start : start + chunk]
        t = targets[start : start + chunk]
        xc = x.to(dtype)
        logits, tanh = transform.apply(F.linear(xc, w, b))
        z = logits.to(loss_dtype)
        del logits
        valid = t != ignore_index
        safe = torch.where(valid, t, 0)
        picked = z.gather(1, safe[:, None]).squeeze(1)
        # log-sum-exp in place (z is a fresh tensor of ours), so a chunk holds one (rows, vocab) buffer.
        top = z.amax(dim=1)
        e = z.sub_(top[:, None]).exp_()
        sums = e.sum(dim=1)
        total += torch.where(valid, top + sums.log() - picked, 0.0).sum()
        if scale is None:
            continue
        # d loss / d z = softmax(z) - onehot(target), for counted rows only.
        g = e.div_(sums[:, None])
        g.scatter_add_(1, safe[:, None], torch.full_like(picked, -1.0)[:, None])
        g.mul_(scale).masked_fill_(~valid[:, None], 0.0)
        g = transform.backward(g.to(dtype), tanh)
        del tanh
        if grad_h is not None:
            grad_h[start : start + chunk] = g @ w
        if grad_w is not None:
            if g.dtype == grad_w.dtype:
                grad_w.addmm_(g.t(), xc)
            else:
                grad_w += g.t() @ xc
        if grad_b is not None:
            grad_b += g.sum(0, dtype=grad_b.dtype)
    return total, grad_h, grad_w, grad_b


class _LinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(transform(F.linear(hidden, weight, bias)), targets, reduction="sum") / divisor``."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        divisor: torch.Tensor,
        transform: LogitTransform,
        ignore_index: int,
        chunk: int,
        loss_dtype: torch.dtype,
    ) -> torch.Tensor:
        needs = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
        )
        # The gradient of the division, taken before the matmuls as plain autograd does; an
        # ignored row stays exactly zero even when it is infinite (nothing counted, divisor 0).
        total, grad_h, grad_w, grad_b = _chunks(
            hidden, weight, bias, targets, transform, ignore_index, chunk, 1.0 / divisor, needs, loss_dtype
        )
        ctx.save_for_backward(
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None or bias is None else grad_b.to(bias.dtype),
        )
        return total / divisor

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            # The gradients were computed in forward, outside autograd: a graph of them would hold
            # no dependence on the inputs, so second derivatives would silently be zero.
            raise DoubleBackwardError(
                "The chunked LM loss does not support `create_graph=True` (second derivatives, gradient "
                "penalties): its gradients are computed in forward. Call the model with `skip_logits=False` "
                "for this step to use the plain loss."
            )
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scaled = tuple(None if g is None else g * grad_output.to(g.dtype) for g in (grad_h, grad_w, grad_b))
        return (*scaled, None, None, None, None, None, None)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    transform: LogitTransform | None = None,
    chunk_size: int | None = None,
    loss_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """transformers' causal-LM cross-entropy of ``transform(hidden @ weight.T + bias)``, chunk by chunk.

    Args:
        hidden: ``(tokens, hidden_size)``.
        weight: ``(vocab, hidden_size)``, the ``lm_head`` weight.
        bias: ``(vocab,)`` or ``None``.
        targets: ``(tokens,)`` integer targets, already shifted; ``ignore_index`` rows are skipped.
        ignore_index: the target value of rows that do not count.
        num_items_in_batch: divide the summed loss by this (gradient accumulation) instead of
            taking the mean over counted rows, as transformers' ``fixed_cross_entropy`` does.
        transform: the family's scale and soft-capping; none by default.
        chunk_size: rows per chunk; default :func:`default_chunk_size` of the vocabulary.
        loss_dtype: the dtype of the softmax and the loss; transformers upcasts logits to float32
            (``logits.float()``), also float64 ones. Tests pass float64 to check gradients numerically.

    Returns:
        The float32 scalar loss. With no counted row and no ``num_items_in_batch`` it is NaN (0/0),
        as plain; gradients are then zero, as plain.

    Raises:
        LossInputError: shapes that do not fit, a target outside ``[0, vocab)`` that is not
            ``ignore_index``, or a chunk size below 1.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise LossInputError(
            f"`hidden` {tuple(hidden.shape)} and `weight` {tuple(weight.shape)} do not fit: expected "
            "`(tokens, hidden_size)` and `(vocab, hidden_size)`."
        )
    if targets.shape != (hidden.shape[0],):
        raise LossInputError(
            f"Expected one target per token: {hidden.shape[0]} tokens but targets of shape "
            f"{tuple(targets.shape)}. Labels must have the shape of the tokens the head sees."
        )
    vocab = weight.shape[0]
    chunk = default_chunk_size(vocab) if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise LossInputError(f"`chunk_size` must be at least 1; received {chunk_size}.")
    targets = targets.to(hidden.device)
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise LossInputError(f"Labels must be integer token ids; received dtype `{targets.dtype}`.")
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        raise LossInputError(
            f"Label {int(targets[position])} at flattened position {position} is outside the vocabulary "
            f"[0, {vocab}) and is not `ignore_index` ({ignore_index}). Fix the labels or pass `ignore_index`."
        )
    transform = transform or LogitTransform()
    if num_items_in_batch is None:
        divisor = (targets != ignore_index).sum().to(loss_dtype)
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device).to(loss_dtype)
    params = (hidden, weight) if bias is None else (hidden, weight, bias)
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        loss: torch.Tensor = _LinearCrossEntropy.apply(  # type: ignore[no-untyped-call]  # untyped in torch
            hidden, weight, bias, targets, divisor, transform, ignore_index, chunk, loss_dtype
        )
        return loss
    total, *_ = _chunks(
        hidden, weight, bias, targets, transform, ignore_index, chunk, None, (False,) * 3, loss_dtype
    )
    return total / divisor
