"""Fused QKV attention: one ``qkv_proj`` instead of ``q_proj``, ``k_proj`` and ``v_proj``.

For every attention class of the chosen families, :func:`fused_qkv_class` builds a subclass whose
``__init__`` runs the original one and then fuses the three projections (see
:mod:`modelgraft.grafts._fused`): the family's own forward runs unchanged, so grouped-query
attention (q, k and v of different widths), q/k/v biases (Qwen2) and q/k norms (Qwen3, OLMo 2)
work as they are. The checkpoint conversion is ``Concatenate(dim=0)`` of q, k and v, whose exact
reverse writes the original, unequal-size tensors back on save.

Example:
    >>> import torch
    >>> from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention
    >>> from modelgraft.testing import tiny_config
    >>> attn = fused_qkv_class(Qwen3Attention)(tiny_config("qwen3"), layer_idx=0)
    >>> type(attn).__name__, tuple(attn.qkv_proj.weight.shape)  # q: 4 heads of 16, k and v: 2 heads each
    ('FusedQKVQwen3Attention', (128, 64))
    >>> sorted(name for name, _ in attn.named_parameters())
    ['k_norm.weight', 'o_proj.weight', 'q_norm.weight', 'qkv_proj.weight']
"""

from __future__ import annotations

from torch import nn

from modelgraft._families import FUSED_QKV, covered_by
from modelgraft.grafts._common import Graft, _Part, fused_linears_part
from modelgraft.grafts._fused import fused_subclass

__all__ = ["FUSED_QKV_FAMILIES", "QKV_NAMES", "fused_qkv", "fused_qkv_class"]

QKV_NAMES = ("q_proj", "k_proj", "v_proj")
FUSED_NAME = "qkv_proj"

#: Model types :func:`fused_qkv` covers by default (each one tested for equal logits and an exact
#: save round trip).
FUSED_QKV_FAMILIES: tuple[str, ...] = covered_by(FUSED_QKV)


def fused_qkv_class(attention_class: type[nn.Module]) -> type[nn.Module]:
    """Return the fused-QKV subclass of ``attention_class`` (the same class on every call)."""
    return fused_subclass(attention_class, QKV_NAMES, FUSED_NAME, "FusedQKV")


def _part(model_type: str) -> _Part:
    return fused_linears_part(
        model_type, QKV_NAMES, FUSED_NAME, fused_qkv_class, ("attention", "fused QKV", FUSED_QKV_FAMILIES)
    )


def fused_qkv(*model_types: str) -> Graft:
    """The fused QKV graft for ``model_types`` (default: :data:`FUSED_QKV_FAMILIES`).

    Args:
        *model_types: transformers model types; the attention classes are found by building each
            model on the meta device.

    Returns:
        A :class:`~modelgraft.grafts.Graft`; its mapping and conversions are computed on first use.

    Example:
        >>> fused_qkv("qwen2").conversions["qwen2"][0].target_patterns
        ('self_attn.qkv_proj',)
    """
    return Graft.of("fused QKV", model_types, FUSED_QKV_FAMILIES, _part)
