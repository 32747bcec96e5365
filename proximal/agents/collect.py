"""Steps 1–3 of an online method when the policy acts over several turns: a global batch of
prompts, a multi-turn trajectory per row (:func:`~proximal.agents.trajectory.run_trajectories`
instead of one ``generate``), their scores — this rank's share of it.

The rest of the step is unchanged, for the trajectories come back as a
:class:`~proximal.rollout.sampling.Rollout` with holes: ``response_mask`` is the agent mask (every
loss, normaliser, whitening, KL, entropy and value loss counts the policy's own tokens only; GAE
carries across the holes), ``context_mask`` keeps the observations in attention. What differs:

* the reward functions and the reward model see each trajectory whole — its text, observations
  included, or for a conversational row its messages (assistant turns and the tool/user messages
  between them), TRL's form;
* the environment's ``get_reward()`` joins the score (``score/env``); a failed trajectory
  (``tools.on_error: end``, an environment that raised or was lost) scores 0;
* per-turn rewards (the step form's) come as :attr:`AgentCollected.turn_rewards` (B, T), on the last
  agent token of their turn: PPO adds them to the shaped rewards before GAE; GRPO/RLOO add their sum
  to the score (their baselines are over whole trajectories);
* ``agent/*`` metrics: this rank's counts and sums, reduced across ranks by :func:`agent_step_metrics`.

Row r of the global batch draws turn 0 from the seed a single-turn rollout uses, (seed, step, r),
and turn k from ``row_seed`` of it and k: the trajectories are the same on any number of processes
and after a resume. Each rank runs its own trajectories to the end — no collective per turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from proximal import dist
from proximal.agents.env import (
    BATCH_COUNTS,
    COUNTS,
    MAX_RESULT_CHARS,
    ON_FAILURE,
    Environments,
    check_offered,
    environment_class,
    row_schemas,
    tool_methods,
)
from proximal.agents.tools import load_tools, tool_schemas
from proximal.agents.trajectory import (
    STOPS,
    Trajectory,
    check_chat_template,
    run_trajectories,
    to_rollout,
    turn_rewards,
)
from proximal.config import ConfigError
from proximal.rollout.collect import Collected, finite_rows
from proximal.rollout.engine import RolloutEngine, SamplingParams, row_seed
from proximal.rollout.scoring import Scorer
from proximal.specs import import_spec

__all__ = [
    "AgentCollected",
    "agent_collect",
    "agent_step_metrics",
    "build_environments",
    "check_template",
    "context_length",
    "run_tools",
]


@dataclass
class AgentCollected(Collected):
    """A scored multi-turn rollout: :class:`~proximal.rollout.collect.Collected` plus the
    trajectories, their per-turn rewards (B, T) float32 and their turn-reward sums (B,)."""

    trajectories: list[Trajectory] | None = None
    turn_rewards: torch.Tensor | None = None
    counts: dict[str, int] | None = None  # this rank's agent/<count> of the step (tool calls, ...)
    dropped: torch.Tensor | None = None  # (B,) bool: left out by env.on_failure: drop

    def nonfinite_rows(self) -> int:
        """This rank's rows left out for a non-finite score (not those ``env.on_failure: drop``
        left out: ``valid`` holds both)."""
        left_out = ~self.valid
        if self.dropped is not None:
            left_out = left_out & ~self.dropped
        return int(left_out.sum())

    def metrics(self) -> dict[str, float]:
        """The step's ``agent/*`` metrics over every rank (:func:`agent_step_metrics`)."""
        return agent_step_metrics(
            self.trajectories or [], self.counts or {}, self.rollout.response_ids.device
        )

    def records(self) -> list[dict]:
        """Each row's ``{"trajectory": ...}`` for ``samples.jsonl`` (its turns, rewards,
        observations, stop)."""
        return [{"trajectory": t.record()} for t in self.trajectories or []]


