"""The multi-turn responder (:class:`MultiTurn`): a multi-turn trajectory per prompt row
(:func:`~proximal.agents.trajectory.run_trajectories` instead of one ``generate``), behind the seam
every online method collects through (:class:`proximal.rollout.collect.Responder`), chosen once
where the run's environments are built (:func:`run_responder`).

The rest of the step is unchanged, for the trajectories come back as a
:class:`~proximal.rollout.sampling.Rollout` with holes: ``response_mask`` is the agent mask (every
loss, normaliser, whitening, KL, entropy and value loss counts the policy's own tokens only; GAE
carries across the holes), ``context_mask`` keeps the observations in attention. What differs:

* the reward functions and the reward model see each trajectory whole — its text, observations
  included, or for a conversational row its messages (assistant turns and the tool/user messages
  between them), TRL's form;
* the environment's ``get_reward()`` joins the score (``score/env``); a failed trajectory
  (``tools.on_error: end``, an environment that raised or was lost) scores 0;
* per-turn rewards (the step form's) come as :attr:`Responses.turn_rewards` (B, T), on the last
  agent token of their turn: PPO adds them to the shaped rewards before GAE; GRPO/RLOO add their sum
  to the score (their baselines are over whole trajectories);
* ``agent/*`` metrics: this rank's counts and sums, reduced across ranks by :func:`agent_step_metrics`;
* ``env.on_failure: drop`` leaves failed rows out of the update through ``valid`` (:func:`dropped_rows`).

Row r of the global batch draws turn 0 from the seed a single-turn rollout uses, (seed, step, r),
and turn k from ``row_seed`` of it and k: the trajectories are the same on any number of processes
and after a resume. Each rank runs its own trajectories to the end — no collective per turn.
"""

from __future__ import annotations

from collections.abc import Callable

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
from proximal.rollout.collect import Prompts, Responder, Responses, Sampling, SingleTurn
from proximal.rollout.engine import SamplingParams
from proximal.specs import import_spec

__all__ = [
    "AGENT_COLUMNS",
    "MultiTurn",
    "agent_step_metrics",
    "build_environments",
    "check_template",
    "context_length",
    "run_responder",
    "run_tools",
]

#: A trajectory's per-row columns beside the scores (multi-turn evaluation): its agent turns, the
#: tool calls it wrote, those that raised, timed out or could not be read, and whether it failed.
AGENT_COLUMNS = ("turns", *COUNTS, "failed")


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


