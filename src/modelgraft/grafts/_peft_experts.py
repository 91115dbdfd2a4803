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
from typing import Any

import torch
from torch import nn

from modelgraft.errors import ExpertsAdapterError

__all__ = [
    "ExpertSite",
    "fuse_down",
    "fuse_gate_up",
    "lora_scaling",
    "rank_hint",
    "sites_of",
    "split_down",
    "split_gate_up",
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


# ---- saving: the adapter of a grafted model, written in the plain model's layout ----------------
@dataclass(frozen=True)
class _Role:
    """The LoRA of one per-expert layer name at one site (every expert alike)."""

    rank: int
    alpha: float
    scaling: float
    rslora: bool


@dataclass(frozen=True)
class SitePlan:
    """What one site's per-expert LoRA becomes: roles present (gate, up, down order)."""

    site: ExpertSite
    roles: tuple[_Role | None, _Role | None, _Role | None]


def _role(layers: list[nn.Module], adapter: str, where: str) -> _Role | None:
    found: list[Any] = []  # PEFT's LoRA layers (dicts of rank, alpha, scaling per adapter), or None
    for layer in layers:
        ranks = getattr(layer, "r", None)
        found.append(None if not isinstance(ranks, dict) or adapter not in ranks else layer)
    if all(x is None for x in found):
        return None
    if any(x is None for x in found):
        raise ExpertsAdapterError(
            f"Only some experts of `{where}` carry the LoRA adapter `{adapter}`: the plain model's fused experts "
            "take one LoRA pair for all of them. Adapt every expert of a layer, or none."
        )
    roles = set()
    for layer in found:
        assert layer is not None
        if layer.use_dora.get(adapter) or layer.lora_bias.get(adapter):
            raise ExpertsAdapterError(
                f"The adapter `{adapter}` uses DoRA or a LoRA bias on `{where}`, which PEFT's fused 3D experts "
                "(`target_parameters`) do not support: merge it (`merge_and_unload()`) and save the merged "
                "checkpoint, which loads on the plain model."
            )
        roles.add(
            _Role(
                int(layer.r[adapter]),
                float(layer.lora_alpha[adapter]),
                float(layer.scaling[adapter]),
                bool(layer.use_rslora[adapter]),
            )
        )
    if len(roles) != 1:
        raise ExpertsAdapterError(
            f"The experts of `{where}` carry LoRA pairs of different ranks or alphas ({sorted(map(str, roles))}); "
            "the plain model's fused experts take one rank and one scaling for all of them."
        )
    return roles.pop()


def plan_save(base: nn.Module, adapter: str) -> list[SitePlan]:
    """The sites whose experts carry ``adapter``; refuses what the plain layout cannot hold."""
    plans = []
    for site in sites_of(base):
        roles = tuple(
            _role(
                [base.get_submodule(f"{site.path}.{e}.{name}") for e in range(site.num)],
                adapter,
                f"{site.path}.*.{name}",
            )
            for name in site.names
        )
        if all(role is None for role in roles):
            continue
        if site.problem is not None:
            raise ExpertsAdapterError(
                f"The adapter `{adapter}` adapts the experts of `{site.path}`, and the plain model keeps them in a "
                f"form PEFT cannot adapt the same way: {site.problem}. Saved as it is, the plain model would drop "
                "them without a word. Merge it (`merge_and_unload()`) and save the merged checkpoint."
            )
        gate, up = roles[0], roles[1]
        if gate is not None and up is not None and (gate.scaling, gate.rslora) != (up.scaling, up.rslora):
            raise ExpertsAdapterError(
                f"The gate and up layers of `{site.path}` carry different LoRA scalings ({gate.scaling} and "
                f"{up.scaling}); PEFT fuses them into one `gate_up_proj` pair with one scaling. Give them the same "
                "alpha/rank ratio, or merge the adapter and save the merged checkpoint."
            )
        plans.append(SitePlan(site, roles))  # type: ignore[arg-type]
    shapes = {(tuple(r and (r.rank, r.scaling) for r in p.roles)) for p in plans}
    if len(shapes) > 1:
        raise ExpertsAdapterError(
            f"The experts of different layers carry different LoRA ranks or roles ({len(shapes)} kinds); the "
            "adapter's config gives the fused experts one rank per parameter name. Adapt every MoE layer alike."
        )
    return plans


def _find_prefix(state: dict[str, torch.Tensor], suffix: str) -> str:
    for key in state:
        prefix = key[: -len(suffix)]
        if key.endswith(suffix) and (not prefix or prefix.endswith(".")):
            return prefix
    raise ExpertsAdapterError(f"The saved adapter has no tensor `...{suffix}`, which the model holds.")


def fuse_state(state: dict[str, torch.Tensor], plans: list[SitePlan]) -> dict[str, torch.Tensor]:
    """The saved adapter tensors with every planned site's per-expert pairs fused (PEFT's keys)."""
    out = dict(state)
    for plan in plans:
        site = plan.site
        pairs: list[list[Pair] | None] = []
        for name, role in zip(site.names, plan.roles):
            if role is None:
                pairs.append(None)
                continue
            keys = [f"{site.path}.{e}.{name}.lora_{x}.weight" for e in range(site.num) for x in "AB"]
            prefix = _find_prefix(state, keys[0])
            pairs.append(
                [(out.pop(prefix + keys[2 * e]), out.pop(prefix + keys[2 * e + 1])) for e in range(site.num)]
            )
        prefix = _find_prefix(
            state, f"{site.path}.0.{next(n for n, r in zip(site.names, plan.roles) if r)}.lora_A.weight"
        )
        targeted = _targeted(plan)
        if "gate_up_proj" in targeted:
            a, b = fuse_gate_up(pairs[0], pairs[1], site.inter, interleaved=site.interleaved)
            if site.swapped:
                a, b = swap_roles(a, b, site.num)
            _put(out, prefix, site, "gate_up_proj", targeted, a, b)
        if "down_proj" in targeted:
            assert pairs[2] is not None
            a, b = fuse_down(pairs[2])
            if site.swapped:
                a, b = swap_roles(a, b, site.num)
            _put(out, prefix, site, "down_proj", targeted, a, b)
    return out


def _targeted(plan: SitePlan) -> tuple[str, ...]:
    wanted = set()
    if plan.roles[0] or plan.roles[1]:
        wanted.add("gate_up_proj")
    if plan.roles[2]:
        wanted.add("down_proj")
    return tuple(name for name in plan.site.fused_order if name in wanted)


def _put(
    out: dict[str, torch.Tensor],
    prefix: str,
    site: ExpertSite,
    fused: str,
    targeted: tuple[str, ...],
    a: torch.Tensor,
    b: torch.Tensor,
) -> None:
    depth = len(targeted) - 1 - targeted.index(fused)
    where = ".".join([site.path, *["base_layer"] * depth])
    out[f"{prefix}{where}.lora_A.weight"] = a
    out[f"{prefix}{where}.lora_B.weight"] = b


def fuse_config(
    config: dict[str, object], plans: list[SitePlan], other_targets: list[str]
) -> dict[str, object]:
    """The adapter config for the plain model: fused experts as ``target_parameters``.

    ``other_targets`` are the full names of the adapted layers outside the experts (the plain
    model has them under the same names). Rank and alpha patterns for the fused parameters and
    for the per-expert layers (which the plain model does not have) come first, so they win.
    """
    config = dict(config)
    ranks: dict[str, object] = {}
    alphas: dict[str, object] = {}
    parameters = [p for p in _as_list(config.get("target_parameters"))]
    for plan in plans:
        site = plan.site
        leaf = site.path.rsplit(".", 1)[-1]
        gate, up, down = plan.roles
        for name, role in zip(site.names, plan.roles):
            if role is not None:
                ranks[rank_hint(leaf, name)] = role.rank
                alphas[rank_hint(leaf, name)] = _number(role.alpha)
        for fused in _targeted(plan):
            parameters.append(f"{site.path}.{fused}")
            if fused == "gate_up_proj":
                first = gate or up
                assert first is not None
                rank = (gate.rank if gate else 0) + (up.rank if up else 0)
                alpha = fused_alpha(first.scaling, rank, first.rslora, site.path)
            else:
                assert down is not None
                rank, alpha = down.rank, _number(down.alpha)
            key = rf"{re.escape(leaf)}\.{fused}"
            ranks[key] = rank
            alphas[key] = alpha
    config["target_parameters"] = list(dict.fromkeys(parameters))
    config["target_modules"] = sorted(other_targets)
    config["rank_pattern"] = {**ranks, **_as_dict(config.get("rank_pattern"))}
    config["alpha_pattern"] = {**alphas, **_as_dict(config.get("alpha_pattern"))}
    return config


def _number(value: float) -> float:
    return int(value) if float(value).is_integer() else value


def _as_list(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]  # type: ignore[attr-defined]


def _as_dict(value: object) -> dict[str, object]:
    return dict(value) if isinstance(value, dict) else {}


# ---- loading: an adapter in the plain model's layout, on a grafted model ------------------------
def _matches(target: str, name: str) -> bool:
    return name == target or name.endswith(f".{target}")


def _pattern_value(patterns: dict[str, object], key: str, default: object) -> object:
    """PEFT's lookup: the first pattern that matches the end of ``key`` on a dot boundary."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def split_config(config: object, base: nn.Module) -> bool:
    """Point an adapter config of fused 3D experts at a grafted model's per-expert layers.

    ``target_parameters`` naming a grafted site's fused parameters become per-expert module
    targets; their ranks and alphas come from the per-expert patterns the adapter was saved with
    (exact split), else from the fused pair's (rank kept: ``B`` is cut in gate and up rows).
    Returns whether anything changed. Untranslatable sites are left (and refused later).
    """
    parameters = _as_list(getattr(config, "target_parameters", None))
    if not parameters:
        return False
    existing = {name for name, _ in base.named_parameters()}
    ranks = _as_dict(getattr(config, "rank_pattern", None))
    alphas = _as_dict(getattr(config, "alpha_pattern", None))
    used: set[str] = set()
    modules: list[str] = []
    new_ranks: dict[str, object] = {}
    new_alphas: dict[str, object] = {}
    for site in sites_of(base):
        if site.problem is not None:
            continue
        leaf = site.path.rsplit(".", 1)[-1]
        for fused, names in (("gate_up_proj", site.names[:2]), ("down_proj", site.names[2:])):
            key = f"{site.path}.{fused}"
            hits = [t for t in parameters if _matches(t, key) and not any(_matches(t, n) for n in existing)]
            if not hits:
                continue
            used.update(hits)
            hinted = [n for n in names if rank_hint(leaf, n) in ranks]
            for name in hinted or names:
                modules.append(f"{site.path}.{name}")
                if not hinted:
                    new_ranks[rank_hint(leaf, name)] = _pattern_value(ranks, key, getattr(config, "r", 8))
                    new_alphas[rank_hint(leaf, name)] = _pattern_value(
                        alphas, key, getattr(config, "lora_alpha", 8)
                    )
    if not used:
        return False
    config.target_parameters = [t for t in parameters if t not in used] or None  # type: ignore[attr-defined]
    config.target_modules = _with_expert_targets(getattr(config, "target_modules", None), modules, base)  # type: ignore[attr-defined]
    config.rank_pattern = {**new_ranks, **ranks}  # type: ignore[attr-defined]
    config.alpha_pattern = {**new_alphas, **alphas}  # type: ignore[attr-defined]
    return True


def _with_expert_targets(targets: object, sites: list[str], base: nn.Module) -> object:
    """``targets`` plus every expert's layer of ``sites`` (``<site path>.<name>``).

    A list gains suffix entries (``experts.<i>.<name>``) when they name no layer beyond the
    sites, else the full names; a regex gains an alternative.
    """
    by_site: dict[str, set[str]] = {}
    for entry in sites:
        path, name = entry.rsplit(".", 1)
        by_site.setdefault(path, set()).add(name)
    if isinstance(targets, str):
        extra = "|".join(
            rf"{re.escape(path)}\.\d+\.(?:{'|'.join(map(re.escape, sorted(names)))})"
            for path, names in by_site.items()
        )
        return f"(?:{targets})|(?:{extra})"
    out = set(_as_list(targets))
    wanted = {
        f"{path}.{i}.{name}"
        for path, names in by_site.items()
        for i in range(len(base.get_submodule(path)))  # type: ignore[arg-type]
        for name in names
    }
    suffixes = {".".join(n.split(".")[-3:]) for n in wanted}
    reached = {n for n, _ in base.named_modules() if ".".join(n.split(".")[-3:]) in suffixes}
    out |= suffixes if reached == wanted else wanted
    return out


def split_state(state: dict[str, object], base: nn.Module, adapter: str) -> dict[str, object]:
    """The adapter tensors with every grafted site's fused pairs cut into per-expert pairs.

    Which pair is which comes from the shapes (``gate_up``: ``A`` reads H, ``B`` writes 2I;
    ``down``: ``A`` reads I, ``B`` writes H), and the per-expert ranks from the layers PEFT
    built from the config (:func:`split_config`).
    """
    out = dict(state)
    for site in sites_of(base):
        found = _fused_pairs(out, site)
        if not found:
            continue
        if site.problem is not None:
            raise ExpertsAdapterError(
                f"The adapter adapts the fused experts at `{site.path}`, which the graft replaced by per-expert "
                f"layers that cannot take them: {site.problem}. Load it on the model without the graft."
            )
        for fused, (prefix, a_key, b_key) in found.items():
            a, b = out.pop(a_key), out.pop(b_key)
            assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            if site.swapped:
                a, b = swap_roles(a, b, site.num)
            if fused == "down_proj":
                pieces: list[tuple[str, list[Pair | None]]] = [
                    (site.names[2], list(split_down(a, b, site.num)))
                ]
            else:
                ranks = [_rank(base, f"{site.path}.0.{name}", adapter) for name in site.names[:2]]
                halves = split_gate_up(
                    a,
                    b,
                    num=site.num,
                    inter=site.inter,
                    gate_rank=ranks[0],
                    up_rank=ranks[1],
                    where=f"{site.path}.gate_up_proj",
                    interleaved=site.interleaved,
                )
                pieces = [(site.names[0], [g for g, _ in halves]), (site.names[1], [u for _, u in halves])]
            for name, pairs in pieces:
                for e, pair in enumerate(pairs):
                    if pair is not None:
                        out[f"{prefix}{site.path}.{e}.{name}.lora_A.weight"] = pair[0]
                        out[f"{prefix}{site.path}.{e}.{name}.lora_B.weight"] = pair[1]
    return out


def _rank(base: nn.Module, name: str, adapter: str) -> int | None:
    try:
        layer = base.get_submodule(name)
    except AttributeError:
        return None
    ranks = getattr(layer, "r", None)
    return int(ranks[adapter]) if isinstance(ranks, dict) and adapter in ranks else None


def _fused_pairs(state: dict[str, object], site: ExpertSite) -> dict[str, tuple[str, str, str]]:
    """The fused pairs saved under ``site`` (``experts.lora_A``, ``experts.base_layer.lora_A``)."""
    found: dict[str, tuple[str, str, str]] = {}
    for key in list(state):
        for depth in ("", ".base_layer"):
            suffix = f"{site.path}{depth}.lora_A.weight"
            prefix = key[: -len(suffix)]
            if not key.endswith(suffix) or (prefix and not prefix.endswith(".")):
                continue
            a = state[key]
            b_key = f"{prefix}{site.path}{depth}.lora_B.weight"
            b = state.get(b_key)
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                continue
            reads, writes = (b.shape[0], a.shape[-1]) if site.swapped else (a.shape[-1], b.shape[0])
            if reads == site.hidden and writes == 2 * site.inter:
                found["gate_up_proj"] = (prefix, key, b_key)
            elif reads == site.inter and writes == site.hidden:
                found["down_proj"] = (prefix, key, b_key)
            else:
                raise ExpertsAdapterError(
                    f"The adapter's fused experts pair `{key}` has lora_A {tuple(a.shape)} and lora_B "
                    f"{tuple(b.shape)}; `{site.path}` has H={site.hidden}, I={site.inter}: expected lora_A "
                    f"(R*{site.num}, {site.hidden}) with lora_B ({2 * site.inter}, R*{site.num}), or lora_A "
                    f"(R*{site.num}, {site.inter}) with lora_B ({site.hidden}, R*{site.num})."
                )
    return found