def load_environment(spec) -> Callable:
    """The ``env.factory`` spec imported (a class or a function; from Python, taken as it is).
    ConfigError when it cannot be, or when a worker process could not import it (defined in
    ``__main__`` or inside a function)."""
    factory = import_spec(spec, "env.factory")
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", type(factory).__qualname__)
    if module == "__main__" or "<locals>" in qualname:
        raise ConfigError(
            f"env.factory {qualname} is defined in {module}, which a worker process cannot "
            "import; define it at the top of an importable module and name it 'module:Class'"
        )
    return factory


def run_tools(env, tools) -> Callable[[dict], list[dict]] | None:
    """Each prompt row's tool schemas in a run with ``env`` and ``tools`` config sections
    (:func:`~proximal.agents.env.row_schemas` of ``tools.functions`` and the environment's methods),
    for the prompt loader: a conversational prompt is rendered with what its trajectory is offered,
    so ``data.max_prompt_length`` and ``data.on_long_prompt`` hold for the prompt the model reads,
    and a row's ``tools`` column may name tools. None where no tool is registered: a single-turn
    run, or an environment without tools (a row's ``tools`` column is then its schemas, as data)."""
    if env.factory is None and not tools.functions:
        return None
    factory = load_environment(env.factory) if env.factory is not None else None
    cls = environment_class(factory) if factory is not None else None
    methods = tool_methods(cls)
    try:  # made here, so a missing docstring is not reported against a prompt row
        tool_schemas(methods)
    except ConfigError as e:
        raise ConfigError(f"env.factory {cls.__qualname__}: {e}") from None
    registered = {**load_tools(tools.functions), **methods}
    return row_schemas(registered) if registered else None


def run_environments(
    env,
    tools,
    *,
    has_reward_source: bool,
    columns: list[dict] | None,
    source: str,
    log: str | None = None,
) -> Environments | None:
    """A run's environments from its ``env`` and ``tools`` config sections (``factory``,
    ``max_turns``…; ``functions``, ``format``, ``timeout_s``, ``on_error``, ``workers``,
    ``max_result_chars``), through :func:`build_environments`; None when neither names anything —
    a single-turn run. ``log``: where the tools' prints go (the run's ``tools.log``)."""
    if env.factory is None and not tools.functions:
        return None
    return build_environments(
        env.factory,
        tools.functions,
        call_format=tools.format,
        timeout_s=tools.timeout_s,
        on_error=tools.on_error,
        workers=tools.workers,
        max_result_chars=tools.max_result_chars,
        log=log,
        has_reward_source=has_reward_source,
        columns=columns,
        source=source,
    )


def build_environments(
    factory_spec,
    tool_specs: list,
    *,
    call_format: str,
    timeout_s: float | None,
    on_error: str,
    workers: int,
    has_reward_source: bool,
    columns: list[dict] | None = None,
    source: str = "data.prompts",
    max_result_chars: int | None = MAX_RESULT_CHARS,
    log: str | None = None,
) -> Environments:
    """The run's :class:`~proximal.agents.env.Environments` from ``env.factory`` and
    ``tools.functions`` (imported and checked here, before any model loads), its workers started.
    ConfigError for a mistake in either, or when nothing scores the trajectories
    (``has_reward_source``: a reward model or reward functions; else the environment must have
    ``get_reward``), or when a prompt row's ``tools`` column (``columns``, the rows of
    ``source``) names a tool that is not registered."""
    factory = load_environment(factory_spec) if factory_spec is not None else None
    tools = load_tools(tool_specs)
    try:
        envs = Environments(
            factory,
            tools,
            call_format=call_format,
            timeout_s=timeout_s,
            on_error=on_error,
            workers=workers,
            max_result_chars=max_result_chars,
            log=log,
        )
    except (ValueError, TypeError) as e:
        raise ConfigError(f"env/tools: {e}") from None
    if problem := check_offered(columns, envs.tools, str(source)):
        envs.close()
        raise ConfigError(problem)
    if not has_reward_source and not envs.has_reward:
        envs.close()
        name = environment_class(factory).__name__
        raise ConfigError(
            f"nothing scores the trajectories: {name} has no get_reward() and there is no "
            "model.reward_model or model.reward_functions"
        )
    envs.pool.start()
    return envs


