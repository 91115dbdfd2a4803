"""Shared check of the weight-sync tests: a stream of ``(name, tensor)`` is the plain checkpoint."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from safetensors.torch import load_file


def assert_matches_plain(
    stream: list[tuple[str, torch.Tensor]],
    path: Path,
    plain: torch.nn.Module,
    grafted: torch.nn.Module | None = None,
) -> None:
    """``stream`` is the plain checkpoint: each name once, each tensor equal to the saved one; in
    the plain ``state_dict()`` order, but for the keys of one reversed group, which come together."""
    saved = load_file(path / "model.safetensors")
    state = plain.state_dict()
    names = [name for name, _ in stream]
    assert len(names) == len(set(names)), "a name was yielded twice"
    assert set(saved) <= set(names), f"saved keys never yielded: {sorted(set(saved) - set(names))[:4]}"
    for name, tensor in stream:
        # a key save_pretrained drops is a tied weight: the plain state_dict has it
        expected = saved[name] if name in saved else state[name]
        assert tensor.dtype == expected.dtype, name
        assert tensor.shape == expected.shape, name
        assert not tensor.is_meta, name
        assert torch.equal(tensor, expected), name
    if set(state) == set(names):  # transformers does not convert this family itself
        for name, tensor in stream:
            assert torch.equal(tensor, state[name]), name
        place = {k: i for i, k in enumerate(state)}
        kept = set(grafted.state_dict()) if grafted is not None else set(state)
        untouched = [n for n in names if n in kept]
        assert untouched == sorted(untouched, key=place.__getitem__), "untouched keys out of plain order"
        converted = [n for n in names if n not in kept]
        for a, b in itertools.pairwise(converted):  # groups follow one another in the plain order
            assert place[a] < place[b] or a.rsplit(".", 1)[-1] != b.rsplit(".", 1)[-1], (a, b)
