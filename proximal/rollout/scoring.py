"""Scoring responses: a frozen reward model r_ψ(x, y) (Bradley–Terry, trained by ``proximal rm``) and
rule-based reward functions (verifiers).

The total score of a response is a weighted sum of components: the reward model (if any) and any
number of reward functions. Each component is also returned on its own, so a component with weight
0 is logged without being trained on (the demo logs its gold score that way).

The reward model reads prompt + response. When its tokenizer equals the policy's, the policy's token
ids are used as they are; otherwise the prompt and response are decoded to text and re-tokenized
with the reward model's tokenizer (its chat template applied when the prompt came as messages).

**Reward functions** are called by :mod:`proximal.rollout.reward_functions` (TRL's convention, the
async loop, the time limit); the scorer hands them their arguments and adds up what they return.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from proximal import dist
from proximal.data.chat import apply_template, encode_prompt
from proximal.data.collate import pad_right
from proximal.models.heads import last_token_scores
from proximal.models.loading import load_sequence_scorer, load_tokenizer
from proximal.models.parallel import load_dtype, prepare_frozen
from proximal.rollout.reward_functions import (
    DEFAULT_TIMEOUT_S,
    TrainerState,
    call_reward_functions,
    column_lists,
)
from proximal.rollout.sampling import Rollout

NAN = float("nan")


def same_tokenizer(a, b) -> bool:
    """True when two tokenizers map text to the same ids (same vocabulary and special tokens)."""
    return (
        a.get_vocab() == b.get_vocab()
        and a.eos_token_id == b.eos_token_id
        and a.bos_token_id == b.bos_token_id
    )


class Scorer:
    """Weighted sum of a reward model's score and reward functions' scores for a batch of rollouts."""

    def __init__(
        self,
        policy_tokenizer,
        *,
        reward_model=None,
        reward_tokenizer=None,
        reward_model_weight=1.0,
        functions: dict[str, Callable] | None = None,
        function_weights: dict[str, float] | None = None,
        micro_batch_size: int = 8,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ):
        self.policy_tokenizer = policy_tokenizer
        self.reward_model = reward_model
        self.reward_tokenizer = reward_tokenizer or policy_tokenizer
        self.reward_model_weight = reward_model_weight
        self.functions = functions or {}
        self.function_weights = function_weights or {name: 1.0 for name in self.functions}
        self.micro_batch_size = micro_batch_size
        self.timeout_s = timeout_s
        self.reuse_ids = reward_model is not None and same_tokenizer(
            policy_tokenizer, self.reward_tokenizer
        )

    def completions(self, rollout: Rollout) -> list[str]:
        """The response texts, special tokens (EOS, pad) removed: every real token, so a multi-turn
        response's observations too (``Rollout.real_mask``)."""
        return [
            self.policy_tokenizer.decode(ids[m].tolist(), skip_special_tokens=True)
            for ids, m in zip(rollout.response_ids, rollout.real_mask)
        ]

    def _reward_model_inputs(self, rollout: Rollout, prompts: list[str], messages: list | None):
        rows = []
        if self.reuse_ids:
            for p_ids, p_m, r_ids, r_m in zip(
                rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.real_mask
            ):
                rows.append(p_ids[p_m.bool()].tolist() + r_ids[r_m].tolist())
        else:
            tok = self.reward_tokenizer
            texts = self.completions(rollout)
            for i, (prompt, completion) in enumerate(zip(prompts, texts)):
                # The layout the reward trainer uses: prompt ids (the reward model's own chat template
                # with the generation prompt, when the prompt came as messages), response ids, EOS.
                msgs = messages[i] if messages else None
                if msgs and getattr(tok, "chat_template", None):
                    prompt = apply_template(list(msgs), tok, f"prompt {i}")
                ids = (
                    encode_prompt(prompt, tok) + tok(completion, add_special_tokens=False).input_ids
                )
                if bool(rollout.ended[i]) and tok.eos_token_id is not None:
                    ids = ids + [tok.eos_token_id]
                rows.append(ids)
        return rows

    def function_arguments(
        self,
        rollout: Rollout,
        prompts: list[str],
        messages: list | None = None,
        columns: Sequence[Mapping[str, Any]] | None = None,
        step: int | None = None,
        completions: list | None = None,
    ) -> dict[str, Any]:
        """Everything a reward function may be given for this rollout (:data:`PASSED` and the columns),
        one entry per completion: a conversational row's prompt as its messages and its completion as
        ``[{"role": "assistant", "content": text}]``, TRL's form (``completions``: given as they are
        instead — a multi-turn trajectory's, :mod:`proximal.agents.collect`); ``completion_ids`` the
        response's tokens, the stop token included (a multi-turn one's observations too)."""
        texts = self.completions(rollout)
        messages = messages if messages is not None else [None] * len(texts)
        if completions is None:
            completions = [
                t if m is None else [{"role": "assistant", "content": t}]
                for t, m in zip(texts, messages)
            ]
        return {
            "prompts": [p if m is None else m for p, m in zip(prompts, messages)],
            "completions": completions,
            "completion_ids": [
                ids[m].tolist() for ids, m in zip(rollout.response_ids, rollout.real_mask)
            ],
            **column_lists(columns, len(texts)),
            "step": step,
            "trainer_state": TrainerState(step),
        }

    @torch.no_grad()
    def __call__(
        self,
        rollout: Rollout,
        prompts: list[str],
        messages: list | None = None,
        *,
        columns: Sequence[Mapping[str, Any]] | None = None,
        step: int | None = None,
        completions: list | None = None,
        scored_elsewhere: bool = False,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Total score (B,) float32 and each component (B,) by name ("reward_model", function names;
        NaN where a function returned None — :func:`score_metrics` reads them). A row that no source
        scored has a NaN total, unless ``scored_elsewhere`` (another source the caller adds, an
        environment's reward, scores every row: the functions' part is then 0).

        ``prompts``: the rendered prompt texts; ``messages``: each row's messages (None for a text
        prompt); ``columns``: each row's other fields, handed to the reward functions as keywords;
        ``step``: the step, handed to them and named in a failing function's message;
        ``completions``: what the reward functions get as completions, when not the decoded
        responses (a multi-turn trajectory's text or messages)."""
        device = rollout.response_ids.device
        components: dict[str, torch.Tensor] = {}
        total = torch.zeros(len(rollout), dtype=torch.float32, device=device)
        if self.reward_model is not None:
            rows = self._reward_model_inputs(rollout, prompts, messages)
            pad = self.reward_tokenizer.pad_token_id
            scores = []
            for i in range(0, len(rows), self.micro_batch_size):
                ids, mask = pad_right(rows[i : i + self.micro_batch_size], pad, device)
                scores.append(last_token_scores(self.reward_model, ids, mask).float())
            components["reward_model"] = torch.cat(scores)
            total = total + self.reward_model_weight * components["reward_model"]
        if self.functions:
            values = self.function_arguments(
                rollout, list(prompts), messages, columns, step, completions
            )
            scores, scored = call_reward_functions(
                self.functions, values, n=len(rollout), step=step, timeout_s=self.timeout_s
            )
            # TRL's rule: a row's total is the weighted sum over the functions that scored it (None:
            # does not apply); a NaN a function returned stays NaN. A row that no source scored has
            # no score (NaN: rollout.nonfinite_scores decides, where TRL would train on 0).
            anyone = torch.zeros(len(rollout), dtype=torch.bool, device=device)
            for name, score in scores.items():
                components[name] = score.to(device)
                ok = scored[name].to(device)
                total = total + torch.where(ok, self.function_weights[name] * components[name], 0.0)
                anyone = anyone | ok
            if self.reward_model is None and not scored_elsewhere:
                total = torch.where(anyone, total, NAN)
        return total, components


def score_metrics(
    components: Mapping[str, torch.Tensor], valid: torch.Tensor, functions: Sequence[str] = ()
) -> dict[str, float]:
    """``score/<name>``: each component's mean over the rows trained on (``valid``: a finite total)
    that it scored, over every process; and for each reward function of ``functions``
    ``score/<name>_count``, how many rows that is. (On a row with a finite total every component
    that scored it is finite, so a non-finite component there is one that returned None.)"""
    metrics: dict[str, float] = {}
    for name, values in components.items():
        w = (valid & torch.isfinite(values)).float()
        metrics[f"score/{name}"] = dist.global_mean(values, w)
        if name in functions:
            metrics[f"score/{name}_count"] = int(dist.global_sum(w.sum(), w.device))
    return metrics


def build_scorer(
    policy_tokenizer,
    *,
    reward_model: str | None,
    reward_model_weight: float,
    functions: dict,
    function_weights: dict[str, float],
    precision: str,
    device: torch.device,
    world_size: int,
    frozen_sharding: str = "shard",
    micro_batch_size: int = 8,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> Scorer:
    """The frozen reward model (if any) loaded, checked, placed and (several processes) sharded, with
    the reward functions, as one :class:`Scorer`."""
    model = tokenizer = None
    if reward_model is not None:
        tokenizer = load_tokenizer(
            reward_model, role="reward-model tokenizer (model.reward_model)", padding_side="right"
        )
        model = load_sequence_scorer(
            reward_model,
            role="reward model (model.reward_model)",
            dtype=load_dtype(precision, trained=False),
            pad_token_id=tokenizer.pad_token_id,
        )
        prepare_frozen(model, device=device, world_size=world_size, sharding=frozen_sharding)
    return Scorer(
        policy_tokenizer,
        reward_model=model,
        reward_tokenizer=tokenizer,
        reward_model_weight=reward_model_weight,
        functions=functions,
        function_weights=function_weights,
        micro_batch_size=micro_batch_size,
        timeout_s=timeout_s,
    )
