"""The forward of per-expert ``nn.Linear`` experts, by transformers' ``experts_implementation``.

transformers 5 runs its fused experts with the kernel named by ``config._experts_implementation``
(``"grouped_mm"`` by default, ``"eager"``, ``"batched_mm"``, ...). The experts of
:func:`~modelgraft.grafts.linear_experts` honour the two that per-expert layers can run exactly:

* ``"eager"``: transformers' eager loop (one expert at a time, tokens found with ``where``), in
  the same visiting order, so sums are the eager plain model's.
* ``"grouped_mm"`` (and no setting): the token-expert pairs are sorted by expert once. When
  every expert layer is a plain ``nn.Linear`` (exact class and weight types, no instance
  ``forward``, hooks, extra parameters or buffers: ``LinearExpertsBase._plain_layers``, so
  that stacking computes exactly what the layers' own forwards do) and torch has a grouped matmul for the device and
  dtype, the experts' weights are stacked (one copy; the backward hands each layer its own
  gradient) and each projection is ONE ``grouped_mm`` over the sorted pairs, as in the plain
  model; biases (GPT-OSS) are added per sorted row and a family's own gated activation
  (GPT-OSS's clamped SwiGLU) runs on the gate and up outputs, as transformers' kernel does.
  Otherwise (a LoRA wrapper, a quantized layer or weight, a hooked layer), each active expert module
  runs once over its contiguous slice of sorted pairs, so wrappers see their inputs as on any
  ``nn.Linear``. The weighted outputs are summed per token in top-k order, as the plain model does.

Any other implementation (``"batched_mm"``, kernels registered by users or quantizers) is
refused with :class:`ExpertsImplementationError` when the experts are built and when they run:
it would compute with fused 3D weights the grafted experts no longer have.

Example:
    >>> import torch
    >>> from torch import nn
    >>> experts = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(3))
    >>> x, ids = torch.randn(5, 4), torch.tensor([[0, 2], [1, 2], [2, 0], [1, 1], [0, 1]])
    >>> w = torch.rand(5, 2)
    >>> out = sorted_forward(lambda e, h: experts[e](h), 3, x, ids, w)
    >>> expected = eager_forward(lambda e, h: experts[e](h), 3, x, ids, w)
    >>> out.shape, bool(torch.allclose(out, expected, atol=1e-6))
    (torch.Size([5, 4]), True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from modelgraft.errors import ExpertsImplementationError  # defined there with every error; this path kept

__all__ = [
    "EXPERTS_IMPLEMENTATIONS",
    "ExpertsImplementationError",
    "check_implementation",
    "eager_forward",
    "grouped_linear_forward",
    "sorted_forward",
]

#: The ``experts_implementation`` values per-expert layers run exactly (``None``: not set).
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager")


def check_implementation(module: nn.Module) -> str:
    """The implementation ``module`` runs: its config's ``_experts_implementation``, or ``"grouped_mm"``.

    Raises:
        ExpertsImplementationError: the config asks for an implementation other than
            :data:`EXPERTS_IMPLEMENTATIONS`.

    Example:
        >>> from types import SimpleNamespace
        >>> module = nn.Module()
        >>> module.config = SimpleNamespace(_experts_implementation="eager")
        >>> check_implementation(module), check_implementation(nn.Module())
        ('eager', 'grouped_mm')
    """
    requested = getattr(module.__dict__.get("config"), "_experts_implementation", None)
    if requested is None:
        return "grouped_mm"
    if requested not in EXPERTS_IMPLEMENTATIONS:
        raise ExpertsImplementationError(
            f"`{type(module).__name__}` cannot run `experts_implementation={requested!r}`: its experts are "
            f"per-expert `nn.Linear` layers, and `{requested}` computes with fused 3D expert weights that they no "
            "longer have. Expected one of "
            f"{', '.join(repr(i) for i in EXPERTS_IMPLEMENTATIONS)}: load with "
            '`experts_implementation="grouped_mm"` (or call `model.set_experts_implementation("grouped_mm")`), '
            "or load the model without the `linear_experts` graft."
        )
    return str(requested)


def eager_forward(
    run: Callable[[int, torch.Tensor], torch.Tensor],
    num_experts: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' eager experts loop, calling ``run(expert_id, tokens)`` per hit expert."""
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        hit = torch.unique(top_k_index).tolist()
    for expert_id in hit:
        if not 0 <= expert_id < num_experts:
            continue  # the expert-parallel sentinel: another rank holds this expert
        # Same visiting order as transformers (by top-k slot, then token) so sums match.
        k_pos, token_idx = torch.where((top_k_index == expert_id).T)
        current = run(expert_id, hidden_states[token_idx]) * top_k_weights[token_idx, k_pos, None]
        out.index_add_(0, token_idx, current.to(out.dtype))
    return out


