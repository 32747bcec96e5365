"""Steps 1–3 of every online method: a global batch of prompts, responses sampled from the policy,
their scores — this rank's share of it.

PPO, GRPO and RLOO differ in what they do with a scored rollout, not in how they get one; this is
the one place they get it. With ``group_size`` G > 1 every prompt is answered G times (GRPO's
group, RLOO's k samples): rows b·G … b·G + G − 1 answer prompt b. A rank takes whole prompts, so a
group never splits across ranks and its statistics need no reduction.

How a batch of prompts becomes responses is the run's :class:`Responder`, chosen once where its
environments are built: :class:`SingleTurn` (one ``generate`` per prompt) here, the multi-turn one
(:class:`proximal.agents.collect.MultiTurn`) in ``agents``. :func:`collect`, the evaluations and the
trainers take a responder and never ask which one it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from proximal import dist
from proximal.config import ConfigError
from proximal.data.chat import set_chat_template
from proximal.data.collate import pad_left
from proximal.data.prompts import load_prompts
from proximal.models.loading import load_tokenizer
from proximal.rollout.engine import RolloutEngine, row_seed
from proximal.rollout.reward_functions import load_reward_functions, reward_argument_problems
from proximal.rollout.sampling import Rollout, sample
from proximal.rollout.scoring import Scorer


@dataclass
class Prompts:
    """A batch of prompts as a responder reads them, one entry per row: token ids, texts, messages
    (None for a plain-text row), columns (the dataset's other fields, or None) and the row's seed
    (:func:`~proximal.rollout.engine.row_seed`)."""

    token_ids: list[list[int]]
    texts: list[str]
    messages: list
    columns: list[dict] | None
    seeds: list[int]

    @classmethod
    def of(cls, prompt_set, idx: list[int], seeds: list[int]) -> Prompts:
        """Rows ``idx`` of a :class:`~proximal.data.prompts.PromptSet`."""
        return cls(
            [prompt_set.token_ids[i] for i in idx],
            [prompt_set.texts[i] for i in idx],
            [prompt_set.messages[i] for i in idx],
            prompt_set.columns_of(idx),
            seeds,
        )


@dataclass
class Sampling:
    """How one response (a multi-turn rollout: one turn) is sampled."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] | None = None
    stop_strings: list[str] | None = None


@dataclass
class Responses:
    """A responder's answer to a batch of prompts: the rollout (ids, masks, the engine's
    ``behaviour_logprobs``), what the reward functions read as each completion (None: the decoded
    responses), whether every row is scored by a source the responder adds (``scored_elsewhere``),
    the per-turn rewards (B, T) float32 (None: none), each row's record for ``samples.jsonl``
    (None: none) and ``detail``, the responder's own (a multi-turn one's trajectories)."""

    rollout: Rollout
    completions: list | None = None
    scored_elsewhere: bool = False
    turn_rewards: torch.Tensor | None = None
    records: list[dict] | None = None
    detail: object = None


class Responder(Protocol):
    """Turns a batch of prompts into responses, and says what a run's step and its evaluation add
    to them: the interface :class:`SingleTurn` and :class:`proximal.agents.collect.MultiTurn`
    implement (each in full, without a base class to inherit from; SingleTurn's hooks are the
    identities).

    ``max_tokens``: a response's length at most (a multi-turn one's: agent and observation tokens).
    ``row_tools``: each prompt row's tool schemas for the prompt loader (None: no tools).
    ``eval_keys``: the evaluation's per-row columns beside the scores (:meth:`eval_row`)."""

    max_tokens: int
    row_tools: Any
    eval_keys: tuple[str, ...]

    def ready(self, tokenizer, policy) -> None:
        """Once the policy is loaded, before any step: what the responder needs of it."""

    def respond(
        self,
        engine: RolloutEngine,
        tokenizer,
        prompts: Prompts,
        sampling: Sampling,
        *,
        device: torch.device,
        behaviour_logprobs: bool = True,
        keep_counts: bool = False,
    ) -> Responses:
        """The responses to ``prompts``; ``behaviour_logprobs``: with the engine's log μ;
        ``keep_counts``: leave the run's step counts as they were (an evaluation)."""

    def outcome(self, got: Responses, scores: torch.Tensor, components: dict) -> torch.Tensor:
        """The scores with what the responder adds (``components`` gets its sources)."""

    def drop(
        self, got: Responses, valid: torch.Tensor, *, step: int, group_size: int, device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(valid, dropped)``: the rows the responder leaves out of the update, taken out of
        ``valid``, and which they are (B,) bool."""

    def metrics(self, got: Responses, dropped: torch.Tensor) -> dict[str, float]:
        """The step's metrics of the responder, over every rank."""

    def check_offered(self, columns: list[dict] | None, source: str) -> str | None:
        """A problem with the tools that prompt rows (``columns``, of ``source``) name, or None."""

    def eval_scores(self, got: Responses) -> dict[str, list]:
        """The evaluation's scores the responder adds, ``{name: one per row}``."""

    def eval_row(self, got: Responses, j: int) -> dict:
        """Row ``j``'s :attr:`eval_keys` columns (and more) in the evaluation."""

    def close(self) -> None:
        """Its workers stopped, at the end of the run."""


class SingleTurn:
    """One response per prompt: one ``generate``, masked after the stop (:func:`sample`). A
    :class:`Responder` whose hooks are the identities: it adds no score, drops no row, has no
    metrics, offers no tools and holds no workers."""

    row_tools = None
    eval_keys: tuple[str, ...] = ()

    def __init__(self, max_tokens: int = 0):
        self.max_tokens = max_tokens

    def ready(self, tokenizer, policy) -> None:
        pass

    def respond(
        self,
        engine,
        tokenizer,
        prompts,
        sampling,
        *,
        device,
        behaviour_logprobs=True,
        keep_counts=False,
    ):
        prompt_ids, prompt_mask = pad_left(prompts.token_ids, tokenizer.pad_token_id, device)
        rollout = sample(
            engine,
            tokenizer,
            prompt_ids,
            prompt_mask,
            seeds=prompts.seeds,
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            stop_token_ids=sampling.stop_token_ids,
            stop_strings=sampling.stop_strings,
            logprobs=behaviour_logprobs,
        )
        return Responses(rollout)

    def outcome(self, got: Responses, scores: torch.Tensor, components: dict) -> torch.Tensor:
        return scores

    def drop(self, got: Responses, valid: torch.Tensor, *, step: int, group_size: int, device):
        return valid, torch.zeros_like(valid)

    def metrics(self, got: Responses, dropped: torch.Tensor) -> dict[str, float]:
        return {}

    def check_offered(self, columns: list[dict] | None, source: str) -> str | None:
        return None

    def eval_scores(self, got: Responses) -> dict[str, list]:
        return {}

    def eval_row(self, got: Responses, j: int) -> dict:
        return {}

    def close(self) -> None:
        pass


@dataclass
class Collected:
    """A scored rollout: this rank's rows of the step's global batch."""

    rollout: Rollout
    prompts: list[str]  # (B,) prompt texts, one per row (repeated within a group)
    scores: torch.Tensor  # (B,) total score, float32 (penalty included; may be non-finite)
    components: dict[str, torch.Tensor]  # each reward source's (B,) score
    valid: torch.Tensor  # (B,) bool: finite score and not dropped (rows to train on)
    positions: list[int]  # each row's index in the global batch of rows
    generate_s: float  # seconds spent generating
    dropped: torch.Tensor | None = None  # (B,) bool: left out by the responder (env.on_failure)
    turn_rewards: torch.Tensor | None = None  # (B, T) per-turn rewards; None: none
    records: list[dict] | None = None  # each row's samples.jsonl record beside the scores
    metrics: dict[str, float] = field(default_factory=dict)  # the responder's step metrics

    def nonfinite_rows(self) -> int:
        """This rank's rows left out of training for a non-finite score (not those the responder
        dropped: ``valid`` holds both)."""
        left_out = ~self.valid
        if self.dropped is not None:
            left_out = left_out & ~self.dropped
        return int(left_out.sum())


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
    reward_function_kwargs: dict[str, dict] | None = None,
    served: Mapping[str, Callable] | None = None,
):
    """``(functions, prompt_set)`` of an online run, loaded before any model so that a mistake in
    either is reported first: each ``module:function`` reward function imported, a callable taken as
    it is, a factory called with its ``reward_function_kwargs``
    (:func:`~proximal.rollout.reward_functions.load_reward_functions`: ``{name: function}``), the
    prompts rendered and tokenised with the policy's tokenizer
    (:func:`~proximal.data.prompts.load_prompts`; ``tools``, an agent run's, gives each row's tool
    schemas), and every argument a function requires found among the prompts' columns
    (ConfigError naming the function, the argument and the file). ``served``: the rewards served
    over HTTP (:func:`~proximal.rollout.reward_http.load_served_rewards`), after the functions."""
    functions = {
        **load_reward_functions(reward_functions, reward_function_kwargs),
        **(served or {}),
    }
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
    responder: Responder | None = None,
) -> Collected:
    """Take the next global batch of prompts from ``sampler``, have ``responder`` (default:
    :class:`SingleTurn`) answer each of this rank's prompts ``group_size`` times, score the
    responses, and guard non-finite scores (:func:`finite_rows`): :func:`draw`, the responder's
    ``respond``, :func:`score`.

    Row r of the global batch draws its tokens from a generator seeded by (seed, step, r), so the
    rollout is the same on any number of processes (:mod:`proximal.rollout.engine`). The engine's
    log-probabilities of the sampled tokens, log μ, come with it (``rollout.behaviour_logprobs``).
    """
    responder = responder if responder is not None else SingleTurn(max_new_tokens)
    t0 = time.perf_counter()
    drawn = draw(step, prompt_set=prompt_set, sampler=sampler, seed=seed, group_size=group_size)
    sampling = Sampling(max_new_tokens, temperature, top_p, top_k, stop_token_ids, stop_strings)
    got = responder.respond(engine, tokenizer, drawn.prompts, sampling, device=device)
    return score(
        step,
        drawn,
        got,
        time.perf_counter() - t0,
        scorer=scorer,
        responder=responder,
        device=device,
        missing_eos_penalty=missing_eos_penalty,
        nonfinite=nonfinite,
        group_size=group_size,
    )


