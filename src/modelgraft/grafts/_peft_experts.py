"""Expert LoRA between per-expert layers (``linear_experts``) and PEFT's fused 3D layout.

On transformers 5 the plain model keeps an MoE layer's experts as 3D parameters
(``gate_up_proj`` ``(E, 2I, H)``, ``down_proj`` ``(E, H, I)``), and PEFT adapts them with
``target_parameters``: one LoRA pair per parameter, ``lora_A`` ``(R * E, in)`` holding expert
``e``'s rows at ``e * R`` and ``lora_B`` ``(out, R * E)`` holding them at columns ``k * E + e``,
nested on the experts module in the order the parameters were registered (the first one
innermost, under ``base_layer``). A model grafted with ``linear_experts`` has per-expert
``nn.Linear`` layers instead, each with its own LoRA pair.

The two carry the same update exactly:

* gate and up of one expert fuse as ``A = [A_gate; A_up]`` and ``B = blockdiag(B_gate, B_up)``
  (rank ``r_gate + r_up``, the same scaling), and split back bit for bit;
* a fused ``gate_up`` pair of rank ``R`` trained on the plain model splits into per-expert gate
  and up pairs of rank ``R`` each (``A`` shared, ``B`` cut in its gate and up rows);
* ``down`` is the same pair in either layout.

The storage of the 3D parameters does not change the pairs (``lora_A`` always reads the input,
``lora_B`` writes the output), except for interleaved gate and up rows (GPT-OSS), which
interleave the rows of ``B`` the same way. Experts with no such parameters (DBRX's 2D stacks)
are refused, naming the layer.

Example:
    >>> import torch
    >>> a_g, a_u = torch.randn(2, 4), torch.randn(2, 4)
    >>> b_g, b_u = torch.randn(3, 2), torch.randn(3, 2)
    >>> a, b = fuse_gate_up([(a_g, b_g)], [(a_u, b_u)], inter=3)
    >>> a.shape, b.shape
    (torch.Size([4, 4]), torch.Size([6, 4]))
    >>> (g, u), = split_gate_up(a, b, num=1, inter=3, gate_rank=2, up_rank=2, where="x")
    >>> all(torch.equal(x, y) for x, y in zip(g + u, (a_g, b_g, a_u, b_u)))
    True
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from modelgraft.errors import ExpertsAdapterError

__all__ = [
    "FUSED_NAMES",
    "ExpertSite",
    "Pair",
    "fuse_down",
    "fuse_gate_up",
    "fused_alpha",
    "lora_scaling",
    "rank_hint",
    "sites_of",
    "split_down",
    "split_gate_up",
    "swap_roles",
]

FUSED_NAMES = ("gate_up_proj", "down_proj")

Pair = tuple[torch.Tensor, torch.Tensor]  # (lora_A weight, lora_B weight) of one layer


@dataclass(frozen=True)
class ExpertSite:
    """One grafted experts list, and where the plain model keeps the same experts fused.

    Attributes:
        path: the module's name in the base model (``model.layers.0.mlp.experts``).
        names: the per-expert layer names, gate, up, down (``gate_proj``, ``w1``, ...).
        num, inter, hidden: E, I, H.
        fused_order: the plain class's 3D parameters in registration order; PEFT nests its
            wrappers in that order, the first innermost.
        interleaved: gate and up rows alternate in ``gate_up_proj`` (GPT-OSS).
        swapped: the parameters are stored transposed ``(E, in, out)`` without the flag that
            tells PEFT so (Llama 4; GPT-OSS on 4.57): PEFT then reads them as ``(E, out, in)``,
            and its ``A``/``B`` are the transposes of the linear layers' ``B``/``A``.
        problem: why this site cannot be translated (``None`` when it can).
    """

    path: str
    names: tuple[str, str, str]
    num: int
    inter: int
    hidden: int
    fused_order: tuple[str, ...]
    interleaved: bool
    swapped: bool
    problem: str | None

    def fused_key(self, fused: str) -> str:
        """Where PEFT keeps the LoRA pair of ``fused`` under this site (``experts`` or ``experts.base_layer``)."""
        wanted = [name for name in self.fused_order if name in FUSED_NAMES]
        depth = len(wanted) - 1 - wanted.index(fused)
        return ".".join([self.path, *["base_layer"] * depth])


def sites_of(model: nn.Module) -> list[ExpertSite]:
    """Every per-expert list grafted by ``linear_experts`` in ``model`` (a base model, not a PeftModel)."""
    found = []
    for path, module in model.named_modules():
        cls = type(module)
        original = getattr(cls, "_modelgraft_original", None)
        names = getattr(cls, "_expert_names", None)
        if not (isinstance(module, nn.ModuleList) and original is not None and names):
            continue
        # Experts without a config of their own (Llama 4) are built from the model's.
        config = getattr(module, "config", None) or getattr(model, "config", None)
        found.append(_site(path, module, original, tuple(names), config))
    return found


def _site(
    path: str, module: nn.ModuleList, original: type, names: tuple[str, str, str], config: object
) -> ExpertSite:
    num = len(module)
    inter = int(getattr(module, "intermediate_dim", 0))
    hidden = int(getattr(module, "hidden_dim", 0))
    order: tuple[str, ...] = ()
    probe = None
    layout = module.__dict__.get("_layout")  # set by linear_experts for 3D experts; None for 2D stacks
    if layout is not None:
        try:
            with torch.device("meta"):
                probe = original(config)  # the flags PEFT reads live on instances
        except Exception:  # a class not built from a config alone: no fused form known
            probe = None
        if probe is not None:
            order = tuple(name for name, _ in probe.named_parameters(recurse=False))
    problem = None
    if layout is None or not set(FUSED_NAMES) <= set(order):
        problem = f"`{original.__name__}` keeps no 3D `gate_up_proj`/`down_proj` for PEFT to adapt"
    interleaved = bool(getattr(layout, "interleaved", False))
    transposed = bool(getattr(layout, "transposed", False))
    swapped = transposed and probe is not None and not getattr(probe, "is_transposed", False)
    return ExpertSite(path, names, num, inter, hidden, order, interleaved, swapped, problem)


def lora_scaling(alpha: float, rank: int, rslora: bool) -> float:
    """PEFT's scaling of a LoRA pair."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def fused_alpha(scaling: float, rank: int, rslora: bool, where: str) -> float:
    """The alpha that gives a fused pair of ``rank`` exactly ``scaling``, or an error."""
    alpha = scaling * (math.sqrt(rank) if rslora else rank)
    if lora_scaling(alpha, rank, rslora) != scaling:
        raise ExpertsAdapterError(
            f"The LoRA scaling {scaling!r} of the experts at `{where}` has no exact alpha at the fused rank {rank} "
            f"(use_rslora={rslora}): the adapter cannot be written in the plain model's layout bit for bit. Use a "
            "rank and alpha whose ratio is a power of two, or merge the adapter and save the merged checkpoint."
        )
    return int(alpha) if float(alpha).is_integer() else alpha


