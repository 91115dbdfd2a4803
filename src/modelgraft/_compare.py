"""NaN-safe comparisons of what the plain and the grafted model give: outputs and weights.

Used by :func:`modelgraft.verify`. Outputs must agree in type, shape and dtype, be finite in both
models, and lie within a tolerance; weights must agree bit for bit. ``diff > atol`` is never true
for a NaN, and ``torch.equal`` calls a NaN unequal to itself and ``-0.0`` equal to ``0.0``: neither
is used as a verdict here.

Example:
    >>> import torch
    >>> from modelgraft._compare import compare_outputs
    >>> plain = torch.ones(2, 3)
    >>> grafted = plain.clone(); grafted[0, 1] = float("inf")
    >>> compare_outputs(["logits"], [plain], [grafted], 1e-5, 0.0)
    (False, '`logits`: 1 inf where the plain model is finite (first at index (0, 1))')
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["compare_outputs", "few", "same_bits"]


def few(names: Sequence[str], n: int = 4) -> str:
    """Up to ``n`` names in backticks, and how many more.

    Example:
        >>> few(["a", "b", "c"], n=2)
        '`a`, `b` (+1 more)'
    """
    shown = ", ".join(f"`{x}`" for x in names[:n])
    return shown + (f" (+{len(names) - n} more)" if len(names) > n else "")


def compare_outputs(
    labels: Sequence[str], ref: Sequence[Any], got: Sequence[Any], atol: float, rtol: float
) -> tuple[bool, str]:
    """Compare plain (``ref``) and grafted (``got``) outputs, NaN-safe, never broadcasting.

    Each pair must agree in type, shape and dtype, hold only finite values (in both models: a
    non-finite reference hides any difference), and satisfy ``|got - ref| <= atol + rtol * |ref|``
    everywhere. The difference is taken in float64, so two finite fp32 values never overflow it.

    Example:
        >>> a = torch.zeros(2, 3)
        >>> b = a.clone(); b[1, 2] = float("nan")
        >>> compare_outputs(["logits"], [a], [b], 1e-5, 0.0)
        (False, '`logits`: 1 NaN where the plain model is finite (first at index (1, 2))')
        >>> compare_outputs(["logits"], [a], [a.clone()], 0.0, 0.0)
        (True, 'max |diff| 0.00e+00 over shape (2, 3) (atol 0)')
    """
    problems: list[str] = []
    out_of_tolerance: list[str] = []
    worst = 0.0
    for label, a, b in zip(labels, ref, got, strict=True):
        problem = _mismatch(label, a, b)
        if problem is not None:
            problems.append(problem)
            continue
        if a.numel() == 0:
            continue
        diff = (a.double() - b.double()).abs()
        worst = max(worst, diff.max().item())
        # `<=` rather than `not >`: a NaN anywhere (there should be none by now) can only fail
        if not bool((diff <= atol + rtol * a.double().abs()).all()):
            out_of_tolerance.append(label)
    tolerance = f"atol {atol:g}" + (f", rtol {rtol:g}" if rtol else "")
    if problems:
        if out_of_tolerance:
            problems.append(
                f"out of tolerance: {few(out_of_tolerance)} (max |diff| {worst:.2e}, {tolerance})"
            )
        return False, "; ".join(problems)
    what = f"{len(ref)} tensors" if len(ref) > 1 else f"shape {tuple(ref[0].shape)}"
    detail = f"max |diff| {worst:.2e} over {what} ({tolerance})"
    if out_of_tolerance or not math.isfinite(worst):
        return False, detail + (f"; out of tolerance: {few(out_of_tolerance)}" if len(ref) > 1 else "")
    return True, detail


def _mismatch(label: str, a: Any, b: Any) -> str | None:
    """Why plain ``a`` and grafted ``b`` cannot be compared value for value, or None."""
    for side, t in (("plain", a), ("grafted", b)):
        if not isinstance(t, torch.Tensor):
            return f"`{label}`: expected a tensor from the {side} model, received `{type(t).__name__}`"
    if a.shape != b.shape:
        return f"`{label}`: expected shape {tuple(a.shape)}, received {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return f"`{label}`: expected dtype {a.dtype}, received {b.dtype}"
    for t, bad in ((a, ~torch.isfinite(a)), (b, ~torch.isfinite(b))):
        if not bool(bad.any()):
            continue
        counts = [
            (int(torch.isnan(t).sum()), "NaN"),
            (int(torch.isposinf(t).sum()), "inf"),
            (int(torch.isneginf(t).sum()), "-inf"),
        ]
        found = ", ".join(f"{n} {kind}" for n, kind in counts if n)
        first = f"(first at index {tuple(int(i) for i in bad.nonzero()[0])})"
        if t is a:
            return (
                f"`{label}`: the plain model itself gives {found} {first}; a non-finite reference hides "
                "any difference, so nothing is vouched for (check the checkpoint's weights or try "
                "another `seed`)"
            )
        return f"`{label}`: {found} where the plain model is finite {first}"
    return None


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: unlike ``torch.equal``, a NaN equals the same NaN and ``-0.0`` differs from ``0.0``.

    Example:
        >>> nan = torch.tensor([float("nan")])
        >>> torch.equal(nan, nan), same_bits(nan, nan), same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
        (False, True, False)
    """
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.is_floating_point() or a.is_complex():
        a, b = (t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
    return torch.equal(a, b)
