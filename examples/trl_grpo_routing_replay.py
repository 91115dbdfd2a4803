"""Routing replay in TRL's GRPO trainer: one changed line, checked token by token.

Offline and tiny: a Qwen3-MoE policy (2 MoE layers, 8 experts, top-2) built from a config, a
word-level tokenizer, four prompts and a toy reward. ``RoutingReplayGRPOTrainer`` is TRL's
``GRPOTrainer`` with the switch on: the experts the policy used while generating are recorded and
every training forward of that batch (old-policy and reference log-probs, each gradient-accumulation
micro-batch, the recompute of gradient checkpointing) sends each token to those experts again.

The script watches what the experts modules receive, per token, during generation and during the
training forwards, and ends with ``replay: exact ...`` when every real token of every training forward
went to the experts it used in the rollout; otherwise it exits with status 1.
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig

from modelgraft.integrations.trl import RoutingReplayGRPOTrainer
from modelgraft.moe import moe_layers
from modelgraft.testing import tiny_config

EOS = 1

# ---- a tiny policy and tokenizer, saved where TRL can load them (it builds the reference model from the path)
words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(3, 128)]
backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
)

config = tiny_config(
    "qwen3_moe", vocab_size=128, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[]
)
config.pad_token_id, config.eos_token_id = 0, EOS
torch.manual_seed(0)
policy = AutoModelForCausalLM.from_config(config)
with torch.no_grad():  # spread the router scores so that routing depends on the tokens
    for layer in moe_layers(policy):
        layer.router.weight.normal_(std=0.5)
folder = tempfile.mkdtemp(prefix="trl-grpo-replay-")
policy.save_pretrained(folder)
tokenizer.save_pretrained(folder)

data = Dataset.from_dict({"prompt": ["w3 w4 w5", "w6 w7", "w8 w9 w10 w11 w12", "w13"]})


def reward(completions: list[str], **_: Any) -> list[float]:
    return [float(c.count("w5")) + 0.1 * len(c.split()) for c in completions]


args = GRPOConfig(
    output_dir=f"{folder}/out",
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=5,
    max_steps=2,
    gradient_accumulation_steps=2,  # 2 micro-batches per step
    num_iterations=2,  # the batch is used twice: old-policy log-probs, weights that moved
    beta=0.04,  # a reference model
    learning_rate=5e-2,
    logging_steps=1,
    report_to="none",
    use_cpu=True,
    save_strategy="no",
    seed=0,
)

# The one changed line: RoutingReplayGRPOTrainer instead of trl.GRPOTrainer.
trainer = RoutingReplayGRPOTrainer(
    model=folder, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer
)


# ---- watch the experts: which experts each token of each forward went to ---------------------------------
class Watch:
    """Per forward of a model: input ids, mask, and per MoE layer a (tokens, experts) bool of the experts used."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.forwards: list[dict[str, Any]] = []
        self.generating = False
        self.layers = moe_layers(model)
        self.depth = 0
        model.register_forward_pre_hook(self.on_forward, with_kwargs=True)
        model.register_forward_hook(lambda *_: setattr(self, "depth", self.depth - 1))
        # the integration measures the rollout-vs-trainer mismatch with a forward of the decoder alone
        model.get_decoder().register_forward_pre_hook(self.on_decoder)
        for index, layer in enumerate(self.layers):
            layer.scope.register_forward_pre_hook(
                lambda m, a, k, i=index: self.on_block(i, a, k), with_kwargs=True
            )
            block = model.get_submodule(
                layer.name.rpartition(".")[0]
            )  # the MoE block holding router and experts
            experts = block.get_submodule("experts")
            if isinstance(
                experts, torch.nn.ModuleList
            ):  # transformers 4.57: each expert gets its tokens' rows
                for e, expert in enumerate(experts):
                    expert.register_forward_pre_hook(lambda m, a, i=index, e=e: self.on_rows(i, e, a[0]))
            else:  # transformers 5: the experts module gets the (tokens, top_k) expert ids
                experts.register_forward_pre_hook(
                    lambda m, a, k, i=index: self.on_ids(i, a, k), with_kwargs=True
                )

    def on_decoder(self, module: Any, args: tuple) -> None:
        if self.depth == 0:
            self.forwards.append({"skip": True, "experts": {}})

    def on_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.depth += 1
        # TRL's training log-prob forwards pass `fused_lm_head`; generate's forwards run inside generate
        if self.generating or kwargs.get("fused_lm_head"):
            ids = kwargs["input_ids"]
            self.forwards.append(
                {"generate": self.generating, "ids": ids, "mask": kwargs.get("attention_mask"), "experts": {}}
            )
        else:
            self.forwards.append({"skip": True, "experts": {}})

    def on_block(self, index: int, args: tuple, kwargs: dict) -> None:
        hidden = (args or tuple(kwargs.values()))[0]
        hidden = hidden.detach().reshape(-1, hidden.shape[-1])
        experts = torch.zeros(hidden.shape[0], self.layers[index].num_experts, dtype=torch.bool)
        self.forwards[-1]["experts"].setdefault(index, []).append((hidden, experts))

    def on_ids(self, index: int, args: tuple, kwargs: dict) -> None:
        k = self.layers[index].top_k
        ids = next(t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and not t.is_floating_point())
        _, experts = self.forwards[-1]["experts"][index][-1]
        experts.scatter_(1, ids.reshape(-1, k).long(), True)

    def on_rows(self, index: int, expert: int, rows: torch.Tensor) -> None:
        hidden, experts = self.forwards[-1]["experts"][index][-1]
        for row in rows.detach().reshape(-1, rows.shape[-1]):
            experts[:, expert] |= (hidden == row).all(-1)

    def used(self, forward: dict[str, Any], index: int) -> torch.Tensor:
        """(batch, seq, experts): the first call of the layer in that forward (a recompute calls it again)."""
        calls = forward["experts"][index]
        for _, again in calls[1:]:  # gradient checkpointing's recompute must route the same way
            assert torch.equal(again, calls[0][1]), "a recompute sent tokens to other experts"
        return calls[0][1].reshape(*forward["ids"].shape, -1)