def check_template(envs: Environments, tokenizer) -> None:
    """:func:`~proximal.agents.trajectory.check_chat_template` for a run's environments, once its
    tokenizer is loaded and before any step: their workers are closed when it fails."""
    try:
        check_chat_template(tokenizer, bool(envs.tools))
    except Exception:
        envs.close()
        raise


def agent_collect(
    step: int,
    *,
    prompt_set,
    sampler,
    engine: RolloutEngine,
    scorer: Scorer,
    tokenizer,
    envs: Environments,
    seed: int,
    device: torch.device,
    max_new_tokens: int,
    max_turns: int,
    max_tokens: int,
    max_context: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: list[int] | None = None,
    stop_strings: list[str] | None = None,
    missing_eos_penalty: float | None = None,
    nonfinite: str = "skip",
    group_size: int = 1,
    on_failure: str = "zero",
) -> AgentCollected:
    """:func:`proximal.rollout.collect.collect` with a multi-turn trajectory per row (module
    docstring): the same prompts, rows, seeds and guards; ``max_new_tokens`` is one turn's limit,
    ``max_turns`` / ``max_tokens`` / ``max_context`` end a trajectory (``env.*``; the model's
    context). ``stop_strings`` must be empty (a turn ends at a stop token). ``on_failure``
    (``env.on_failure``, :data:`~proximal.agents.env.ON_FAILURE`): a failed trajectory scores 0
    (``zero``), or is left out of the update (``drop``) through ``valid``, the rows a non-finite
    score leaves out (:func:`dropped_rows`)."""
    if on_failure not in ON_FAILURE:
        raise ConfigError(f"env.on_failure = {on_failure!r}; expected one of {ON_FAILURE}")
    if stop_strings:
        raise ConfigError("rollout.stop_strings cannot be used with env/tools")
    t0 = time.perf_counter()
    batch = sampler.next_global_batch()
    mine = sampler.local_part(list(range(len(batch))))
    positions = [p * group_size + j for p in mine for j in range(group_size)]
    idx = [batch[p] for p in mine for _ in range(group_size)]
    texts, messages = [prompt_set.texts[i] for i in idx], [prompt_set.messages[i] for i in idx]
    columns = prompt_set.columns_of(idx)
    rows = [
        {"prompt": m if m is not None else p, **(c or {})}
        for p, m, c in zip(texts, messages, columns or [None] * len(idx))
    ]
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        stop_token_ids=(tokenizer.eos_token_id, *(stop_token_ids or [])),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
    )
    trajs = run_trajectories(
        engine,
        tokenizer,
        envs,
        [list(prompt_set.token_ids[i]) for i in idx],
        rows,
        seeds=[row_seed(seed, step, r) for r in positions],
        params=params,
        max_turns=max_turns,
        max_tokens=max_tokens,
        max_context=max_context,
        messages=messages,
        device=device,
        logprobs=True,
    )
    rollout = to_rollout(trajs, tokenizer.pad_token_id, device)
    if rollout.behaviour_logprobs is None:  # every trajectory empty (a budget of 0): μ is 0
        rollout.behaviour_logprobs = torch.zeros(rollout.response_ids.shape, device=device)
    generate_s = time.perf_counter() - t0
    completions = [
        trajectory_completion(t, tokenizer, m is not None) for t, m in zip(trajs, messages)
    ]
    scores, components = scorer(
        rollout,
        texts,
        messages,
        columns=columns,
        step=step,
        completions=completions,
        scored_elsewhere=envs.has_reward,  # the environment's reward scores every row
    )
    if envs.has_reward:
        env = torch.tensor(
            [0.0 if t.env_reward is None else t.env_reward for t in trajs], device=device
        )
        components["env"] = env
        scores = scores + env
    failed = torch.tensor([t.failed for t in trajs], dtype=torch.bool, device=device)
    scores = torch.where(failed, torch.zeros_like(scores), scores)
    if missing_eos_penalty is not None:
        scores = torch.where(rollout.ended, scores, scores + missing_eos_penalty)
    T = rollout.response_ids.shape[1]
    per_turn = turn_rewards(trajs, T, device=device)
    valid = finite_rows(scores, texts, step=step, policy=nonfinite, device=device)
    dropped = torch.zeros_like(valid)
    if on_failure == "drop":
        dropped = dropped_rows(failed, valid, group_size)
        valid = valid & ~dropped
        if dist.global_sum(int(valid.sum()), device) == 0:  # as finite_rows stops for NaN alone
            raise FloatingPointError(
                f"step {step}: every trajectory of the batch failed (or scored non-finite), and "
                "env.on_failure: drop leaves no row to train on (env.on_failure: zero trains on "
                "failed ones with outcome reward 0)"
            )
    counts = envs.take_counts()
    counts["agent/dropped"] = int(dropped.sum())
    return AgentCollected(
        rollout,
        texts,
        scores,
        components,
        valid,
        positions,
        generate_s,
        trajectories=trajs,
        turn_rewards=per_turn,
        counts=counts,
        dropped=dropped,
    )


