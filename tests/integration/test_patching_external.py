"""Issue 2, point 8: a user's own PreTrainedModel in a user module is patched when it is loaded."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from modelgraft import apply_patches, register_patch_mapping, report

USER_MODULE = textwrap.dedent(
    """
    import torch
    from transformers import PretrainedConfig, PreTrainedModel


    class UserConfig(PretrainedConfig):
        model_type = "modelgraft_user_tiny"

        def __init__(self, hidden_size=8, **kwargs):
            self.hidden_size = hidden_size
            super().__init__(**kwargs)


    class UserBlock(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.proj = torch.nn.Linear(config.hidden_size, config.hidden_size)

        def forward(self, x):
            return self.proj(x)


    class UserModel(PreTrainedModel):
        config_class = UserConfig

        def __init__(self, config):
            super().__init__(config)
            self.block = UserBlock(config)
            self.post_init()

        def forward(self, x):
            return self.block(x)
    """
)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    package = tmp_path / "usermods_graft"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "my_models.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("usermods_graft.my_models")
    yield module
    for name in ("usermods_graft.my_models", "usermods_graft"):
        sys.modules.pop(name, None)


def _replacement(module: ModuleType) -> type:
    class LoggingBlock(module.UserBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    return LoggingBlock


def test_user_model_is_patched_by_from_config_and_from_pretrained(
    user_module: ModuleType, tmp_path: Path
) -> None:
    replacement = _replacement(user_module)
    register_patch_mapping({"UserBlock": replacement})
    model = user_module.UserModel._from_config(user_module.UserConfig())
    assert type(model.block) is replacement
    assert user_module.UserBlock is not replacement  # restored after the load
    assert [r.path for r in report(model).replaced] == ["block"]

    model.save_pretrained(tmp_path / "ckpt")
    loaded = user_module.UserModel.from_pretrained(tmp_path / "ckpt")
    assert type(loaded.block) is replacement
    torch.testing.assert_close(loaded.block.proj.weight, model.block.proj.weight)
    assert report(loaded).ok


def test_manual_construction_of_a_user_model_is_not_in_scope(user_module: ModuleType) -> None:
    # apply_patches() only knows transformers' modules (and added prefixes); the hooks add the
    # module of the class being loaded, which a bare constructor call cannot tell them.
    register_patch_mapping({"UserBlock": _replacement(user_module)})
    with apply_patches():
        model = user_module.UserModel(user_module.UserConfig())
    assert type(model.block) is user_module.UserBlock
