"""split_linear (the per-part matmuls of fused layers) and when the fused stand-ins use it.

Unit tests of ``modelgraft.grafts._split_linear`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from modelgraft.grafts import _fused
from modelgraft.grafts._fused import fuse_linears
from modelgraft.grafts._split_linear import split_linear

SIZES = (6, 2, 2)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    return F.linear(x, weight, bias).split(SIZES, dim=-1)


def _leaves(bias: bool, x_grad: bool = True, w_grad: bool = True) -> list[torch.Tensor | None]:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, requires_grad=x_grad)
    weight = torch.randn(sum(SIZES), 4, requires_grad=w_grad)
    b = torch.randn(sum(SIZES), requires_grad=True) if bias else None
    return [x, weight, b]


def _grads(fn, leaves: list[torch.Tensor | None], used: tuple[int, ...]) -> list[torch.Tensor | None]:
    """Gradients of a fixed weighted sum of the parts in ``used``, for each leaf (None if none)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
    parts = fn(*leaves)
    torch.manual_seed(1)
    loss = sum((parts[i] * torch.randn_like(parts[i])).sum() for i in used)
    loss.backward()
    return [None if t is None else t.grad for t in leaves]


@pytest.mark.parametrize("bias", [False, True])
def test_parts_are_the_separate_layers_outputs_bit_for_bit(bias: bool) -> None:
    x, weight, b = _leaves(bias)
    parts = split_linear(x, weight, b, SIZES)
    offsets = (0, 6, 8, 10)
    for i, part in enumerate(parts):
        rows = slice(offsets[i], offsets[i + 1])
        assert part.is_contiguous()
        assert torch.equal(part, F.linear(x, weight[rows], None if b is None else b[rows]))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("used", [(0, 1, 2), (0, 2), (1,)], ids=["all", "no-k", "only-k"])
def test_gradients_match_linear_then_split(bias: bool, used: tuple[int, ...]) -> None:
    # Parts left out of the loss reach the backward as None, not as zeros.
    leaves = _leaves(bias)
    expected = _grads(_reference, leaves, used)
    got = _grads(lambda x, w, b: split_linear(x, w, b, SIZES), leaves, used)
    for g, e in zip(got, expected, strict=True):
        assert (g is None) == (e is None)
        if e is not None:
            torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("x_grad", "w_grad"), [(False, True), (True, False)])
def test_only_leaves_that_require_grad_get_one(x_grad: bool, w_grad: bool) -> None:
    leaves = _leaves(bias=False, x_grad=x_grad, w_grad=w_grad)
    expected = _grads(_reference, leaves, (0, 1, 2))
    got = _grads(lambda x, w, b: split_linear(x, w, b, SIZES), leaves, (0, 1, 2))
    assert (got[0] is None) == (not x_grad) and (got[1] is None) == (not w_grad)
    for g, e in zip(got, expected, strict=True):
        if e is not None:
            torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)


def test_backward_passes_gradcheck_in_double_precision() -> None:
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(sum(SIZES), 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(sum(SIZES), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: split_linear(*t, SIZES), (x, weight, bias))


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_without_autograd_no_graph_is_built(mode) -> None:
    x, weight, b = _leaves(bias=True)
    with mode():
        parts = split_linear(x, weight, b, SIZES)
    assert all(p.grad_fn is None and not p.requires_grad for p in parts)
    for part, ref in zip(parts, _reference(x, weight, b), strict=True):
        torch.testing.assert_close(part, ref.detach())


# --- the fused stand-ins ------------------------------------------------------------------------


def _block(bias: bool = True) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = nn.Module()
    plain.q, plain.k, plain.v = (nn.Linear(4, n, bias=bias) for n in SIZES)
    fused = copy.deepcopy(plain)
    fuse_linears(fused, ("q", "k", "v"), "qkv")
    return plain, fused


def _run(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (block.q(x).sum(-1, keepdim=True) * block.k(x) + block.v(x)).pow(2).sum()


def test_fused_weight_gradient_is_the_concatenated_plain_gradients() -> None:
    plain, fused = _block()
    x = torch.randn(2, 5, 4)
    _run(plain, x).backward()
    _run(fused, x).backward()
    weight = torch.cat([plain.q.weight.grad, plain.k.weight.grad, plain.v.weight.grad])
    bias = torch.cat([plain.q.bias.grad, plain.k.bias.grad, plain.v.bias.grad])
    torch.testing.assert_close(fused.qkv.weight.grad, weight, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fused.qkv.bias.grad, bias, atol=1e-6, rtol=1e-5)


def test_stand_ins_use_split_linear_only_for_an_untouched_linear() -> None:
    _, fused = _block()
    x = torch.randn(2, 4)
    assert _fused._plain_linear(fused.qkv, x)
    seen = []
    handle = fused.qkv.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    assert not _fused._plain_linear(fused.qkv, x)
    fused.q(x)  # the hook runs: the stand-ins called the fused module
    assert seen == [torch.Size([2, 10])]
    handle.remove()
    fused.qkv.forward = lambda t: F.linear(t, fused.qkv.weight, fused.qkv.bias)  # accelerate-style wrap
    assert not _fused._plain_linear(fused.qkv, x)


def test_autocast_runs_through_the_fused_module_and_still_differentiates() -> None:
    plain, fused = _block()
    x = torch.randn(2, 5, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _fused._plain_linear(fused.qkv, x)
        out = fused.q(x)
        assert out.dtype == torch.bfloat16
        _run(plain, x).float().backward()
        _run(fused, x).float().backward()
    expected = torch.cat([plain.q.weight.grad, plain.k.weight.grad, plain.v.weight.grad])
    torch.testing.assert_close(fused.qkv.weight.grad, expected, atol=0.5, rtol=0.05)


def test_torch_func_transforms_run_through_the_fused_module() -> None:
    # torch.func refuses autograd functions without a vmap rule: the stand-ins must not use one there.
    plain, fused = _block()
    x = torch.randn(3, 4)

    def per_sample(block: nn.Module) -> torch.Tensor:
        return torch.func.vmap(torch.func.grad(lambda xi: _run(block, xi[None])))(x)

    torch.testing.assert_close(per_sample(fused), per_sample(plain), atol=1e-5, rtol=1e-5)
    expected = torch.func.grad(lambda t: _run(plain, t))(x)
    torch.testing.assert_close(torch.func.grad(lambda t: _run(fused, t))(x), expected, atol=1e-5, rtol=1e-5)


def test_double_backward_is_supported() -> None:
    # create_graph=True (gradient penalties, Hessian-vector products) differentiates the backward.
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(sum(SIZES), 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(sum(SIZES), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda *t: split_linear(*t, SIZES), (x, weight, bias))
    # a part left out of the loss is a None gradient there too
    assert torch.autograd.gradgradcheck(lambda *t: split_linear(*t, SIZES)[0].tanh(), (x, weight, bias))