def dropped_rows(failed: torch.Tensor, valid: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) bool: the rows ``env.on_failure: drop`` leaves out of the update — the failed ones and,
    for GRPO/RLOO (``group_size`` > 1; rows g·G … g·G + G − 1 one group), every row of a group the
    drop leaves with fewer than two members (``valid`` rows not failed): its baseline would be the
    member's own score. The rest of a group keeps its baseline over its remaining members (they
    stay ``valid``, the failed ones do not)."""
    dropped = failed.clone()
    if group_size > 1:
        left = (valid & ~failed).view(-1, group_size).sum(1)
        lone = (left < 2) & failed.view(-1, group_size).any(1)
        dropped |= lone.repeat_interleave(group_size)
    return dropped


def context_length(model) -> int | None:
    """The policy's context (``max_position_embeddings``), which ends a trajectory; None if unknown."""
    config = getattr(model, "config", None)
    return getattr(config, "max_position_embeddings", None)


def trajectory_completion(t: Trajectory, tokenizer, conversational: bool):
    """What a reward function is given as a trajectory's completion: its whole text after the prompt
    (special tokens left out), or for a conversational row its messages — each assistant turn and
    the observation messages after it (TRL's form)."""
    if not conversational:
        return tokenizer.decode(t.ids, skip_special_tokens=True)
    out = []
    for turn in t.turns:
        out.append({"role": "assistant", "content": turn.text})
        out.extend(turn.observation)
    return out


def agent_step_metrics(trajs: list[Trajectory], counts: dict[str, int], device) -> dict[str, float]:
    """The step's ``agent/*`` metrics over every rank's trajectories: means per trajectory (turns,
    observation tokens, the failed share, each stop reason's share), agent tokens per turn, and the
    counts of :data:`~proximal.agents.env.COUNTS` (tool calls, errors, timeouts, malformed calls,
    environment errors, results cut) and :data:`~proximal.agents.env.BATCH_COUNTS` (trajectories
    run again, dropped) summed, with tool calls per trajectory."""
    n = len(trajs)
    turns = sum(len(t.turns) for t in trajs)
    agent = sum(t.agent_tokens() for t in trajs)
    sums = [
        n,
        turns,
        agent,
        sum(len(t.ids) - t.agent_tokens() for t in trajs),
        sum(t.failed for t in trajs),
        *(sum(t.stop == s for t in trajs) for s in STOPS),
        *(counts.get(f"agent/{k}", 0) for k in (*COUNTS, *BATCH_COUNTS)),
    ]
    total = dist.all_reduce_sum(torch.tensor(sums, dtype=torch.float64, device=device)).tolist()
    N, turns, agent, obs, failed = total[:5]
    stops = total[5 : 5 + len(STOPS)]
    counted = dict(zip((*COUNTS, *BATCH_COUNTS), total[5 + len(STOPS) :]))
    N = max(N, 1.0)
    out = {
        "agent/turns": turns / N,
        "agent/tokens_per_turn": agent / max(turns, 1.0),
        "agent/observation_tokens": obs / N,
        "agent/failed": failed / N,
        **{f"agent/stop_{s}": v / N for s, v in zip(STOPS, stops)},
        **{f"agent/{k}": int(v) for k, v in counted.items()},
        "agent/tool_calls_per_trajectory": counted["tool_calls"] / N,
    }
    return out