def rank_hint(leaf: str, name: str) -> str:
    """A rank/alpha pattern key naming per-expert layers only (``experts\\.\\d+\\.gate_proj``).

    Written beside the fused pattern, it matches nothing in the plain model and gives the
    grafted model back the per-expert ranks, so the fused pair splits bit for bit.
    """
    return rf"{re.escape(leaf)}\.\d+\.{re.escape(name)}"


def fuse_gate_up(
    gate: list[Pair] | None, up: list[Pair] | None, inter: int, *, interleaved: bool = False
) -> Pair:
    """One ``gate_up`` pair (PEFT's 3D layout) from the per-expert gate and up pairs.

    Either side may be missing (its layer had no LoRA): its rows of ``B`` are zero.
    """
    parts = gate or up
    assert parts is not None
    num = len(parts)
    a_rows, b_cols = [], []
    for e in range(num):
        a_parts, blocks = [], []
        for side in (gate, up):
            if side is not None:
                a_parts.append(side[e][0])
                blocks.append(side[e][1])
        a_e = torch.cat(a_parts, dim=0)
        b_e = torch.block_diag(*blocks)  # type: ignore[no-untyped-call]
        if gate is None:  # the gate rows come first: an absent gate leaves zero rows on top
            b_e = torch.cat([b_e.new_zeros(inter, b_e.shape[1]), b_e], dim=0)
        elif up is None:
            b_e = torch.cat([b_e, b_e.new_zeros(inter, b_e.shape[1])], dim=0)
        if interleaved:
            b_e = torch.stack(b_e.chunk(2, dim=0), dim=1).reshape(2 * inter, -1)
        a_rows.append(a_e)
        b_cols.append(b_e)
    return _stack(a_rows, b_cols)


