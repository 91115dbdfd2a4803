"""An expert adapter's files and config between ``linear_experts`` and the plain model's layout.

What :meth:`PeftModel.save_pretrained` writes for a grafted model (:func:`plan_save`, then
:func:`fuse_state` and :func:`fuse_config` on the saved folder) and what a grafted model reads
from an adapter of fused 3D experts (:func:`split_config` before PEFT injects its layers,
:func:`split_state` before it loads their weights). The pair arithmetic is
:mod:`modelgraft.grafts._peft_experts`.

Example:
    >>> fuse_config({"r": 4, "target_modules": ["gate_proj"]}, [], ["model.layers.0.mlp.shared_expert.gate_proj"])[
    ...     "target_modules"
    ... ]
    ['model.layers.0.mlp.shared_expert.gate_proj']
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelgraft.errors import ExpertsAdapterError
from modelgraft.grafts._peft_experts import (
    ExpertSite,
    Pair,
    fuse_down,
    fuse_gate_up,
    fused_alpha,
    rank_hint,
    sites_of,
    split_down,
    split_gate_up,
    swap_roles,
)

__all__ = ["SitePlan", "fuse_config", "fuse_state", "plan_save", "split_config", "split_state"]


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
        dropout = layer.lora_dropout[adapter] if adapter in getattr(layer, "lora_dropout", {}) else None
        rate = float(getattr(dropout, "p", 0.0))
        if rate != 0.0:
            raise ExpertsAdapterError(
                f"The adapter `{adapter}` uses `lora_dropout={rate:g}` on the experts `{where}`; PEFT's fused 3D "
                "experts (`target_parameters`, its `ParamWrapper`) refuse a non-zero dropout, so the plain model "
                "could not load the saved adapter. Dropout changes nothing at inference: train the adapter "
                "with `lora_dropout=0`, or merge it "
                "(`merge_and_unload()`) and save the merged checkpoint. Nothing was written."
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


def _dot_prefix(key: str, suffix: str) -> str | None:
    """What precedes ``suffix`` in ``key`` when it ends there on a dot boundary (``base_model.model.``)."""
    prefix = key[: -len(suffix)]
    return prefix if key.endswith(suffix) and (not prefix or prefix.endswith(".")) else None


def _find_prefix(state: dict[str, torch.Tensor], suffix: str) -> str:
    for key in state:
        prefix = _dot_prefix(key, suffix)
        if prefix is not None:
            return prefix
    raise ExpertsAdapterError(f"The saved adapter has no tensor `...{suffix}`, which the model holds.")


def fuse_state(state: dict[str, torch.Tensor], plans: list[SitePlan]) -> dict[str, torch.Tensor]:
    """The saved adapter tensors with every planned site's per-expert pairs fused (PEFT's keys)."""
    out = dict(state)
    for plan in plans:
        site = plan.site
        pairs: list[list[Pair] | None] = []
        prefix = ""
        for name, role in zip(site.names, plan.roles):
            if role is None:
                pairs.append(None)
                continue
            keys = [f"{site.path}.{e}.{name}.lora_{x}.weight" for e in range(site.num) for x in "AB"]
            prefix = _find_prefix(state, keys[0])  # the same for every role: the fused pairs go under it too
            pairs.append(
                [(out.pop(prefix + keys[2 * e]), out.pop(prefix + keys[2 * e + 1])) for e in range(site.num)]
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
            prefix = _dot_prefix(key, f"{site.path}{depth}.lora_A.weight")
            if prefix is None:
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
