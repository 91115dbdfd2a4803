"""All-zero rows in an engine's routes: a token the engine did not capture, unless the caller says not.

vLLM and SGLang copy the routes of each token out of a capture buffer; a token whose routes were not
written there (a capture gap) comes back as a row of zeros in an MoE layer that is otherwise
captured. With top-k > 1 that row names expert 0 k times, which no router selects (a token's experts
are distinct). With top-1 it is the same as a real choice of expert 0, so only the caller can say
which it is. The policies (``zero_rows`` of ``from_vllm``/``from_sglang``):

* ``"refuse"`` (default): an error naming the request, token and layer;
* ``"live"``: the row becomes ``-1`` (no route), so ``replay_routing`` lets the trainer's router
  choose that token, as ``missing="live"`` does for the engine's own ``-1`` rows;
* ``"accept"``: the zeros are real choices of expert 0 (top-1 only).

Example:
    >>> import torch
    >>> rows = torch.tensor([[[3, 1]], [[0, 0]]])  # 2 tokens, 1 MoE layer, top-2
    >>> handle_zero_rows(rows, "request 0", [1], "live").tolist()
    [[[3, 1]], [[-1, -1]]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from modelgraft.errors import RoutingError

__all__ = ["ZERO_ROW_POLICIES", "check_zero_rows_policy", "handle_zero_rows"]

ZERO_ROW_POLICIES = ("refuse", "live", "accept")


def check_zero_rows_policy(policy: str) -> None:
    if policy not in ZERO_ROW_POLICIES:
        raise RoutingError(f"`zero_rows` must be 'refuse', 'live' or 'accept'; got {policy!r}.")


def handle_zero_rows(
    rows: torch.Tensor,
    where: str,
    layer_ids: Sequence[int],
    policy: str,
    exempt: torch.Tensor | None = None,
) -> torch.Tensor:
    """``rows`` (``(tokens, moe_layers, top_k)``) with its all-zero rows handled by ``policy``.

    Args:
        exempt: per MoE layer, ``True`` where all-zero rows are left as sent (a layer the caller
            declared real with ``allow_all_zero``).

    Raises:
        RoutingError: an all-zero row under ``"refuse"``, or under ``"accept"`` with top-k > 1.
    """
    if (policy == "accept" and rows.shape[-1] == 1) or not rows.numel():
        return rows
    zero = (rows == 0).all(-1)  # (tokens, layers)
    if exempt is not None:
        zero &= ~exempt
    if not bool(zero.any()):
        return rows
    if policy == "live":
        out = rows.clone()
        out[zero] = -1
        return out
    token, layer = (int(i) for i in zero.nonzero()[0])
    top_k = rows.shape[-1]
    count = int(zero.sum())
    place = (
        f"{where.capitalize()} routes token {token} of decoder layer `{layer_ids[layer]}` to "
        f"{rows[token, layer].tolist()}" + (f" ({count} such rows in all)" if count > 1 else "")
    )
    live = "Pass `zero_rows='live'` to let the trainer's router choose these tokens (every other row is replayed)"
    if top_k > 1 and policy == "accept":
        raise RoutingError(
            f"{place}: `zero_rows='accept'` takes an all-zero row as a real choice of expert 0, which only top-1 "
            f"routing can make; a top-{top_k} router selects {top_k} distinct experts. {live}, or recapture."
        )
    if top_k > 1:
        raise RoutingError(
            f"{place}: a top-{top_k} router selects {top_k} distinct experts, so this row is not a routing: it "
            "looks like a capture gap (the engine did not write this token's routes), not an error in your data. "
            f"{live}, or recapture."
        )
    raise RoutingError(
        f"{place}: with top-1 routing a 0 is either expert 0 or a token the engine did not capture (a "
        "capture gap), and the routes cannot tell which. Pass `zero_rows='accept'` if the engine captured every "
        f"token (the zeros are expert 0); {live[0].lower() + live[1:]}."
    )
