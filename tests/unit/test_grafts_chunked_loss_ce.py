"""The chunked linear cross-entropy against the plain computation, and its gradients numerically.

The reference is what transformers does: ``F.linear``, the family's logit transform in the logits'
dtype, ``float()``, ``cross_entropy`` with ``ignore_index`` and either ``mean`` or ``sum`` divided by
``num_items_in_batch``.

Unit tests of ``modelgraft.grafts._chunked_ce`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from modelgraft import GraftError
from modelgraft.grafts import DoubleBackwardError, LossInputError
from modelgraft.grafts._chunked_ce import LogitTransform, default_chunk_size, linear_cross_entropy

TRANSFORMS = [
    pytest.param(LogitTransform(), id="none"),
    pytest.param(LogitTransform("mul", 0.0625), id="mul-scale"),
    pytest.param(LogitTransform("div", 8.0), id="div-scale"),
    pytest.param(LogitTransform(softcap=1.5), id="softcap"),
    pytest.param(LogitTransform("mul", 1.7, 2.0), id="scale-and-softcap"),
]


def _reference(
    hidden, weight, bias, targets, transform, num_items=None, ignore_index=-100, dtype=torch.float32
):
    logits, _ = transform.apply(F.linear(hidden, weight, bias))
    logits = logits.to(dtype)
    if num_items is None:
        return F.cross_entropy(logits, targets, ignore_index=ignore_index)
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum") / num_items


def _inputs(tokens=13, hidden=8, vocab=40, dtype=torch.float32, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=generator, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=generator, dtype=dtype) * 2).requires_grad_()
    b = torch.randn(vocab, generator=generator, dtype=dtype).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    targets[[1, 6]] = -100
    return h, w, b, targets


def _grads(loss, params):
    return torch.autograd.grad(loss, [p for p in params if p is not None])


def _assert_same(actual, expected, atol=1e-6, rtol=1e-5):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(actual.isfinite(), expected.isfinite())
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("num_items", [None, 7, torch.tensor(19)], ids=["mean", "int-items", "tensor-items"])
@pytest.mark.parametrize("chunk", [1, 4, 13, 100])
def test_loss_and_gradients_equal_the_plain_computation(transform, num_items, chunk) -> None:
    h, w, b, targets = _inputs()
    expected = _reference(h, w, b, targets, transform, num_items)
    loss = linear_cross_entropy(
        h, w, b, targets, num_items_in_batch=num_items, transform=transform, chunk_size=chunk
    )
    _assert_same(loss, expected)
    for got, want in zip(_grads(loss, (h, w, b)), _grads(expected, (h, w, b)), strict=True):
        _assert_same(got, want)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gradcheck_in_float64(transform) -> None:
    h, w, b, targets = _inputs(tokens=7, hidden=4, vocab=11, dtype=torch.float64)

    def loss(hidden, weight, bias):
        return linear_cross_entropy(
            hidden, weight, bias, targets, transform=transform, chunk_size=3, loss_dtype=torch.float64
        )

    assert torch.autograd.gradcheck(loss, (h, w, b))
    assert torch.autograd.gradcheck(
        lambda hidden, weight: linear_cross_entropy(
            hidden, weight, None, targets, num_items_in_batch=5, chunk_size=2, loss_dtype=torch.float64
        ),
        (h, w),
    )


def test_ignored_rows_do_not_count_and_get_zero_gradient() -> None:
    h, w, b, targets = _inputs()
    loss = linear_cross_entropy(h, w, b, targets, chunk_size=4)
    grad_h = torch.autograd.grad(loss, h)[0]
    assert torch.count_nonzero(grad_h[[1, 6]]) == 0
    assert torch.count_nonzero(grad_h[0]) > 0
    kept = targets != -100
    only_counted = F.cross_entropy(F.linear(h[kept], w, b), targets[kept])
    torch.testing.assert_close(loss, only_counted, atol=1e-6, rtol=1e-6)


def test_custom_ignore_index() -> None:
    h, w, b, targets = _inputs()
    targets = torch.where(targets == -100, 3, targets)
    targets[[0, 5]] = 3
    expected = _reference(h, w, b, targets, LogitTransform(), ignore_index=3)
    _assert_same(linear_cross_entropy(h, w, b, targets, ignore_index=3, chunk_size=5), expected)


def test_every_row_ignored_gives_nan_loss_and_zero_gradients_like_plain() -> None:
    h, w, b, _ = _inputs()
    targets = torch.full((h.shape[0],), -100)
    expected = _reference(h, w, b, targets, LogitTransform())
    loss = linear_cross_entropy(h, w, b, targets, chunk_size=4)
    assert expected.isnan() and loss.isnan()
    for got, want in zip(_grads(loss, (h, w, b)), _grads(expected, (h, w, b)), strict=True):
        assert torch.equal(want, torch.zeros_like(want))
        assert torch.equal(got, want)


def test_every_row_ignored_with_num_items_gives_zero_like_plain() -> None:
    h, w, b, _ = _inputs()
    targets = torch.full((h.shape[0],), -100)
    expected = _reference(h, w, b, targets, LogitTransform(), num_items=4)
    loss = linear_cross_entropy(h, w, b, targets, num_items_in_batch=4, chunk_size=4)
    assert expected.item() == 0.0 and loss.item() == 0.0
    for got in _grads(loss, (h, w, b)):
        assert torch.count_nonzero(got) == 0


def test_backward_scales_by_the_incoming_gradient() -> None:
    h, w, b, targets = _inputs()
    expected = _reference(h, w, b, targets, LogitTransform()) * -2.5
    loss = linear_cross_entropy(h, w, b, targets, chunk_size=3) * -2.5
    for got, want in zip(_grads(loss, (h, w, b)), _grads(expected, (h, w, b)), strict=True):
        _assert_same(got, want)


def test_weight_without_grad_gets_none_and_hidden_still_matches() -> None:
    h, w, _, targets = _inputs(bias=False)
    w.requires_grad_(False)
    expected = _reference(h, w, None, targets, LogitTransform())
    linear_cross_entropy(h, w, None, targets, chunk_size=5).backward()
    assert w.grad is None
    _assert_same(h.grad, torch.autograd.grad(expected, h)[0])


def test_without_grad_it_returns_the_loss_only() -> None:
    h, w, b, targets = _inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, b, targets, chunk_size=4)
        expected = _reference(h, w, b, targets, LogitTransform())
    assert not loss.requires_grad
    _assert_same(loss, expected)


def test_create_graph_backward_is_refused_not_silently_zero() -> None:
    h, w, b, targets = _inputs()
    loss = linear_cross_entropy(h, w, b, targets, chunk_size=4)
    with pytest.raises(DoubleBackwardError, match=r"does not support `create_graph=True`") as caught:
        torch.autograd.grad(loss, h, create_graph=True)
    assert isinstance(caught.value, RuntimeError)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weights_stay_as_close_to_float64_as_plain(dtype) -> None:
    """Plain rounds logits and products to the low dtype; the chunked loss rounds the same steps
    (plus one rounding per chunk of the weight gradient, summed in float32)."""
    h64, w64, b64, targets = _inputs(tokens=64, hidden=32, vocab=300, dtype=torch.float64)
    transform = LogitTransform(softcap=3.0)
    exact = _reference(h64, w64, b64, targets, transform, dtype=torch.float64)
    exact_grads = _grads(exact, (h64, w64, b64))
    low = [t.detach().to(dtype).requires_grad_() for t in (h64, w64, b64)]
    plain = _reference(*low, targets, transform)
    chunked = linear_cross_entropy(*low, targets, transform=transform, chunk_size=16)
    assert chunked.dtype == plain.dtype == torch.float32
    assert abs(chunked.double() - exact) <= 2 * abs(plain.double() - exact) + 1e-3
    for got, want, ref in zip(_grads(chunked, low), _grads(plain, low), exact_grads, strict=True):
        assert got.dtype == want.dtype == dtype and got.isfinite().all()
        err_chunked = (got.double() - ref).abs().max()
        err_plain = (want.double() - ref).abs().max()
        assert err_chunked <= 2 * err_plain + 1e-3, (err_chunked, err_plain)


def test_autocast_matches_plain_autocast() -> None:
    h, w, b, targets = _inputs(tokens=32, hidden=16, vocab=100)
    transform = LogitTransform(softcap=2.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = _reference(h, w, b, targets, transform)
        chunked = linear_cross_entropy(h, w, b, targets, transform=transform, chunk_size=8)
    assert chunked.dtype == plain.dtype == torch.float32
    torch.testing.assert_close(chunked, plain, atol=2e-2, rtol=1e-2)
    for got, want in zip(_grads(chunked, (h, w, b)), _grads(plain, (h, w, b)), strict=True):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_default_chunk_size_bounds_the_chunk_logits() -> None:
    assert default_chunk_size(65536) * 65536 == 1 << 25
    assert default_chunk_size(151936) == 220
    assert default_chunk_size(1 << 30) == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda h, w, t: (h, w, t[:-1]), r"one target per token: 13 tokens but targets of shape \(12,\)"),
        (lambda h, w, t: (h, w[:, :-1], t), r"`hidden` \(13, 8\) and `weight` \(40, 7\) do not fit"),
        (
            lambda h, w, t: (h, w, torch.where(t == 5, 40, t).index_fill(0, torch.tensor([2]), 40)),
            "Label 40 at",
        ),
        (lambda h, w, t: (h, w, t.index_fill(0, torch.tensor([3]), -7)), r"Label -7 at flattened position 3"),
        (lambda h, w, t: (h, w, t.float()), "integer token ids"),
    ],
    ids=["targets-length", "hidden-width", "label-too-large", "negative-label", "float-labels"],
)
def test_bad_input_is_a_clear_error(change, message) -> None:
    h, w, _, targets = _inputs()
    h, w, targets = change(h, w, targets)
    with pytest.raises(LossInputError, match=message) as caught:
        linear_cross_entropy(h, w, None, targets)
    assert isinstance(caught.value, GraftError) and isinstance(caught.value, ValueError)


def test_chunk_size_below_one_is_refused() -> None:
    h, w, _, targets = _inputs()
    with pytest.raises(LossInputError, match="`chunk_size` must be at least 1; received 0"):
        linear_cross_entropy(h, w, None, targets, chunk_size=0)
