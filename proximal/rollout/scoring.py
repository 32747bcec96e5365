"""Scoring responses: a frozen reward model r_ψ(x, y) (Bradley–Terry, trained by ``proximal rm``) and
rule-based reward functions (verifiers).

The total score of a response is a weighted sum of components: the reward model (if any) and any
number of Python functions ``module:function(prompts, completions) -> scores``. Each component is
also returned on its own, so a component with weight 0 is logged without being trained on (the demo
logs its gold score that way).

The reward model reads prompt + response. When its tokenizer equals the policy's, the policy's token
ids are used as they are; otherwise the prompt and response are decoded to text and re-tokenized
with the reward model's tokenizer (its chat template applied when the prompt came as messages).
"""

from __future__ import annotations

import importlib
import numbers
import os
import sys
from collections.abc import Callable

import torch

from proximal.config import ConfigError
from proximal.data.chat import apply_template, encode_prompt
from proximal.data.collate import pad_right
from proximal.models.heads import last_token_scores
from proximal.models.loading import load_sequence_scorer, load_tokenizer
from proximal.models.parallel import load_dtype, prepare_frozen
from proximal.rollout.sampling import Rollout


class RewardFunctionError(ValueError):
    """A reward function failed or returned something other than one number per completion; the
    message names the function (and the step)."""


def load_reward_function(spec: str) -> Callable[[list[str], list[str]], list[float]]:
    """Import ``module:function``; raise ConfigError naming the spec when it can't."""
    if ":" not in spec:
        raise ConfigError(f"reward function {spec!r}: expected 'module:function'")
    module, name = spec.split(":", 1)
    if (
        "" not in sys.path and os.getcwd() not in sys.path
    ):  # like `python -m`: modules beside the config work
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"reward function {spec!r}: cannot import ({e})") from e
    if not callable(fn):
        raise ConfigError(f"reward function {spec!r}: not callable")
    return fn


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
    ):
        self.policy_tokenizer = policy_tokenizer
        self.reward_model = reward_model
        self.reward_tokenizer = reward_tokenizer or policy_tokenizer
        self.reward_model_weight = reward_model_weight
        self.functions = functions or {}
        self.function_weights = function_weights or {name: 1.0 for name in self.functions}
        self.micro_batch_size = micro_batch_size
        self.reuse_ids = reward_model is not None and same_tokenizer(
            policy_tokenizer, self.reward_tokenizer
        )

    def completions(self, rollout: Rollout) -> list[str]:
        """The response texts, special tokens (EOS, pad) removed."""
        return [
            self.policy_tokenizer.decode(ids[m].tolist(), skip_special_tokens=True)
            for ids, m in zip(rollout.response_ids, rollout.response_mask)
        ]

    def _reward_model_inputs(self, rollout: Rollout, prompts: list[str], messages: list | None):
        rows = []
        if self.reuse_ids:
            for p_ids, p_m, r_ids, r_m in zip(
                rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask
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

    @torch.no_grad()
    def __call__(
        self,
        rollout: Rollout,
        prompts: list[str],
        messages: list | None = None,
        *,
        step: int | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Total score (B,) float32 and each component (B,) by name ("reward_model", function names).

        ``step`` only names the step in the message of a reward function that fails."""
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
            texts = self.completions(rollout)
            for name, fn in self.functions.items():
                components[name] = call_reward_function(name, fn, list(prompts), texts, step).to(
                    device
                )
                total = total + self.function_weights[name] * components[name]
        return total, components


def call_reward_function(
    name: str, fn: Callable, prompts: list[str], completions: list[str], step: int | None = None
) -> torch.Tensor:
    """``fn(prompts, completions)`` as a (B,) float32 tensor (NaN allowed: the trainer's
    ``rollout.nonfinite_scores`` decides); RewardFunctionError naming the function and the step when
    it raises or returns anything but one real number per completion."""
    where = f"reward function {name!r}" + (f" at step {step}" if step is not None else "")
    try:
        values = fn(prompts, completions)
    except Exception as e:  # the user's code: report it as theirs, in one line
        raise RewardFunctionError(f"{where} raised {type(e).__name__}: {e}") from e
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RewardFunctionError(
            f"{where} returned {type(values).__name__} {values!r:.60}; it must return a "
            f"list of {len(completions)} numbers, one per completion"
        )
    values = list(values.tolist() if hasattr(values, "tolist") else values)
    if len(values) != len(completions):
        raise RewardFunctionError(
            f"{where} returned {len(values)} score{'' if len(values) == 1 else 's'} for "
            f"{len(completions)} completions"
        )
    bad = [
        (i, v)
        for i, v in enumerate(values)
        if isinstance(v, bool) or not isinstance(v, numbers.Real)
    ]
    if bad:
        i, v = bad[0]
        raise RewardFunctionError(
            f"{where} returned a non-number at position {i}: {type(v).__name__} {v!r:.60}"
        )
    return torch.tensor([float(v) for v in values], dtype=torch.float32)


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
    )
