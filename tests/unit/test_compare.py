"""compare_outputs: the output comparison behind ``verify``'s ``logits_match`` and ``hidden_states_match``.

Unit tests of ``modelgraft._compare`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14). ``verify``'s own checks are tested in
tests/integration/test_verify.py.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modelgraft._compare import compare_outputs

NAN, INF = float("nan"), float("inf")

_FLOAT = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(_FLOAT, min_size=1, max_size=24),
    where=st.lists(st.tuples(st.integers(0, 23), st.sampled_from([NAN, INF, -INF])), max_size=3),
    in_reference=st.booleans(),
    atol=st.sampled_from([0.0, 1e-5, 1.0, 1e30]),
)
def test_compare_is_never_fooled_by_non_finite_values(
    values: list[float], where: list[tuple[int, float]], in_reference: bool, atol: float
) -> None:
    """The output comparison itself: any non-finite value fails and is named; else only finite diffs pass."""
    ref = torch.tensor(values, dtype=torch.float32)
    got = ref.clone()
    hit = sorted({i % len(values) for i, _ in where})
    for i, value in where:
        (ref if in_reference else got)[i % len(values)] = value
    passed, detail = compare_outputs(["logits"], [ref], [got], atol, 0.0)
    if not hit:
        assert passed and "max |diff| 0.00e+00" in detail
        return
    assert passed is False
    assert detail.startswith("`logits`: ")
    assert f"first at index ({hit[0]},)" in detail
    side = "the plain model itself gives" if in_reference else "where the plain model is finite"
    assert side in detail