def fuse_down(down: list[Pair]) -> Pair:
    """One ``down`` pair (PEFT's 3D layout) from the per-expert down pairs."""
    return _stack([a for a, _ in down], [b for _, b in down])


def _stack(a_rows: list[torch.Tensor], b_cols: list[torch.Tensor]) -> Pair:
    a = torch.stack(a_rows, dim=0)  # (E, R, in)
    b = torch.stack(b_cols, dim=-1)  # (out, R, E)
    return a.reshape(-1, a.shape[-1]).contiguous(), b.reshape(b.shape[0], -1).contiguous()


def _unstack(a: torch.Tensor, b: torch.Tensor, num: int) -> list[Pair]:
    a_e = a.reshape(num, -1, a.shape[-1])
    b_e = b.reshape(b.shape[0], -1, num)
    return [(a_e[e].clone(), b_e[:, :, e].clone()) for e in range(num)]


def swap_roles(a: torch.Tensor, b: torch.Tensor, num: int) -> Pair:
    """The pair PEFT keeps for a parameter it reads transposed (an involution): per expert,
    ``A' = B^T`` and ``B' = A^T``."""
    pairs = _unstack(a, b, num)
    return _stack([pb.T for _, pb in pairs], [pa.T for pa, _ in pairs])


def split_down(a: torch.Tensor, b: torch.Tensor, num: int) -> list[Pair]:
    """The per-expert down pairs of a fused ``down`` pair."""
    return _unstack(a, b, num)


def split_gate_up(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    num: int,
    inter: int,
    gate_rank: int | None,
    up_rank: int | None,
    where: str,
    interleaved: bool = False,
) -> list[tuple[Pair | None, Pair | None]]:
    """The per-expert (gate, up) pairs of a fused ``gate_up`` pair of rank ``R``.

    ``gate_rank``/``up_rank`` are the ranks of the grafted model's layers (``None``: no LoRA):
    ``r_gate + r_up == R`` takes the block-diagonal pair apart (its other blocks must be zero),
    ``r_gate == r_up == R`` cuts ``B`` into its gate and up rows with ``A`` shared.
    """
    rank = a.shape[0] // num
    experts = _unstack(a, b, num)
    out: list[tuple[Pair | None, Pair | None]] = []
    for e, (a_e, b_e) in enumerate(experts):
        if interleaved:
            top, bottom = b_e.unflatten(0, (inter, 2)).unbind(1)  # type: ignore[no-untyped-call]
        else:
            top, bottom = b_e[:inter], b_e[inter:]
        if gate_rank is not None and up_rank is not None and gate_rank == up_rank == rank:
            out.append(((a_e, top.clone()), (a_e.clone(), bottom.clone())))
            continue
        g, u = gate_rank or 0, up_rank or 0
        if g + u != rank:
            raise ExpertsAdapterError(
                f"The fused LoRA pair of `{where}` has rank {rank}, and the per-expert layers here have ranks "
                f"gate={gate_rank}, up={up_rank}: expected their sum or both equal to {rank}. Check the adapter's "
                "`rank_pattern`, or load the adapter on the model without the graft."
            )
        _require_zero(top[:, g:], where, e, "gate rows of the up rank")
        _require_zero(bottom[:, :g], where, e, "up rows of the gate rank")
        gate = (a_e[:g].clone(), top[:, :g].clone()) if gate_rank else None
        up = (a_e[g:].clone(), bottom[:, g:].clone()) if up_rank else None
        out.append((gate, up))
    return out


def _require_zero(block: torch.Tensor, where: str, expert: int, what: str) -> None:
    if block.numel() and bool(block.ne(0).any()):
        raise ExpertsAdapterError(
            f"The fused LoRA pair of `{where}` (expert {expert}) is not block diagonal: its {what} are not zero, so "
            "it cannot be split into per-expert pairs of the ranks its config names. It was trained further on the "
            "plain model: load it there, or drop the per-expert keys (`...\\d+...`) of its `rank_pattern` and "
            "`alpha_pattern` to load it at the fused rank."
        )
