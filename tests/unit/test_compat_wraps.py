"""The table of every transformers attribute modelgraft wraps (``modelgraft._compat.wraps``).

Runs on both legs: each entry for the installed transformers must exist there and be wrapped once
modelgraft is imported, nothing outside the table may be wrapped, and the groups go in (and come
out) in the stated order.

Unit tests of ``modelgraft._compat.wraps`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

import pytest

import modelgraft  # noqa: F401  (installs the wrappers)
from _versions import TRANSFORMERS_VERSION
from modelgraft import _compat, hooks
from modelgraft._compat._features import Features
from modelgraft._compat._wrapping import WRAPPED_MARK, is_wrapped
from modelgraft._compat.wraps import GROUPS, SITES, WHEN, Site, WrapGroup, owner_of, sites

HERE = sites()  # the sites of the installed transformers


def _held(site: Site) -> Any:
    owner = owner_of(site)
    return vars(owner).get(site.attribute) if hasattr(owner, "__dict__") else None


def _id(site: Site) -> str:
    return f"{site.group}:{site.owner}.{site.attribute}"


# The feature combinations of the supported releases (docs/compat.md): 4.57; 5.0-5.1; 5.2;
# 5.3-5.22; 5.23 on.
_GENERIC, _CAPTURING, _MU = (
    "transformers.utils.generic",
    "transformers.utils.output_capturing",
    "transformers.modeling_utils",
)
RELEASE_FEATURES = {
    "4.57": Features("4.57.6", False, False, False, "init_contexts", "by_class_name", (_GENERIC, _MU)),
    "5.0": Features("5.0.0", True, True, False, "init_contexts", "by_class_name", (_GENERIC, _MU)),
    "5.2": Features("5.2.0", True, True, False, "init_contexts", "by_class_name", (_CAPTURING, _MU)),
    "5.19": Features("5.19.0", True, True, True, "apply_patches", "by_class_name", (_CAPTURING, _MU)),
    "5.24": Features("5.24.0", True, True, True, "apply_patches", "by_instance", (_CAPTURING,)),
}


def test_the_table_covers_every_feature_combination_in_the_stated_group_order() -> None:
    assert {s.when for s in SITES} <= set(WHEN), "every site's condition is a named one"
    order = [GROUPS.index(s.group) for s in SITES]
    assert order == sorted(order), "sites must be listed group by group, in installation order"
    for release, features in RELEASE_FEATURES.items():
        chosen = sites(features=features)
        assert {s.group for s in chosen} == set(GROUPS), release
        for group in GROUPS:  # within a group, one site per (owner, attribute)
            mine = [(s.owner, s.attribute) for s in chosen if s.group == group]
            assert len(set(mine)) == len(mine), (release, group)
    assert [s.attribute for s in sites("recorders", features=RELEASE_FEATURES["5.19"])] == [
        "_CAN_RECORD_REGISTRY",
        "_CAN_RECORD_REGISTRY",
    ]
    assert [s.owner for s in sites("recorders", features=RELEASE_FEATURES["5.0"])] == [_GENERIC, _MU]
    assert [s.attribute for s in sites("construction", features=RELEASE_FEATURES["5.2"])] == [
        "get_init_context",
        "_from_config",
    ]
    with pytest.raises(ValueError, match="unknown wrap group `nope`"):
        sites("nope")


def test_the_installed_release_binds_the_features_it_has() -> None:
    features = _compat.FEATURES
    assert features.release == TRANSFORMERS_VERSION
    module = importlib.import_module(features.recorder_holders[0])
    registry = vars(module)["_CAN_RECORD_REGISTRY"]
    if features.recorder_registry == "by_instance":  # its bound `get` is shadowed on the object
        assert is_wrapped(vars(registry).get("get"))
    else:  # the plain dict is replaced, in every module that binds it, by one instance-aware dict
        holders = [
            vars(importlib.import_module(m))["_CAN_RECORD_REGISTRY"] for m in features.recorder_holders
        ]
        assert type(registry).__name__ == "_InstanceAwareRegistry"
        assert all(held is registry for held in holders)
    has_apply_patches = hasattr(importlib.import_module(_MU), "apply_patches")
    assert (features.construction == "apply_patches") == has_apply_patches


@pytest.mark.parametrize("site", HERE, ids=_id)
def test_each_site_exists_on_the_installed_transformers(site: Site) -> None:
    owner = owner_of(site)
    assert hasattr(owner, site.attribute), (
        f"transformers {TRANSFORMERS_VERSION} has no `{site.owner}.{site.attribute}`"
    )


@pytest.mark.parametrize("site", HERE, ids=_id)
def test_each_site_is_wrapped_after_import(site: Site) -> None:
    assert is_wrapped(_held(site)), f"`{site.owner}.{site.attribute}` is not wrapped"


def _wrapped_attributes() -> set[tuple[int, str]]:
    """``(id(owner), attribute)`` of every modelgraft wrapper held by a loaded transformers module,
    a class defined there, or a registry object there."""
    found: set[tuple[int, str]] = set()
    for name, module in list(sys.modules.items()):
        if not (name == "transformers" or name.startswith("transformers.")) or not isinstance(
            module, ModuleType
        ):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, ModuleType):  # a lazy sub-package imports on attribute access
                continue
            if is_wrapped(value):
                found.add((id(module), attr))
            if isinstance(value, type) and value.__module__ == name:
                found.update((id(value), a) for a, v in list(vars(value).items()) if is_wrapped(v))
            elif isinstance(value, dict) and hasattr(value, "__dict__"):
                found.update((id(value), a) for a, v in list(vars(value).items()) if is_wrapped(v))
    return found


def test_nothing_outside_the_table_is_wrapped() -> None:
    listed = {(id(owner_of(s)), s.attribute) for s in HERE}
    assert _wrapped_attributes() == listed


def test_later_groups_wrap_on_top_of_earlier_ones() -> None:
    # An attribute wrapped by two groups (where construction happens in the init contexts: 4.57,
    # 5.0-5.2: `_from_config`, by the construction step and by the loaders) holds the later
    # group's wrapper around the earlier one's.
    by_place: dict[tuple[int, str], list[Site]] = {}
    for site in HERE:
        by_place.setdefault((id(owner_of(site)), site.attribute), []).append(site)
    shared = [group for group in by_place.values() if len(group) > 1]
    if _compat.FEATURES.construction == "apply_patches":
        assert not shared
        return
    assert [[s.group for s in group] for group in shared] == [["construction", "loaders"]]
    outer = _held(shared[0][0])
    inner = getattr(outer.__func__, WRAPPED_MARK)
    assert is_wrapped(inner) and not is_wrapped(getattr(inner, WRAPPED_MARK))


def test_uninstall_removes_every_site_and_install_puts_them_back() -> None:
    before = {_id(s): _held(s) for s in HERE}
    hooks.uninstall()
    try:
        assert not _wrapped_attributes()
        assert not (_compat.LOADERS.installed or _compat.CONSTRUCTION.installed)
        assert not _compat.CONVERSION.installed
    finally:
        hooks.install()
    assert all(is_wrapped(_held(s)) for s in HERE)
    assert _wrapped_attributes() == {(id(owner_of(s)), s.attribute) for s in HERE}
    # Underneath are the functions transformers had (nothing wrapped twice over); a replaced value
    # (4.57's recorder registry) comes back as a copy holding every entry it held.
    for site in HERE:
        now, then = _unwrapped(_held(site)), _unwrapped(before[_id(site)])
        if callable(then):
            assert now is then, _id(site)
        else:
            assert type(now) is dict and now.items() >= dict(then).items(), _id(site)


def _unwrapped(value: Any) -> Any:
    while is_wrapped(value):
        value = getattr(getattr(value, "__func__", value), WRAPPED_MARK)
    return getattr(value, "__func__", value)


def test_a_group_needs_exactly_its_wrappers() -> None:
    group = WrapGroup("loaders")
    with pytest.raises(
        ValueError, match=r"wrap group `loaders` has sites .*received wrappers for \['from_pretrained'\]"
    ):
        group.install({"from_pretrained": lambda original: original})
    assert not group.installed
