"""Record and replay through the wrappers users put around a model (issue 28, point 1).

``record_routing(wrapper)`` around ``wrapper.generate(...)`` must lay the trace out per sequence
(``batch_size`` set) although generation runs the inner model, and ``replay_routing(wrapper, trace)``
must then force, in one forward over ``sequences[:, :-1]``, exactly the experts generate used. Each
wrapper is checked against the plain model: the same ids (LoRA starts with ``lora_B = 0``, so the
wrapped model computes what the plain one does), the same shapes, and the experts' own inputs in the
replayed forward. A trace that has no batch layout is refused for a batched forward.

Wrappers: PEFT's ``PeftModel`` and its ``LoraModel``, ``torch.compile``'s ``OptimizedModule``
(backend ``eager``), DistributedDataParallel and FSDP on a one-process gloo group, accelerate's prepared
model and TRL's ``unwrap_model_for_generation``, and stacks of them.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moe_helpers import ExpertInputs
from transformers import AutoModelForCausalLM

from families import family_params
from modelgraft import RoutingError
from modelgraft.moe import RoutingTrace, moe_layers, record_routing, replay_routing
from modelgraft.moe._layers import wrapper_chain

peft = pytest.importorskip("peft")

PAD = 0
PROMPTS = [[5, 17, 33, 9, 4], [12, 7, 91], [3, 66, 21, 8]]  # left-padded to 5
NEW_TOKENS = 4
MODEL_TYPES = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module", params=family_params(kinds={"moe"}, model_types=MODEL_TYPES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny MoE with spread routers (so tokens route differently), saved with ``save_pretrained``."""
    family = request.param
    model = family.causal_lm(pad_token_id=PAD)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in moe_layers(model):
            for tensor in [*layer.router.parameters(), *layer.router.buffers()]:
                if tensor.is_floating_point():
                    tensor.copy_(torch.randn(tensor.shape, generator=gen))
    model.generation_config.pad_token_id = PAD
    folder = tmp_path_factory.mktemp(family.model_type)
    model.save_pretrained(folder)
    return str(folder)


def _load(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def gloo() -> Iterator[None]:
    """A one-process gloo group, for DistributedDataParallel on CPU."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---- the wrappers -------------------------------------------------------------------------------------
def _peft(model: torch.nn.Module) -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, config).eval()


def _lora_model(model: torch.nn.Module) -> torch.nn.Module:
    return _peft(model).base_model  # peft's LoraModel (a BaseTuner around the model)


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    return torch.compile(model, backend="eager")


def _ddp(model: torch.nn.Module) -> torch.nn.Module:
    return torch.nn.parallel.DistributedDataParallel(model)


def _fsdp(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)


def _accelerate(model: torch.nn.Module) -> torch.nn.Module:
    from accelerate import Accelerator

    return Accelerator(cpu=True).prepare_model(model, evaluation_mode=True)


WRAPPERS: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {
    "peft": _peft,
    "lora_model": _lora_model,
    "compile": _compiled,
    "ddp": _ddp,
    "fsdp": _fsdp,
    "accelerate": _accelerate,
    "compile(peft)": lambda m: _compiled(_peft(m)),
    "ddp(peft)": lambda m: _ddp(_peft(m)),
}
NEEDS_GLOO = {"ddp", "ddp(peft)", "fsdp"}


def _wrap(name: str, model: torch.nn.Module, request: pytest.FixtureRequest) -> torch.nn.Module:
    if name in NEEDS_GLOO:
        request.getfixturevalue("gloo")
    return WRAPPERS[name](model)


# ---- generate, then the training forward ----------------------------------------------------------------
def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    return ids, mask


def _generate(model: Any) -> torch.Tensor:
    """``model.generate``; DDP and FSDP wrappers have none: their ``.module``'s, as users call it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    ids, mask = _prompts()
    ddp = (torch.nn.parallel.DistributedDataParallel, FullyShardedDataParallel)
    generating = model.module if isinstance(model, ddp) else model
    out = generating.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=PAD,
    )
    return getattr(out, "sequences", out)


def _training_batch(sequences: torch.Tensor) -> dict[str, torch.Tensor]:
    """The forward a trainer runs on generate's output: prompt + completion, minus the last token."""
    _, prompt_mask = _prompts()
    length = sequences.shape[1] - 1
    mask = torch.cat(
        [prompt_mask, torch.ones(len(PROMPTS), length - prompt_mask.shape[1], dtype=torch.long)], 1
    )
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": sequences[:, :-1], "attention_mask": mask, "position_ids": positions}


def _reference(path: str) -> tuple[torch.Tensor, RoutingTrace]:
    """What the plain model generates and the trace it records (laid out per sequence)."""
    plain = _load(path)
    with record_routing(plain) as trace, torch.no_grad():
        sequences = _generate(plain)
    assert trace.batch_size == len(PROMPTS)
    return sequences, trace