def run_responder(
    env,
    tools,
    *,
    max_new_tokens: int,
    max_tokens: int,
    has_reward_source: bool,
    columns: list[dict] | None = None,
    source: str = "data.prompts",
    log: str | None = None,
) -> Responder:
    """A run's responder from its ``env`` and ``tools`` config sections: :class:`SingleTurn`
    (responses of ``max_new_tokens`` at most) when neither names anything, else :class:`MultiTurn`
    over the environments :func:`build_environments` makes of them (``factory``, ``max_turns``,
    ``on_failure``…; ``functions``, ``format``, ``timeout_s``, ``on_error``, ``workers``,
    ``max_result_chars``), a trajectory's budget ``max_tokens``. ``log``: where the tools' prints
    go (the run's ``tools.log``). The one place a run chooses between one turn and several."""
    if env.factory is None and not tools.functions:
        return SingleTurn(max_new_tokens)
    envs = build_environments(
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
    return MultiTurn(envs, env.max_turns, max_tokens, on_failure=env.on_failure)


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


class MultiTurn:
    """The :class:`~proximal.rollout.collect.Responder` of env/tools runs: a multi-turn trajectory
    per prompt row (module docstring) with the run's environments and
    tools (``envs``; its worker processes), ``env.max_turns``, the response budget ``max_tokens``
    (agent + observation tokens; ``env.max_tokens``), the model's context ``max_context`` (None: no
    limit; :meth:`ready` takes the policy's) and ``on_failure`` (``env.on_failure``,
    :data:`~proximal.agents.env.ON_FAILURE`): a failed trajectory scores 0 (``zero``), or is left
    out of the update (``drop``) through ``valid``, the rows a non-finite score leaves out
    (:func:`dropped_rows`). One turn is sampled as a single-turn response is; ``stop_strings``
    must be empty (a turn ends at a stop token)."""

    eval_keys = AGENT_COLUMNS

    def __init__(
        self,
        envs: Environments,
        max_turns: int,
        max_tokens: int,
        max_context: int | None = None,
        *,
        on_failure: str = "zero",
    ):
        if on_failure not in ON_FAILURE:
            raise ConfigError(f"env.on_failure = {on_failure!r}; expected one of {ON_FAILURE}")
        self.envs, self.max_turns, self.max_tokens = envs, max_turns, max_tokens
        self.max_context, self.on_failure = max_context, on_failure

    @property
    def row_tools(self):
        return row_schemas(self.envs.tools) if self.envs.tools else None

    def ready(self, tokenizer, policy) -> None:
        """The chat template checked (observations go through it; the workers are closed when it
        fails), and the policy's context taken as the trajectories' limit."""
        check_template(self.envs, tokenizer)
        self.max_context = context_length(policy)

    def respond(
        self,
        engine,
        tokenizer,
        prompts: Prompts,
        sampling: Sampling,
        *,
        device,
        behaviour_logprobs: bool = True,
        keep_counts: bool = False,
    ) -> Responses:
        """One trajectory per row (the rows as a run hands them to ``reset``); turn 0 draws from
        the row's seed, turn k from ``row_seed`` of it and k."""
        if sampling.stop_strings:
            raise ConfigError("rollout.stop_strings cannot be used with env/tools")
        texts, messages, columns = prompts.texts, prompts.messages, prompts.columns
        rows = [
            {"prompt": m if m is not None else p, **(c or {})}
            for p, m, c in zip(texts, messages, columns or [None] * len(texts))
        ]
        params = SamplingParams(
            max_new_tokens=sampling.max_new_tokens,
            stop_token_ids=(tokenizer.eos_token_id, *(sampling.stop_token_ids or [])),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
        )
        counts = self.envs.counts.copy()
        try:
            trajs = run_trajectories(
                engine,
                tokenizer,
                self.envs,
                [list(ids) for ids in prompts.token_ids],
                rows,
                seeds=prompts.seeds,
                params=params,
                max_turns=self.max_turns,
                max_tokens=self.max_tokens,
                max_context=self.max_context,
                messages=messages,
                device=device,
                logprobs=behaviour_logprobs,
            )
        finally:
            if keep_counts:  # an evaluation's calls are never counted in a run's agent/* metrics
                self.envs.counts = counts
        rollout = to_rollout(trajs, tokenizer.pad_token_id, device)
        if behaviour_logprobs and rollout.behaviour_logprobs is None:
            # every trajectory empty (a budget of 0): μ is 0 everywhere
            rollout.behaviour_logprobs = torch.zeros(rollout.response_ids.shape, device=device)
        return Responses(
            rollout,
            completions=[
                trajectory_completion(t, tokenizer, m is not None) for t, m in zip(trajs, messages)
            ],
            scored_elsewhere=self.envs.has_reward,  # the environment's reward scores every row
            turn_rewards=turn_rewards(trajs, rollout.response_ids.shape[1], device=device),
            records=[{"trajectory": t.record()} for t in trajs],
            detail=trajs,
        )

    def outcome(self, got: Responses, scores: torch.Tensor, components: dict) -> torch.Tensor:
        """The environment's ``get_reward()`` added (``score/env``); a failed trajectory's 0."""
        trajs, device = got.detail, got.rollout.response_ids.device
        if self.envs.has_reward:
            env = torch.tensor(
                [0.0 if t.env_reward is None else t.env_reward for t in trajs], device=device
            )
            components["env"] = env
            scores = scores + env
        failed = torch.tensor([t.failed for t in trajs], dtype=torch.bool, device=device)
        return torch.where(failed, torch.zeros_like(scores), scores)

    def drop(self, got: Responses, valid, *, step: int, group_size: int, device):
        """``env.on_failure: drop``: the failed rows (:func:`dropped_rows`) out of ``valid``."""
        dropped = torch.zeros_like(valid)
        if self.on_failure != "drop":
            return valid, dropped
        failed = torch.tensor([t.failed for t in got.detail], dtype=torch.bool, device=device)
        dropped = dropped_rows(failed, valid, group_size)
        valid = valid & ~dropped
        if dist.global_sum(int(valid.sum()), device) == 0:  # as finite_rows stops for NaN alone
            raise FloatingPointError(
                f"step {step}: every trajectory of the batch failed (or scored non-finite), and "
                "env.on_failure: drop leaves no row to train on (env.on_failure: zero trains on "
                "failed ones with outcome reward 0)"
            )
        return valid, dropped

    def metrics(self, got: Responses, dropped: torch.Tensor) -> dict[str, float]:
        """The step's ``agent/*`` metrics over every rank (:func:`agent_step_metrics`)."""
        counts = self.envs.take_counts()
        counts["agent/dropped"] = int(dropped.sum())
        return agent_step_metrics(got.detail, counts, got.rollout.response_ids.device)

    def check_offered(self, columns, source):
        return check_offered(columns, self.envs.tools, str(source))

    def eval_scores(self, got: Responses) -> dict[str, list]:
        """The environment's outcome, as in a run (a failed trajectory's 0)."""
        if not self.envs.has_reward:
            return {}
        return {"env": [0.0 if t.failed else float(t.env_reward or 0.0) for t in got.detail]}

    def eval_row(self, got: Responses, j: int) -> dict:
        """A trajectory's :data:`AGENT_COLUMNS` and its turns (``trajectory``, as samples.jsonl
        keeps them)."""
        t = got.detail[j]
        return {
            "turns": len(t.turns),
            **{k: int(t.counts.get(k, 0)) for k in COUNTS},
            "failed": bool(t.failed),
            "trajectory": t.record(),
        }

    def close(self) -> None:
        self.envs.close()


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