def _sort_pairs(num_experts: int, top_k_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-expert pairs sorted by expert: (permutation, pairs per expert)."""
    expert_ids = top_k_index.reshape(-1)
    valid = (expert_ids >= 0) & (expert_ids < num_experts)
    # Out-of-range ids (the expert-parallel sentinel) sort past every real expert and are skipped.
    keys = torch.where(valid, expert_ids, torch.full_like(expert_ids, num_experts))
    sorted_ids, perm = torch.sort(keys, stable=True)
    counts = torch.bincount(sorted_ids, minlength=num_experts + 1)[:num_experts]
    return perm, counts


def _combine(
    sorted_out: torch.Tensor,
    perm: torch.Tensor,
    top_k_weights: torch.Tensor,
    hidden_states: torch.Tensor,
) -> torch.Tensor:
    """Weight the sorted outputs, put them back in (token, top-k slot) order and sum the slots."""
    num_tokens, top_k = top_k_weights.shape
    rows = sorted_out.shape[0]  # the valid pairs; sentinel pairs (sorted last) produced nothing
    weights = top_k_weights.reshape(-1)[perm[:rows], None]
    # Weights in their own dtype (a float32 router with bf16 experts), promoted as in transformers.
    weighted = sorted_out * weights
    pairs = weighted.new_zeros(num_tokens * top_k, sorted_out.shape[-1])
    # Sentinel pairs stay zero.
    pairs = pairs.index_copy(0, perm[:rows], weighted)
    # Summing over the top-k slots in order, as transformers' grouped kernel does.
    return pairs.view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def sorted_forward(
    run: Callable[[int, torch.Tensor], torch.Tensor],
    num_experts: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Sort the pairs by expert once, run each active expert on its contiguous slice, sum back."""
    top_k = top_k_index.shape[-1]
    perm, counts = _sort_pairs(num_experts, top_k_index)
    rows = int(counts.sum())
    sorted_tokens = hidden_states[perm[:rows] // top_k]
    outputs, start = [], 0
    for expert_id, count in enumerate(counts.tolist()):
        if count:
            outputs.append(run(expert_id, sorted_tokens[start : start + count]))
            start += count
    if not outputs:
        return torch.zeros_like(hidden_states)
    return _combine(torch.cat(outputs), perm, top_k_weights, hidden_states)


def _grouped_mm() -> Callable[..., torch.Tensor] | None:
    found = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return found


def grouped_linear_forward(
    layers: Sequence[tuple[nn.Linear, nn.Linear, nn.Linear]],
    act_fn: Callable[[torch.Tensor], torch.Tensor] | None,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """One grouped matmul per projection over the sorted pairs; ``None`` where torch has none for
    this device and dtype (the caller then runs :func:`sorted_forward`).

    ``act_fn(gate) * up`` is the gated activation, or ``gate(gate_out, up_out)`` when given (a
    family's own). Layers with biases (all or none) have them added to each sorted row.
    """
    grouped_mm = _grouped_mm()
    if grouped_mm is None or torch.compiler.is_compiling():
        return None
    num_experts, top_k = len(layers), top_k_index.shape[-1]
    perm, counts = _sort_pairs(num_experts, top_k_index)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    rows = int(offsets[-1]) if num_experts else 0
    weight = layers[0][0].weight
    tokens = hidden_states[perm[:rows] // top_k].to(weight.dtype)
    # (E, 2I, H): gate rows then up rows of each expert, the fused layout, in one copy.
    stacked = torch.stack([w.weight for g, u, _ in layers for w in (g, u)])
    gate_up = stacked.unflatten(0, (num_experts, 2))  # type: ignore[no-untyped-call]  # untyped in torch
    gate_up = gate_up.flatten(1, 2)
    down = torch.stack([d.weight for _, _, d in layers])
    biased = layers[0][0].bias is not None
    if biased:
        # Each sorted row's expert, to add that expert's biases (as transformers' kernel does).
        row_experts = torch.repeat_interleave(torch.arange(num_experts, device=counts.device), counts)
        gate_up_bias = torch.stack([torch.cat([g.bias, u.bias]) for g, u, _ in layers])[row_experts]
        down_bias = torch.stack([d.bias for _, _, d in layers])[row_experts]
    try:
        projected = grouped_mm(tokens, gate_up.transpose(-2, -1), offs=offsets)
        if biased:
            projected = projected + gate_up_bias
        gate_out, up_out = projected.chunk(2, dim=-1)
        activated = gate(gate_out, up_out) if gate is not None else act_fn(gate_out) * up_out  # type: ignore[misc]
        sorted_out = grouped_mm(activated, down.transpose(-2, -1), offs=offsets)
        if biased:
            sorted_out = sorted_out + down_bias
    except (RuntimeError, NotImplementedError):
        # No kernel for this device, dtype or alignment (CPU needs 16-byte strides): nothing was
        # changed, and the caller runs the sorted loop.
        return None
    return _combine(sorted_out, perm, top_k_weights, hidden_states)
