"""The expert paths of ``linear_experts``: grouped, sorted-token loop and eager, and the family gates.

Unit tests of ``modelgraft.grafts._grouped_experts`` and its layouts (``_expert_layouts``, the
``FamilyGate`` of ``linear_experts``), in their own file: they count calls on the private path
functions, call them directly, or build a family gate, the one exception to tests using public names
only (issue 14); everything else comes from the public namespaces.

``grouped_mm`` (the default) and ``eager`` run on the per-expert layers with the plain model's
logits and gradients (fp32, tight tolerance; shapes, dtypes, finiteness); each runs the path it
names (checked by counting calls). Wrapped or hooked expert layers take the sorted-token loop and
still see their inputs. The refusal of other implementations (``batched_mm``) is tested with public
names in tests/integration/test_grafts_experts_kernels.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from _versions import missing_model_type, requires_fused_experts
from families import family
from modelgraft.grafts import LinearExpert, _grouped_experts, linear_experts
from modelgraft.grafts._expert_layouts import clamped_swiglu
from modelgraft.grafts.linear_experts import FamilyGate

pytestmark = requires_fused_experts

ATOL = 1e-5
# gpt_oss: transposed, interleaved, biased experts with a clamped gate; minimax_m3_vl_text: a
# family's own `_apply_gate` (both run the grouped path with their biases and gates)
FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "minimax_m3_vl_text")
PATHS = ("grouped_linear_forward", "sorted_forward", "eager_forward")


@pytest.fixture
def checkpoint(tiny_checkpoint: Callable[[str], Path]) -> Callable[[str], Path]:
    """The session's tiny causal-LM checkpoints (tests/conftest.py), read only here."""
    return tiny_checkpoint


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often each expert path of the grafted experts ran."""
    counted: dict[str, int] = {}
    for name in PATHS:
        original = getattr(_grouped_experts, name)

        def counting(
            *args: object, _original: Callable = original, _name: str = name, **kwargs: object
        ) -> object:
            counted[_name] = counted.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(_grouped_experts, name, counting)
    return counted


def _load(path: Path, model_type: str | None = None, **kwargs: object) -> torch.nn.Module:
    if model_type is None:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    with linear_experts(model_type).applied(strict=True):
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def _loss_and_grads(
    model: torch.nn.Module, model_type: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    model.train()
    inputs = family(model_type).inputs(model.config)
    out = model(**inputs, labels=inputs["input_ids"])
    out.loss.backward()
    grad = model.get_input_embeddings().weight.grad
    assert grad is not None
    return out.logits.detach(), out.loss.detach(), grad


def _same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert torch.isfinite(got).all() and torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize(
    ("implementation", "path"), [("grouped_mm", "grouped_linear_forward"), ("eager", "eager_forward")]
)
def test_each_implementation_runs_its_path_with_the_plain_models_logits_and_gradients(
    implementation: str, path: str, model_type: str, checkpoint, calls: dict[str, int]
) -> None:
    if (why := missing_model_type(model_type)) is not None:
        pytest.skip(why)
    source = checkpoint(model_type)
    plain = _load(source, experts_implementation=implementation)
    grafted = _load(source, model_type, experts_implementation=implementation)
    assert grafted.config._experts_implementation == implementation
    calls.clear()
    expected, got = _loss_and_grads(plain, model_type), _loss_and_grads(grafted, model_type)
    assert set(calls) == {path}, calls
    for g, e in zip(got, expected, strict=True):
        _same(g, e)


def test_set_experts_implementation_after_the_load_is_honoured(checkpoint, calls: dict[str, int]) -> None:
    source = checkpoint("qwen3_moe")
    grafted = _load(source, "qwen3_moe").eval()
    inputs = family("qwen3_moe").inputs(grafted.config)
    with torch.no_grad():
        grouped = grafted(**inputs).logits
        grafted.set_experts_implementation("eager")
        calls.clear()
        eager = grafted(**inputs).logits
    assert set(calls) == {"eager_forward"}, calls
    _same(eager, grouped)


def test_a_hooked_expert_layer_takes_the_sorted_loop_and_sees_its_tokens(
    checkpoint, calls: dict[str, int]
) -> None:
    source = checkpoint("qwen3_moe")
    plain = _load(source).eval()
    grafted = _load(source, "qwen3_moe").eval()
    seen: list[int] = []
    layer = grafted.model.layers[0].mlp.experts[1].gate_proj
    handle = layer.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    inputs = family("qwen3_moe").inputs(plain.config)
    calls.clear()
    with torch.no_grad():
        _same(grafted(**inputs).logits, plain(**inputs).logits)
    handle.remove()
    layers = grafted.config.num_hidden_layers
    assert calls == {"sorted_forward": 1, "grouped_linear_forward": layers - 1}, (
        calls
    )  # only layer 0 is hooked
    assert seen and all(n > 0 for n in seen)


@pytest.mark.parametrize("inter", [8, 6])  # 6: fp32 rows of 24 bytes, which the CPU grouped kernel refuses
@pytest.mark.parametrize("sentinel", [-1, 4])
def test_sorted_and_grouped_paths_skip_out_of_range_ids_as_eager_does(sentinel: int, inter: int) -> None:
    torch.manual_seed(0)
    experts = [
        (
            torch.nn.Linear(8, inter, bias=False),
            torch.nn.Linear(8, inter, bias=False),
            torch.nn.Linear(inter, 8, bias=False),
        )
        for _ in range(4)
    ]

    def run(expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = experts[expert]
        return down(torch.nn.functional.silu(gate(x)) * up(x))

    x = torch.randn(10, 8)
    ids = torch.randint(0, 4, (10, 3))
    ids[2, 1] = ids[7, 0] = sentinel  # the expert-parallel sentinel: another rank's expert
    weights = torch.rand(10, 3)
    expected = _grouped_experts.eager_forward(run, 4, x, ids, weights)
    _same(_grouped_experts.sorted_forward(run, 4, x, ids, weights), expected)
    grouped = _grouped_experts.grouped_linear_forward(experts, torch.nn.SiLU(), x, ids, weights)
    if grouped is None:  # no grouped kernel for these strides: the experts then run the sorted loop
        assert inter == 6
    else:
        _same(grouped, expected)


def test_bf16_experts_with_float32_routing_weights_match_eager() -> None:
    torch.manual_seed(0)
    experts = [
        tuple(torch.nn.Linear(a, b, bias=False, dtype=torch.bfloat16) for a, b in ((16, 8), (16, 8), (8, 16)))
        for _ in range(3)
    ]

    def run(expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = experts[expert]
        return down(torch.nn.functional.silu(gate(x)) * up(x))

    x = torch.randn(7, 16, dtype=torch.bfloat16)
    ids, weights = torch.randint(0, 3, (7, 2)), torch.rand(7, 2)  # a float32 router
    expected = _grouped_experts.eager_forward(run, 3, x, ids, weights)
    for got in (
        _grouped_experts.sorted_forward(run, 3, x, ids, weights),
        _grouped_experts.grouped_linear_forward(experts, torch.nn.SiLU(), x, ids, weights),
    ):
        if got is None:  # no bf16 grouped kernel here: the sorted loop runs instead
            continue
        assert got.dtype == torch.bfloat16 and got.shape == expected.shape and torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("inter", [8, 6])  # 6: fp32 rows of 24 bytes, which the CPU grouped kernel refuses
def test_grouped_path_adds_biases_and_runs_the_family_gate_as_eager_does(inter: int) -> None:
    torch.manual_seed(0)
    gate = FamilyGate(clamped_swiglu, {"alpha": 1.702, "limit": 0.5}, interleaved=True)  # a limit that clamps
    experts = [LinearExpert(8, inter, None, bias=True, gate=gate) for _ in range(4)]
    with torch.no_grad():
        for expert in experts:
            for layer in (expert.gate_proj, expert.up_proj, expert.down_proj):
                layer.bias.normal_()
    layers = [(e.gate_proj, e.up_proj, e.down_proj) for e in experts]
    x = torch.randn(10, 8)
    ids = torch.randint(0, 4, (10, 3))
    ids[4, 2] = -1  # the expert-parallel sentinel
    weights = torch.rand(10, 3)
    expected = _grouped_experts.eager_forward(lambda e, h: experts[e](h), 4, x, ids, weights)
    grouped = _grouped_experts.grouped_linear_forward(layers, None, x, ids, weights, gate=gate)
    if grouped is None:  # no grouped kernel for these strides: the experts then run the sorted loop
        assert inter == 6
    else:
        _same(grouped, expected)


# None: transformers' default; an explicit "grouped_mm" transformers itself refuses for Llama 4
@pytest.mark.parametrize("implementation", [None, "eager", "batched_mm"])
def test_llama4_experts_run_every_expert_on_its_block_whatever_the_setting(
    implementation: str | None, checkpoint, calls: dict[str, int]
) -> None:
    """Llama 4's plain experts have no kernel choice (a dense call on router-scaled inputs): the
    grafted ones run the same call under any setting, with the plain model's logits."""
    source = checkpoint("llama4_text")
    kwargs = {} if implementation is None else {"experts_implementation": implementation}
    plain = _load(source, **kwargs).eval()
    grafted = _load(source, "llama4_text", **kwargs).eval()
    inputs = family("llama4_text").inputs(plain.config)
    calls.clear()
    with torch.no_grad():
        _same(grafted(**inputs).logits, plain(**inputs).logits)
    assert not calls, calls  # no routed path: every expert runs on its own block
    assert any(type(m).__name__ == "LinearLlama4TextExperts" for m in grafted.modules())