def _shifted(trace: RoutingTrace) -> RoutingTrace:
    """Other experts than the router's ((id + 1) mod experts keeps each row distinct): a replay that
    did not force them would be seen."""
    return trace._copy(
        [((t.long() + 1) % trace.num_experts).to(t.dtype) for t in trace.layers], trace.batch_size
    )


def _assert_same_routes(got: RoutingTrace, expected: RoutingTrace) -> None:
    assert got.batch_size == expected.batch_size
    assert got.layer_names == expected.layer_names
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b), f"{int((a != b).any(-1).sum())} of {a.shape[0]} rows differ"


def _compiled_inside(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in model.modules())


def _replayed(model: torch.nn.Module, trace: RoutingTrace, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits of one forward of ``model`` replaying ``trace``; the experts' inputs are checked
    too where they can be seen (torch.compile does not call hooks added after it compiled)."""
    with contextlib.ExitStack() as stack:
        received = None if _compiled_inside(model) else stack.enter_context(ExpertInputs(model))
        stack.enter_context(replay_routing(model, trace))
        stack.enter_context(torch.no_grad())
        logits = model(**inputs, use_cache=False).logits
    if received is not None:
        received.assert_matches(trace)
    return logits


def _assert_replays(
    wrapped: torch.nn.Module, trace: RoutingTrace, sequences: torch.Tensor, path: str
) -> None:
    """One forward of the wrapper over ``sequences[:, :-1]`` computes what the plain model computes
    with the trace's experts (checked on its experts' inputs), and predicts the tokens generate chose."""
    inputs = _training_batch(sequences)
    logits = _replayed(wrapped, trace, inputs)
    assert torch.equal(logits, _replayed(_load(path), trace, inputs))
    prompt = _prompts()[0].shape[1]
    assert torch.isfinite(logits).all()
    assert torch.equal(logits[:, prompt - 1 :].argmax(-1), sequences[:, prompt:])


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_generate_through_a_wrapper_records_the_plain_models_layout(
    checkpoint: str, wrapper: str, request: pytest.FixtureRequest
) -> None:
    sequences, expected = _reference(checkpoint)
    wrapped = _wrap(wrapper, _load(checkpoint), request)
    with record_routing(wrapped) as trace, torch.no_grad():
        got = _generate(wrapped)
    assert torch.equal(got, sequences)
    _assert_same_routes(trace, expected)
    _assert_replays(wrapped, trace, sequences, checkpoint)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_forward_through_a_wrapper_records_and_replays_exactly(
    checkpoint: str, wrapper: str, request: pytest.FixtureRequest
) -> None:
    inputs = _training_batch(_reference(checkpoint)[0])
    plain = _load(checkpoint)
    with record_routing(plain) as expected, torch.no_grad():
        plain(**inputs, use_cache=False)
    wrapped = _wrap(wrapper, _load(checkpoint), request)
    with record_routing(wrapped) as trace, torch.no_grad():
        wrapped(**inputs, use_cache=False)
    _assert_same_routes(trace, expected)
    assert torch.equal(_replayed(wrapped, trace, inputs), _replayed(plain, trace, inputs))


def test_trls_unwrap_model_for_generation_records_per_sequence(checkpoint: str) -> None:
    from accelerate import Accelerator
    from trl.models import unwrap_model_for_generation

    sequences, expected = _reference(checkpoint)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare_model(_peft(_load(checkpoint)), evaluation_mode=True)
    with unwrap_model_for_generation(model, accelerator) as unwrapped:
        with record_routing(unwrapped) as trace, torch.no_grad():
            assert torch.equal(_generate(unwrapped), sequences)
    _assert_same_routes(trace, expected)
    _assert_replays(model, trace, sequences, checkpoint)


def test_a_model_compiled_before_the_block_is_forced_inside_and_live_after(checkpoint: str) -> None:
    """Graphs compiled outside a block must not keep the block's routes, nor skip them."""
    inputs = _training_batch(_reference(checkpoint)[0])
    plain, compiled = _load(checkpoint), _compiled(_load(checkpoint))
    with torch.no_grad():
        live = compiled(**inputs, use_cache=False).logits  # compiled here, outside any block
        assert torch.equal(live, plain(**inputs, use_cache=False).logits)
        with record_routing(plain) as recorded:
            plain(**inputs, use_cache=False)
    shifted = _shifted(recorded)
    forced = _replayed(compiled, shifted, inputs)
    assert torch.equal(forced, _replayed(plain, shifted, inputs))
    assert not torch.equal(forced, live)
    with torch.no_grad():
        assert torch.equal(compiled(**inputs, use_cache=False).logits, live)
    with record_routing(compiled) as again, torch.no_grad():
        compiled(**inputs, use_cache=False)
    _assert_same_routes(again, recorded)


