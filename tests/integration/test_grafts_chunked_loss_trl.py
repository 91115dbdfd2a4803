"""chunked_lm_loss under trainers that replace the model's forward (issue 20 point 6).

TRL 1.16's trainers (SFT, GRPO, DPO, RLOO) call ``add_fused_lm_head(model)``, which sets
``model.forward`` on the instance; with ``fused_lm_head=True`` that forward runs the backbone and
TRL's own chunked log-probabilities, so the graft's chunked loss never runs. That is never silent: a
one-time ``RuntimeWarning`` when the forward is replaced, and a note in ``report(model)`` while it is.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from modelgraft import report
from modelgraft.grafts import _chunked_ce, chunked_loss, graft_chunked_lm_loss
from modelgraft.testing import tiny_config

IDS = torch.randint(1, 100, (2, 10), generator=torch.Generator().manual_seed(0))


def _model(seed: int = 0, grafted: bool = True) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).train()
    return graft_chunked_lm_loss(model) if grafted else model


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunked_loss, "_BYPASS_WARNED", set())


@pytest.fixture
def chunked_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the graft's chunked loss ran."""
    calls: list[int] = []
    real = chunked_loss.linear_cross_entropy

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(chunked_loss, "linear_cross_entropy", counted)
    assert _chunked_ce.linear_cross_entropy is not counted
    return calls


def test_trl_fused_lm_head_bypass_warns_once_and_shows_in_the_report(chunked_calls: list[int]) -> None:
    trl_utils = pytest.importorskip("trl.trainer.utils", reason="TRL is what replaces the forward here")
    model = _model()
    assert not [n for n in report(model).notes]
    with pytest.warns(
        RuntimeWarning, match=r"chunked_lm_loss is bypassed .*add_fused_lm_head.*_fused_forward"
    ):
        trl_utils.add_fused_lm_head(model)
    note = [n for n in report(model).notes if "chunked_lm_loss is bypassed" in n]
    assert len(note) == 1 and "add_fused_lm_head.<locals>._fused_forward" in note[0]
    assert "note: chunked_lm_loss is bypassed" in report(model).summary()

    # TRL's path: its own loss, the graft's chunked loss does not run ...
    out = model(input_ids=IDS, labels=IDS, fused_lm_head=True)
    assert chunked_calls == [] and torch.isfinite(out.loss)
    plain = _model(grafted=False)
    expected = plain(input_ids=IDS, labels=IDS).loss
    assert torch.allclose(out.loss, expected, atol=1e-5)  # the same loss, computed by TRL
    # ... the forward TRL passes on to the original still does (training, labels: no logits)
    passed_on = model(input_ids=IDS, labels=IDS)
    assert chunked_calls == [1] and passed_on.logits is None
    assert torch.allclose(passed_on.loss, expected, atol=1e-5)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class and replacement
        trl_utils.add_fused_lm_head(_model(seed=1))


def test_any_forward_replaced_on_the_instance_is_reported_until_it_is_removed() -> None:
    model = _model()

    def own_head(self, *args, **kwargs):
        return type(self).forward(self, *args, **kwargs)

    with pytest.warns(RuntimeWarning, match=r"replaced on this model by `.*own_head`"):
        model.forward = types.MethodType(own_head, model)
    assert any(n.startswith("chunked_lm_loss is bypassed") for n in report(model).notes)
    del model.forward
    assert report(model).notes == []


def test_a_plain_model_or_another_attribute_says_nothing() -> None:
    plain = _model(grafted=False)
    graft = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.forward = types.MethodType(lambda self, *a, **k: None, plain)
        graft.some_attribute = 1
    assert report(plain).notes == [] and report(graft).notes == []