@dataclass
class Drawn:
    """A step's prompts as this rank answers them: the :class:`Prompts` (``group_size`` rows per
    prompt, each with its seed) and each row's index in the global batch of rows."""

    prompts: Prompts
    positions: list[int]


def draw(step: int, *, prompt_set, sampler, seed: int, group_size: int = 1) -> Drawn:
    """Step ``step``'s global batch of prompts, the next of ``sampler``: this rank's share, each
    prompt ``group_size`` times, row r of the global batch seeded (seed, step, r)."""
    batch = sampler.next_global_batch()
    mine = sampler.local_part(list(range(len(batch))))  # this rank's prompt positions
    positions = [p * group_size + j for p in mine for j in range(group_size)]
    idx = [batch[p] for p in mine for _ in range(group_size)]
    return Drawn(
        Prompts.of(prompt_set, idx, [row_seed(seed, step, r) for r in positions]), positions
    )


def score(
    step: int,
    drawn: Drawn,
    got: Responses,
    generate_s: float,
    *,
    scorer: Scorer,
    responder: Responder,
    device: torch.device,
    missing_eos_penalty: float | None = None,
    nonfinite: str = "skip",
    group_size: int = 1,
) -> Collected:
    """The responses ``got`` to ``drawn`` scored (reward model, functions, the responder's own
    sources and the missing-EOS penalty), the non-finite scores guarded (:func:`finite_rows`) and
    the rows the responder drops left out: the step's :class:`Collected`."""
    rollout, prompts = got.rollout, drawn.prompts
    texts = prompts.texts
    scores, components = scorer(
        rollout,
        texts,
        prompts.messages,
        columns=prompts.columns,  # this rank's rows' columns, for the reward functions
        step=step,
        completions=got.completions,
        scored_elsewhere=got.scored_elsewhere,
    )
    scores = responder.outcome(got, scores, components)
    if missing_eos_penalty is not None:
        scores = torch.where(rollout.ended, scores, scores + missing_eos_penalty)
    valid = finite_rows(scores, texts, step=step, policy=nonfinite, device=device)
    valid, dropped = responder.drop(got, valid, step=step, group_size=group_size, device=device)
    return Collected(
        rollout,
        texts,
        scores,
        components,
        valid,
        drawn.positions,
        generate_s,
        dropped=dropped,
        turn_rewards=got.turn_rewards,
        records=got.records,
        metrics=responder.metrics(got, dropped),
    )


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
