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


class _QuarterRoundedWeight(torch.Tensor):
    """A fake-quant weight: ``F.linear`` computes with it rounded to quarters (a tensor subclass
    that ``torch.stack`` would silently turn back into the unrounded weight)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, weight, *rest = args
            with torch._C.DisableTorchFunctionSubclass():
                return torch.nn.functional.linear(x, torch.round(weight * 4) / 4, *rest, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)


def _zeroing_forward(layer: torch.nn.Linear) -> None:
    """An instance ``forward`` (as compressed-tensors' fake quantization installs) that zeroes the output."""
    layer.forward = lambda x: torch.zeros(*x.shape[:-1], layer.out_features, dtype=x.dtype)  # type: ignore[method-assign]


def _zeroing_hook(layer: torch.nn.Linear) -> None:
    layer.register_forward_hook(lambda module, args, out: out * 0)


def _doubling_pre_hook(layer: torch.nn.Linear) -> None:
    layer.register_forward_pre_hook(lambda module, args: (args[0] * 2,))


def _rounded_weight(layer: torch.nn.Linear) -> None:
    layer.weight = torch.nn.Parameter(
        layer.weight.detach().mul(40).as_subclass(_QuarterRoundedWeight), requires_grad=False
    )


CHANGES = {
    "instance_forward": _zeroing_forward,
    "forward_hook": _zeroing_hook,
    "forward_pre_hook": _doubling_pre_hook,
    "tensor_subclass_weight": _rounded_weight,
}


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("change", CHANGES)
def test_changed_expert_layers_run_their_own_forward_not_the_grouped_matmul(
    change: str, model_type: str, checkpoint, calls: dict[str, int]
) -> None:
    """Issue 27 point 1: the grouped path stacked ``layer.weight`` of any exact ``nn.Linear``, so an
    instance forward, a hook or a tensor-subclass weight changed nothing under ``grouped_mm``."""
    grafted = _load(checkpoint(model_type), model_type).eval()
    inputs = family(model_type).inputs(grafted.config)
    with torch.no_grad():
        untouched = grafted(**inputs).logits
        for expert in grafted.model.layers[0].mlp.experts:
            CHANGES[change](expert.down_proj if model_type == "qwen3_moe" else expert.w2)
        calls.clear()
        grouped = grafted(**inputs).logits
        assert calls == {
            "sorted_forward": 1,
            "grouped_linear_forward": grafted.config.num_hidden_layers - 1,
        }, calls
        grafted.set_experts_implementation("eager")
        eager = grafted(**inputs).logits
    _same(grouped, eager)  # each layer's own forward, as the eager per-expert loop runs it
    # ... and the change took effect: the reference is not the untouched model's logits.
    assert (grouped - untouched).abs().max() > 1e-3
    assert torch.equal(grouped.argmax(-1), eager.argmax(-1))


@pytest.mark.parametrize(
    "extra",
    ["buffer", "parameter", "child", "expert_forward", "backward_hook", "bf16_layer", "linear_subclass"],
)
def test_any_expert_layer_beyond_a_plain_linear_leaves_the_grouped_path(
    extra: str, checkpoint, calls: dict[str, int]
) -> None:
    """Quantizers keep scales in buffers or parameters beside ``weight``; such a layer (or an expert
    with a forward of its own, a backward hook, another dtype) is called as a module."""
    grafted = _load(checkpoint("qwen3_moe"), "qwen3_moe").eval()
    inputs = family("qwen3_moe").inputs(grafted.config)
    expert = grafted.model.layers[0].mlp.experts[0]
    layer = expert.gate_proj
    if extra == "buffer":
        layer.register_buffer("weight_scale", torch.ones(layer.out_features))
    elif extra == "parameter":
        layer.register_parameter("weight_zero_point", torch.nn.Parameter(torch.zeros(1), requires_grad=False))
    elif extra == "child":
        layer.add_module("observer", torch.nn.Identity())
    elif extra == "expert_forward":
        expert.forward = expert.forward  # type: ignore[method-assign]  # an instance attribute now
    elif extra == "backward_hook":
        layer.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    elif extra == "bf16_layer":
        layer.to(torch.bfloat16)
    else:

        class Subclass(torch.nn.Linear):
            pass

        layer.__class__ = Subclass
    calls.clear()
    with torch.no_grad():
        if extra == "bf16_layer":  # its own forward refuses float32 inputs: not silently cast
            with pytest.raises(RuntimeError):
                grafted(**inputs)
        else:
            grafted(**inputs)
    assert calls.get("sorted_forward") == 1, calls
    assert calls.get("grouped_linear_forward", 0) <= grafted.config.num_hidden_layers - 1, calls
