"""Steps 1–3 of every online method: a global batch of prompts, responses sampled from the policy,
their scores — this rank's share of it.

PPO, GRPO and RLOO differ in what they do with a scored rollout, not in how they get one; this is
the one place they get it. With ``group_size`` G > 1 every prompt is answered G times (GRPO's
group, RLOO's k samples): rows b·G … b·G + G − 1 answer prompt b. A rank takes whole prompts, so a
group never splits across ranks and its statistics need no reduction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from proximal import dist
from proximal.config import ConfigError
from proximal.data.chat import set_chat_template
from proximal.data.collate import pad_left
from proximal.data.prompts import load_prompts
from proximal.models.loading import load_tokenizer
from proximal.rollout.engine import RolloutEngine, row_seed
from proximal.rollout.sampling import Rollout, sample
from proximal.rollout.scoring import Scorer, load_reward_functions, reward_argument_problems


@dataclass
class Collected:
    """A scored rollout: this rank's rows of the step's global batch."""

    rollout: Rollout
    prompts: list[str]  # (B,) prompt texts, one per row (repeated within a group)
    scores: torch.Tensor  # (B,) total score, float32 (penalty included; may be non-finite)
    components: dict[str, torch.Tensor]  # each reward source's (B,) score
    valid: torch.Tensor  # (B,) bool: finite score (rows to train on)
    positions: list[int]  # each row's index in the global batch of rows
    generate_s: float  # seconds spent generating

    def nonfinite_rows(self) -> int:
        """This rank's rows left out of training for a non-finite score."""
        return int((~self.valid).sum())


def load_inputs(
    reward_functions: list,
    prompts_path: str,
    policy_path: str,
    *,
    max_prompt_length: int,
    on_long_prompt: str,
    on_empty_prompt: str,
    chat_template: str | None = None,
    split: str | None = None,
    columns: dict[str, str] | None = None,
    tools=None,
):
    """``(functions, prompt_set)`` of an online run, loaded before any model so that a mistake in
    either is reported first: each ``module:function`` reward function imported, a callable taken as
    it is (:func:`~proximal.rollout.scoring.load_reward_functions`: ``{name: function}``), the
    prompts rendered and tokenised with the policy's tokenizer
    (:func:`~proximal.data.prompts.load_prompts`; ``tools``, an agent run's, gives each row's tool
    schemas), and every argument a function requires found among the prompts' columns
    (ConfigError naming the function, the argument and the file)."""
    functions = load_reward_functions(reward_functions)
    tokenizer = load_tokenizer(policy_path, role="policy tokenizer (model.path)")
    set_chat_template(tokenizer, chat_template)  # the policy tokenizer gets it too (build_models)
    prompt_set = load_prompts(
        prompts_path,
        tokenizer,
        max_length=max_prompt_length,
        on_too_long=on_long_prompt,
        on_empty=on_empty_prompt,
        split=split,
        columns=columns,
        tools=tools,
    )
    problems = reward_argument_problems(functions, prompt_set.column_names(), str(prompts_path))
    if problems:
        raise ConfigError(problems[0])
    return functions, prompt_set


def collect(
    step: int,
    *,
    prompt_set,
    sampler,
    engine: RolloutEngine,
    scorer: Scorer,
    tokenizer,
    seed: int,
    device: torch.device,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: list[int] | None = None,
    stop_strings: list[str] | None = None,
    missing_eos_penalty: float | None = None,
    nonfinite: str = "skip",
    group_size: int = 1,
) -> Collected:
    """Take the next global batch of prompts from ``sampler``, sample ``group_size`` responses to each
    of this rank's prompts, score them, and guard non-finite scores (:func:`finite_rows`).

    Row r of the global batch draws its tokens from a generator seeded by (seed, step, r), so the
    rollout is the same on any number of processes (:mod:`proximal.rollout.engine`). The engine's
    log-probabilities of the sampled tokens, log μ, come with it (``rollout.behaviour_logprobs``).
    """
    t0 = time.perf_counter()
    batch = sampler.next_global_batch()
    mine = sampler.local_part(list(range(len(batch))))  # this rank's prompt positions
    positions = [p * group_size + j for p in mine for j in range(group_size)]
    idx = [batch[p] for p in mine for _ in range(group_size)]
    prompt_ids, prompt_mask = pad_left(
        [prompt_set.token_ids[i] for i in idx], tokenizer.pad_token_id, device
    )
    texts, messages = [prompt_set.texts[i] for i in idx], [prompt_set.messages[i] for i in idx]
    columns = prompt_set.columns_of(idx)  # this rank's rows' columns, for the reward functions
    rollout = sample(
        engine,
        tokenizer,
        prompt_ids,
        prompt_mask,
        seeds=[row_seed(seed, step, r) for r in positions],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop_token_ids=stop_token_ids,
        stop_strings=stop_strings,
        logprobs=True,
    )
    generate_s = time.perf_counter() - t0
    scores, components = scorer(rollout, texts, messages, columns=columns, step=step)
    if missing_eos_penalty is not None:
        scores = torch.where(rollout.ended, scores, scores + missing_eos_penalty)
    valid = finite_rows(scores, texts, step=step, policy=nonfinite, device=device)
    return Collected(rollout, texts, scores, components, valid, positions, generate_s)


def finite_rows(
    scores: torch.Tensor, prompts: list[str], *, step: int, policy: str, device: torch.device
) -> torch.Tensor:
    """(B,) bool: which scores are finite (a row no reward function scored has none: NaN). With
    ``policy='error'`` a non-finite score on any rank stops
    every rank (FloatingPointError); with 'skip' the rows are masked out of training (kept, so every
    rank runs the same passes) — unless no row of the whole batch is left."""
    finite = torch.isfinite(scores)
    bad = (~finite).nonzero().flatten().tolist()
    stop = policy == "error" and bool(bad)
    if dist.any_rank(stop, device):
        where = (
            f"non-finite scores {scores[bad].tolist()} for prompts {[prompts[i][:60] for i in bad]}"
            if stop
            else "a non-finite score on another rank"
        )
        raise FloatingPointError(f"step {step}: {where} (set rollout.nonfinite_scores: skip)")
    if dist.global_sum(int(finite.sum()), device) == 0:
        raise FloatingPointError(
            f"step {step}: every score in the batch is non-finite (NaN or infinite, or no reward "
            "function scored the row: each returned None)"
        )
    return finite
