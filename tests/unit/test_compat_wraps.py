"""The table of every transformers attribute modelgraft wraps (``modelgraft._compat.wraps``).

Runs on both legs: each entry for the installed transformers must exist there and be wrapped once
modelgraft is imported, nothing outside the table may be wrapped, and the groups go in (and come
out) in the stated order.

Unit tests of ``modelgraft._compat.wraps`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import pytest

import modelgraft  # noqa: F401  (installs the wrappers)
from _versions import TRANSFORMERS_VERSION
from modelgraft import _compat, hooks
from modelgraft._compat._wrapping import WRAPPED_MARK, is_wrapped
from modelgraft._compat.wraps import GROUPS, SITES, Site, WrapGroup, owner_of, sites

HERE = sites()  # the sites of the installed transformers


def _held(site: Site) -> Any:
    owner = owner_of(site)
    return vars(owner).get(site.attribute) if hasattr(owner, "__dict__") else None


def _id(site: Site) -> str:
    return f"{site.group}:{site.owner}.{site.attribute}"


def test_the_table_covers_both_supported_lines_in_the_stated_group_order() -> None:
    assert {m for s in SITES for m in s.majors} == {4, 5}
    order = [GROUPS.index(s.group) for s in SITES]
    assert order == sorted(order), "sites must be listed group by group, in installation order"
    for major in (4, 5):
        assert {s.group for s in sites(major=major)} == set(GROUPS), major
    with pytest.raises(ValueError, match="unknown wrap group `nope`"):
        sites("nope")


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
    # An attribute wrapped by two groups (4.57: `_from_config`, by the construction step and by
    # the loaders) holds the later group's wrapper around the earlier one's.
    by_place: dict[tuple[int, str], list[Site]] = {}
    for site in HERE:
        by_place.setdefault((id(owner_of(site)), site.attribute), []).append(site)
    shared = [group for group in by_place.values() if len(group) > 1]
    if _compat.IS_V5:
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
