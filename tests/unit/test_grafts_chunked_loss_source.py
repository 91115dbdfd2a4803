"""Reading a causal-LM forward's head from its source: what is recognised, and what is refused.

The synthetic forwards below are never run; only their source is read.

Unit tests of ``modelgraft.grafts._lm_head_source`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import pytest
import transformers

from modelgraft.grafts import UnsupportedFamilyError
from modelgraft.grafts._lm_head_source import HeadSpec, read_head

# ruff: noqa: F821  (the synthetic forwards name things they never run)


class _LlamaLike:
    def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states[:, slice(-logits_to_keep, None), :])
        loss = None
        if labels is not None:
            loss = self.loss_function(  # formatting and comments do not matter
                logits,
                labels,
                vocab_size=self.config.vocab_size,
                **kwargs,
            )
        return Output(loss=loss, logits=logits, past_key_values=outputs.past_key_values)


class _ScaledSoftcappedMoe:
    def forward(self, input_ids=None, labels=None, output_router_logits=None, return_dict=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs[0])
        logits = logits * self.logit_scale
        if self.config.final_logit_softcapping is not None:
            logits = logits / self.config.final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * self.config.final_logit_softcapping
        loss = None
        if labels is not None:
            logits = logits.float()
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size, **kwargs)
        aux_loss = None
        if output_router_logits:
            aux_loss = load_balancing_loss_func(
                outputs.router_logits if return_dict else outputs[-1],
                self.num_experts,
                self.num_experts_per_tok,
                attention_mask,
            )
            if labels is not None:
                loss += self.router_aux_loss_coef * aux_loss.to(loss.device)
        if not return_dict:
            return (loss, logits)
        return Output(loss=loss, aux_loss=aux_loss, logits=logits, router_logits=outputs.router_logits)


def test_a_plain_head_is_recognised() -> None:
    assert read_head(_LlamaLike) == HeadSpec(vocab_attr="config.vocab_size")


def test_scale_softcap_upcast_aux_loss_and_tuple_output_are_recognised() -> None:
    assert read_head(_ScaledSoftcappedMoe) == HeadSpec(
        vocab_attr="vocab_size",
        scale_op="mul",
        scale_attr="logit_scale",
        softcap_attr="config.final_logit_softcapping",
        aux_loss=True,
        return_dict_param=True,
    )


class _ExtraTransform:
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        logits = logits + self.logit_bias
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return Output(loss=loss, logits=logits)


class _LabelsBeforeHead:
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, labels=labels, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return Output(loss=loss, logits=logits)


class _HeadTwice:
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        extra = self.lm_head(outputs.hidden_states[-2])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return Output(loss=loss, logits=logits + extra)


class _LossArgument:
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits, labels, self.vocab_size, pad_token_id=self.config.pad_token_id, **kwargs
            )
        return Output(loss=loss, logits=logits)


class _ReturnsChangedLogits:
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return Output(loss=loss, logits=logits.float(), scores=logits.softmax(-1))


class _NoLoss:
    def forward(self, input_ids=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        return Output(logits=logits)


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (
            _ExtraTransform,
            r"`_ExtraTransform.forward` does `logits = logits \+ self.logit_bias` after `lm_head`",
        ),
        (_LabelsBeforeHead, r"uses `labels` before `lm_head`"),
        (_HeadTwice, r"does not call `lm_head` exactly once"),
        (_LossArgument, r"does `if labels is not None:` after `lm_head`"),
        (_ReturnsChangedLogits, r"returns `logits=logits.float\(\)`, `scores=logits.softmax\(-1\)`"),
        (_NoLoss, r"does `return Output\(logits=logits\)` after `lm_head`"),
    ],
    ids=[
        "unknown-transform",
        "labels-before-head",
        "head-twice",
        "extra-loss-argument",
        "changed-return",
        "no-loss",
    ],
)
def test_anything_else_is_refused_with_the_statement_quoted(cls, message) -> None:
    with pytest.raises(UnsupportedFamilyError, match=message):
        read_head(cls)


def test_a_forward_without_source_is_refused() -> None:
    namespace: dict = {}
    exec("def forward(self, labels=None):\n    return self.lm_head(labels)\n", namespace)
    cls = type("Generated", (), {"forward": namespace["forward"]})
    with pytest.raises(UnsupportedFamilyError, match=r"The source of `Generated.forward` is not available"):
        read_head(cls)


@pytest.mark.parametrize(
    ("class_name", "expected"),
    [
        ("LlamaForCausalLM", {"scale_op": None, "softcap_attr": None, "aux_loss": False}),
        ("Gemma2ForCausalLM", {"softcap_attr": "config.final_logit_softcapping", "vocab_attr": "vocab_size"}),
        ("CohereForCausalLM", {"scale_op": "mul", "scale_attr": "logit_scale"}),
        ("GraniteForCausalLM", {"scale_op": "div", "scale_attr": "config.logits_scaling"}),
        ("GraniteMoeForCausalLM", {"scale_op": "div", "aux_loss": True}),
        ("MixtralForCausalLM", {"aux_loss": True, "vocab_attr": "vocab_size"}),
        ("DeepseekV3ForCausalLM", {"aux_loss": False}),
    ],
)
def test_installed_transformers_heads(class_name, expected) -> None:
    spec = read_head(getattr(transformers, class_name))
    assert {key: getattr(spec, key) for key in expected} == expected


def test_families_the_installed_transformers_writes_otherwise_are_refused() -> None:
    # OPT calls `self.lm_head(...).contiguous()`; XGLM passes `pad_token_id` to the loss function.
    with pytest.raises(
        UnsupportedFamilyError, match=r"`OPTForCausalLM.forward` does not call `lm_head` exactly once"
    ):
        read_head(transformers.OPTForCausalLM)
    with pytest.raises(
        UnsupportedFamilyError, match=r"`XGLMForCausalLM.forward` does `if labels is not None:`"
    ):
        read_head(transformers.XGLMForCausalLM)