watch = Watch(trainer.model)
generate = trainer.model.generate


def watched_generate(*a: Any, **kw: Any) -> Any:
    watch.generating, start = True, len(watch.forwards)
    out = generate(*a, **kw)
    watch.generating = False
    rollouts.append((watch.forwards[start:], kw["attention_mask"], out))
    return out


rollouts: list[Any] = []
trainer.model.generate = watched_generate
trainer.train()

# ---- the rollout's experts per completion: the prompt forward, then one token per step -----------------------
layers = range(len(watch.layers))
reference: dict[tuple[int, ...], list[torch.Tensor]] = {}
for forwards, prompt_mask, sequences in rollouts:
    routed = [torch.cat([watch.used(f, i) for f in forwards], dim=1) for i in layers]
    width = prompt_mask.shape[1]
    for b, row in enumerate(sequences.tolist()):
        real = [j for j in range(width) if prompt_mask[b, j]]
        for j in range(width, len(row)):
            real.append(j)
            if row[j] == EOS:
                break
        seen = [
            j for j in real if j < routed[0].shape[1]
        ]  # the last sampled token never ran through the model
        reference[tuple(row[j] for j in real)] = [r[b, seen] for r in routed]

# ---- every training forward: each real token against the rollout ------------------------------------------
checked = differing = 0
training = [f for f in watch.forwards if not f.get("skip") and not f["generate"]]
for forward in training:
    used = [watch.used(forward, i) for i in layers]
    for row in range(forward["ids"].shape[0]):
        real = forward["mask"][row].nonzero().reshape(-1)
        rollout = reference[tuple(forward["ids"][row, real].tolist())]
        n = rollout[0].shape[0]
        for i in layers:
            same = (used[i][row, real[:n]] == rollout[i]).all(-1)
            checked += same.numel()
            differing += int((~same).sum())

mismatch = [h["routing/mismatch_rate"] for h in trainer.state.log_history if "routing/mismatch_rate" in h]
print(
    f"training forwards checked: {len(training)} (old-policy log-probs in 2 chunks, 2 steps x 2 micro-batches)"
)
print(f"rollout vs trainer routing before replay: {100 * mismatch[0]:.1f}% of token routes differ")
if checked and not differing:
    print(
        f"replay: exact ({checked} token routes in {len(training)} training forwards used the rollout's experts)"
    )
else:
    print(f"replay: NOT exact ({differing} of {checked} token routes used other experts)")
    sys.exit(1)
