"""fuse_linears: fusing sibling ``nn.Linear`` layers into one, and the stand-ins that serve the parts.

Unit tests of ``modelgraft.grafts._fused`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modelgraft.grafts import FusionError
from modelgraft.grafts._fused import fuse_linears


def test_a_weight_updated_between_calls_is_never_served_from_a_stale_cache() -> None:
    block = nn.Module()
    block.a, block.b = nn.Linear(4, 3), nn.Linear(4, 2)
    fuse_linears(block, ("a", "b"), "ab")
    x = torch.randn(5, 4)
    with torch.no_grad():
        block.a(x)  # computes and caches both parts
        block.ab.weight.add_(1.0)  # an optimizer step in between
        fresh = nn.functional.linear(x, block.ab.weight[3:], block.ab.bias[3:])
        torch.testing.assert_close(block.b(x), fresh)
        # a new input of the same shape is computed, not served from the cache
        y = torch.randn(5, 4)
        torch.testing.assert_close(
            block.a(y), nn.functional.linear(y, block.ab.weight[:3], block.ab.bias[:3])
        )
        # asking for the same part twice is fine
        torch.testing.assert_close(block.a(y), block.a(y))


def test_stand_ins_follow_a_quantizer_that_swaps_the_fused_layer() -> None:
    block = nn.Module()
    block.a, block.b = nn.Linear(4, 3, bias=False), nn.Linear(4, 2, bias=False)
    fuse_linears(block, ("a", "b"), "ab")

    class Doubling(nn.Module):
        def __init__(self, inner: nn.Linear) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * self.inner(x)

    block.ab = Doubling(block.ab)
    x = torch.randn(2, 4)
    torch.testing.assert_close(block.b(x), 2 * (x @ block.ab.inner.weight[3:].T))


@pytest.mark.parametrize(
    ("a", "b", "message"),
    [
        (nn.Linear(4, 3), nn.Linear(4, 2, bias=False), r"only some of `a`, `b` have a bias"),
        (nn.Linear(4, 3), nn.Linear(5, 2), r"take inputs of different widths \[4, 5\]"),
        (nn.Linear(4, 3), nn.Conv1d(4, 2, 1), r"`Module.b` must be an `nn.Linear`.*found `Conv1d`"),
    ],
)
def test_fusing_incompatible_layers_is_refused(a: nn.Module, b: nn.Module, message: str) -> None:
    block = nn.Module()
    block.a, block.b = a, b
    with pytest.raises(FusionError, match=message):
        fuse_linears(block, ("a", "b"), "ab")
    assert isinstance(block.a, nn.Linear)  # nothing changed