# ---- a trace without a batch layout -------------------------------------------------------------------
def test_a_trace_without_batch_layout_is_refused_for_a_batched_forward(checkpoint: str) -> None:
    """Two forwards of other lengths concatenate in call order: no batched forward has that layout."""
    model = _load(checkpoint)
    ids, _ = _prompts()
    with record_routing(model) as trace, torch.no_grad():
        model(input_ids=ids[:2, :4], use_cache=False)  # 8 rows
        model(input_ids=ids[2:, :], use_cache=False)  # 5 rows
    assert trace.batch_size is None and trace.num_tokens == 13
    assert trace.layers[0].shape[0] == 13
    # 13 rows are a (1, 13) forward only: one sequence, which is call order. A batch of the same
    # row count would take rows of one sequence for another's, so it is refused.
    same_rows = torch.tensor([PROMPTS[0] * 2 + PROMPTS[1][:3]])
    with replay_routing(model, trace), torch.no_grad():
        model(input_ids=same_rows, use_cache=False)
    with record_routing(model) as trace, torch.no_grad():
        model(input_ids=ids[:2, :3], use_cache=False)  # 6 rows
        model(input_ids=ids[2:, :2], use_cache=False)  # 2 rows
    with pytest.raises(RoutingError, match=r"no batch layout.*2 sequences of 4 positions.*batch_size=2"):
        with replay_routing(model, trace), torch.no_grad():
            model(input_ids=ids[:2, :4], use_cache=False)


# ---- drawn combinations -------------------------------------------------------------------------------
#: ``two_forwards`` records the batch as two forwards (call order, no batch layout): refused.
ENTRY_POINTS = ["forward", "generate", "micro_batch", "train_step", "two_forwards"]


def _train_step(model: torch.nn.Module, trace: RoutingTrace, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """A trainer's step under replay: training mode, gradient checkpointing, loss and backward inside
    the block (the recompute routes again); returns the logits."""
    inner = wrapper_chain(model)[-1]
    inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with replay_routing(model, trace):
        logits = model(**inputs, use_cache=False).logits
        logits.float().logsumexp(-1).mean().backward()
    return logits.detach()


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    record_wrapper=st.sampled_from(["plain", *WRAPPERS]),
    replay_wrapper=st.sampled_from(["plain", *WRAPPERS]),
    entry=st.sampled_from(ENTRY_POINTS),
)
def test_drawn_wrappers_and_entry_points_are_exact_or_refused(
    checkpoint: str, record_wrapper: str, replay_wrapper: str, entry: str, request: pytest.FixtureRequest
) -> None:
    sequences, expected = _reference(checkpoint)
    inputs = _training_batch(sequences)

    def wrap(name: str) -> torch.nn.Module:
        model = _load(checkpoint)
        return model if name == "plain" else _wrap(name, model, request)

    recorder = wrap(record_wrapper)
    with record_routing(recorder) as trace, torch.no_grad():
        if entry == "generate":
            assert torch.equal(_generate(recorder), sequences)
        elif entry == "two_forwards":
            recorder(**{k: v[:1] for k, v in inputs.items()}, use_cache=False)
            recorder(**{k: v[1:] for k, v in inputs.items()}, use_cache=False)
        else:
            recorder(**inputs, use_cache=False)
    if entry == "two_forwards":
        assert trace.batch_size is None
        replayer = wrap(replay_wrapper)
        with pytest.raises(RoutingError, match=r"no batch layout"):
            with replay_routing(replayer, trace), torch.no_grad():
                replayer(**inputs, use_cache=False)
        return
    if entry == "generate":
        _assert_same_routes(trace, expected)
    assert trace.batch_size == len(PROMPTS)
    trace = _shifted(trace)
    replayer, plain = wrap(replay_wrapper), _load(checkpoint)
    if entry == "train_step":
        got, want = _train_step(replayer, trace, inputs), _train_step(plain, trace, inputs)
        assert torch.isfinite(got).all() and torch.equal(got, want)
        return
    if entry != "micro_batch":
        assert torch.equal(_replayed(replayer, trace, inputs), _replayed(plain, trace, inputs))
        return
    parts = ([2], [0, 1])
    outputs = []
    for model in (replayer, plain):
        with replay_routing(model, trace) as session, torch.no_grad():
            for part in parts:
                with session.micro_batch(part):
                    outputs.append(model(**{k: v[part] for k, v in inputs.items()}, use_cache=False).logits)
    for got, want in zip(outputs[: len(parts)], outputs[len(parts) :], strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, want)
    # The plain model's micro-batches get the trace's rows of their sequences.
    with ExpertInputs(plain) as received, replay_routing(plain, trace) as session, torch.no_grad():
        for part in parts:
            with session.micro_batch(part) as sub:
                received.clear()
                plain(**{k: v[part] for k, v in inputs.items()}, use_cache=False)
                received.assert_matches(sub)
