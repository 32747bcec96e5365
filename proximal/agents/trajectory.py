"""Multi-turn rollouts, token in and token out.

A trajectory is built by appending token ids, turn by turn::

    prompt | agent turn 1 (sampled) | observation 1 | agent turn 2 (sampled) | ... | agent turn n

* an agent turn is exactly the ids the engine sampled (up to and including the stop token); they
  are never decoded and encoded again — the text is decoded only to hand to the environment;
* an observation (tool results, an environment's reply) is rendered through the chat template
  once, as the text the template writes after an assistant turn's end-of-turn token and up to
  the next generation prompt (:func:`observation_ids`), and its ids are appended.

So the ids the trainer scores are the ids the policy saw and chose while sampling, and
log π_old(a_t | s_t) is the probability of exactly that action in exactly that state. Rendering
the whole conversation again at the end instead would tokenise the policy's text anew: a BPE
tokenizer may merge it differently (``" 4"`` + ``"2"`` sampled, ``" 42"`` on re-encoding), templates
rewrite earlier turns (dropping reasoning, reformatting tool calls), and then the "old" log-probs
are of tokens the policy never sampled — the ratio π_θ/π_old stops meaning anything (verl's docs
report PPO failing to converge so; TRL issue #5144: masks longer than the ids after re-tokenising).

Each turn is one ``engine.generate`` call over the still-running trajectories, with row b's seed
for turn k: ``seeds[b]`` for k = 0 (the seed a single-turn rollout uses, so a one-turn environment
samples exactly today's tokens) and ``row_seed(seeds[b], k)`` after.

A trajectory ends when its environment says done (or a turn makes no tool call), when it fails
(:mod:`proximal.agents.env`), after ``max_turns`` agent turns, when the next turn would pass
``max_tokens`` response tokens (agent + observation: the budget after the prompt), when it would
pass ``max_context`` tokens in all (the model's context), or when one turn reaches the turn's own
``max_new_tokens`` without a stop token. Each reason is counted (:data:`STOPS`).

The result converts to today's :class:`~proximal.rollout.sampling.Rollout`
(:func:`to_rollout`): the response is everything after the prompt, ``response_mask`` is the agent
mask — True exactly on the policy's own sampled tokens — so KL shaping, GAE
(:func:`proximal.core.advantages.gae` carries the next agent token's value and advantage across
each observation span), whitening, the losses and every normaliser count agent tokens only, with
no change to the core. The observation tokens stay in the attention mask (``Rollout.context_mask``):
the later agent tokens attend to them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from proximal.agents.env import AgentError, Environments, as_messages
from proximal.data.chat import apply_template, content_of, encode_prompt
from proximal.data.collate import pad_left, pad_right
from proximal.rollout.engine import RolloutEngine, SamplingParams, row_seed
from proximal.rollout.sampling import Rollout

#: Why a trajectory ended: its environment said so; it failed (reward 0); a limit.
STOPS = ("done", "failed", "max_turns", "max_tokens", "context", "turn_length")


@dataclass
class Turn:
    """One agent turn: its tokens are ``ids[start:end]`` of the trajectory (response coordinates),
    the observation that followed ``ids[end:obs_end]`` (empty when none was appended)."""

    start: int
    end: int
    text: str
    reward: float = 0.0
    observation: list[dict] = field(default_factory=list)
    obs_end: int = -1

    def __post_init__(self):
        if self.obs_end < 0:
            self.obs_end = self.end


@dataclass
class Trajectory:
    """One prompt's multi-turn rollout.

    ids: every token after the prompt, agent and observation. agent_mask: same length, True on
    the policy's own sampled tokens. behaviour_logprobs: same length, the engine's log μ of each sampled
    token (0 at observations); empty unless asked for. ended: it finished (done, a turn with no call, or a failure)
    rather than being cut by a limit. stop: one of :data:`STOPS`. failed: its outcome reward is 0.
    env_reward: the environment's ``get_reward()``, or None. counts: its tool calls, tool errors,
    timeouts, malformed calls (:data:`~proximal.agents.env.COUNTS`; the held-out evaluation's
    per-trajectory columns).
    """

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    agent_mask: list[bool] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    ended: bool = False
    stop: str = ""
    failed: bool = False
    env_reward: float | None = None
    counts: Counter = field(default_factory=Counter)  # its turns' share of agent/* COUNTS

    def agent_tokens(self) -> int:
        return sum(self.agent_mask)

    def record(self) -> dict:
        """The trajectory for ``samples.jsonl``: each turn's text, reward and the observation after it."""
        return {
            "turns": [
                {"agent": t.text, "reward": t.reward, "observation": t.observation}
                for t in self.turns
            ],
            "stop": self.stop,
            "failed": self.failed,
            "env_reward": self.env_reward,
            "agent_tokens": self.agent_tokens(),
            "observation_tokens": len(self.ids) - self.agent_tokens(),
        }


def observation_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The ids to append after an agent turn for ``messages`` (tool results, an environment's reply).

    With a chat template: the text the template writes after an assistant turn's end-of-turn
    (EOS) token, through the observation messages, to the next generation prompt — found as the
    difference of two renderings of a stand-in conversation (TRL's way), so it carries exactly the
    separators the template puts there. Without one: the messages' contents, as they are.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        text = "".join(m["content"] for m in messages)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    assistant = {"role": "assistant", "content": "x"}
    if messages and messages[0]["role"] == "tool":  # some templates name the call a result answers
        calls = [m.get("name", "") for m in messages if m["role"] == "tool"]
        assistant["tool_calls"] = [
            {"type": "function", "function": {"name": n, "arguments": {}}} for n in calls
        ]
    stand_in = [{"role": "user", "content": "x"}, assistant]
    where = "observation"
    before = apply_template(stand_in, tokenizer, where, add_generation_prompt=False)
    after = apply_template(stand_in + messages, tokenizer, where, add_generation_prompt=True)
    eos = tokenizer.eos_token
    cut = before.rfind(eos) if eos else -1
    if cut < 0:
        raise ValueError(
            "the chat template does not end an assistant turn with the EOS token "
            f"{eos!r}; a multi-turn rollout stops each turn there and appends what follows"
        )
    before = before[: cut + len(eos)]
    if not after.startswith(before):
        raise ValueError(
            "the chat template renders the conversation differently once an observation follows "
            "(the text up to the assistant's EOS changed); observations cannot be appended"
        )
    return list(tokenizer(after[len(before) :], add_special_tokens=False)["input_ids"])


#: The text of the stand-in tool result :func:`check_chat_template` looks for in the rendering.
_PROBE = "probe-result-7291"


def check_chat_template(tokenizer, tools: bool) -> None:
    """Stop before anything trains when the chat template cannot carry a multi-turn rollout.

    A stand-in conversation — a user turn, an assistant turn (with a tool call when ``tools``),
    its result (a ``tool`` message when ``tools``, else a ``user`` one) — is rendered the way
    :func:`observation_ids` renders every observation. AgentError (one line, exit status 2,
    suggesting ``model.chat_template``) when the template raises, drops the result (its text is
    not in the rendering: the policy would never read one, while ``samples.jsonl`` recorded it as
    shown), or ends no assistant turn with the EOS token (a turn stops there, and what follows is
    appended). Without a chat template, observations are their text as it is: nothing to check.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return
    role = "tool" if tools else "user"
    result = {"role": role, "content": _PROBE, **({"name": "probe"} if tools else {})}
    assistant = {"role": "assistant", "content": "x"}
    if tools:
        assistant["tool_calls"] = [
            {"type": "function", "function": {"name": "probe", "arguments": {}}}
        ]
    conversation = [{"role": "user", "content": "x"}, assistant, result]
    hint = "set model.chat_template to a template that supports multi-turn tool use"
    try:
        text = apply_template(conversation, tokenizer, "chat template check")
    except Exception as e:  # jinja2's TemplateError, a template's raise_exception(...)
        raise AgentError(
            f"the chat template raises on a {role} message after an assistant turn "
            f"({type(e).__name__}: {e}); {hint}"
        ) from None
    if _PROBE not in text:
        raise AgentError(
            f"the chat template drops {role} messages: a {role} result's text does not appear when "
            f"it is rendered after an assistant turn, so the policy would never read one; {hint}"
        )
    try:
        observation_ids(tokenizer, [result])
    except ValueError as e:
        raise AgentError(f"{e}; {hint}") from None


def first_prompt(tokenizer, prompt_ids: list[int], messages: list[dict] | None, observation, tools):
    """The prompt ids once ``reset()``'s observation is added (TRL's rule: appended to the last
    user message, or to a text prompt as it is); ``prompt_ids`` as loaded when there is none.

    The loader rendered a conversational prompt with the schemas of the ``tools`` its trajectory is
    offered (``load_prompts(tools=row_schemas(...))``: the row's ``tools`` column names a subset,
    :meth:`~proximal.agents.env.Environments.schemas`), measured and truncated as the model reads
    it. With an observation it is rendered again here with them (nothing has been sampled yet), from
    its messages: the observation lengthens it, counted against the context."""
    if observation is None:
        return prompt_ids
    if messages is None:
        if not isinstance(observation, str):
            raise TypeError("a text prompt's first observation must be a string")
        return prompt_ids + list(tokenizer(observation, add_special_tokens=False)["input_ids"])
    extra = (
        observation
        if isinstance(observation, str)
        else "".join(m["content"] for m in as_messages(observation))
    )
    last = {**messages[-1], "content": content_of(messages[-1]) + extra}
    text = apply_template(messages[:-1] + [last], tokenizer, "reset", tools=tools)
    return encode_prompt(text, tokenizer)


@torch.no_grad()
def run_trajectories(
    engine: RolloutEngine,
    tokenizer,
    envs: Environments,
    prompt_ids: list[list[int]],
    rows: list[dict],
    *,
    seeds: list[int],
    params: SamplingParams,
    max_turns: int,
    max_tokens: int,
    max_context: int | None = None,
    messages: list[list[dict] | None] | None = None,
    device: torch.device | str = "cpu",
    logprobs: bool = False,
) -> list[Trajectory]:
    """One multi-turn trajectory per prompt (module docstring).

    Args:
        engine: the rollout engine; one ``generate`` per turn over the running trajectories.
        envs: the batch's environments and tools; row b is slot b.
        prompt_ids: (B,) lists of prompt ids. rows: each prompt's row (``prompt`` and its other
            columns), given to ``reset``.
        seeds: one per row, as a single-turn rollout takes them (:func:`row_seed`).
        params: sampling; ``max_new_tokens`` is one turn's limit, ``stop_token_ids`` must hold the
            EOS token (the end of an assistant turn).
        max_turns: agent turns at most. max_tokens: response tokens (agent + observation) at
            most. max_context: prompt + response tokens at most (None: no limit).
        messages: each prompt's chat messages (None for a text prompt), for ``reset``'s observation.
        logprobs: keep the engine's log μ of each sampled token (``generate(..., logprobs=True)``).
    """
    trajs = _run_batch(
        engine, tokenizer, envs, prompt_ids, rows, seeds, params, max_turns, max_tokens,
        max_context, messages, device, logprobs,
    )  # fmt: skip
    # A worker killed by one trajectory's call took the other environments it held: those did
    # nothing wrong and run again from their own reset, with their own seeds (a resumed run meets
    # the same failure and runs the same ones again, so it stays exact). The failed one does not;
    # each round has one fewer, so this ends.
    todo = sorted(envs.evicted)
    while todo:
        for b in todo:  # the thrown-away attempt counts for nothing
            envs.counts.subtract(trajs[b].counts)
        envs.counts["reruns"] += len(todo)
        again = _run_batch(
            engine, tokenizer, envs, [prompt_ids[b] for b in todo], [rows[b] for b in todo],
            [seeds[b] for b in todo], params, max_turns, max_tokens, max_context,
            [messages[b] for b in todo] if messages else None, device, logprobs,
        )  # fmt: skip
        for b, t in zip(todo, again):
            trajs[b] = t
        todo = [todo[i] for i in sorted(envs.evicted)]
    return trajs


def _run_batch(
    engine, tokenizer, envs, prompt_ids, rows, seeds, params, max_turns, max_tokens,
    max_context, messages, device, logprobs,
) -> list[Trajectory]:  # fmt: skip
    """:func:`run_trajectories` once over the rows, evicted ones included."""
    B = len(prompt_ids)
    if not (len(rows) == len(seeds) == B):
        raise ValueError(f"run_trajectories: {B} prompts, {len(rows)} rows, {len(seeds)} seeds")
    if tokenizer.eos_token_id not in params.stop_token_ids:
        raise ValueError("run_trajectories: params.stop_token_ids must hold the EOS token")
    if max_turns < 1 or max_tokens < 1:
        raise ValueError(f"max_turns = {max_turns} and max_tokens = {max_tokens} must be ≥ 1")
    stops = set(params.stop_token_ids)
    firsts = envs.reset(rows)  # reads each row's tools column: the tools its trajectory is offered
    messages = messages or [None] * B
    trajs = []
    for b, p in enumerate(prompt_ids):
        try:
            tools = envs.schemas(b) if envs.tools else None
            trajs.append(Trajectory(first_prompt(tokenizer, p, messages[b], firsts[b], tools)))
        except (TypeError, ValueError) as e:  # a reset() observation that cannot be a prompt
            raise AgentError(
                f"env.factory {envs.name}: reset's observation for row {b} of the batch "
                f"(prompt {rows[b].get('prompt')!r:.60}): {e}"
            ) from None
    running = list(range(B))
    for turn in range(max_turns):
        limits = {}
        for b in list(running):
            t = trajs[b]
            room = {"turn_length": params.max_new_tokens, "max_tokens": max_tokens - len(t.ids)}
            if max_context is not None:
                room["context"] = max_context - len(t.prompt_ids) - len(t.ids)
            why = min(room, key=room.get)
            if room[why] < 1:
                _finish(t, why, ended=False)
                running.remove(b)
            else:
                limits[b] = (room[why], why)
        if not running:
            break
        ids, mask = pad_left(
            [trajs[b].prompt_ids + trajs[b].ids for b in running], tokenizer.pad_token_id, device
        )
        turn_seeds = [seeds[b] if turn == 0 else row_seed(seeds[b], turn) for b in running]
        longest = max(n for n, _ in limits.values())
        turn_params = replace(params, max_new_tokens=longest)
        if logprobs:
            sampled, mu = engine.generate(ids, mask, turn_seeds, turn_params, logprobs=True)
            mu = mu.float().tolist()
        else:
            sampled = engine.generate(ids, mask, turn_seeds, turn_params)
        sampled = sampled.tolist()
        texts = {}
        for i, (b, seq) in enumerate(zip(running, sampled)):
            t, (limit, why) = trajs[b], limits[b]
            first_stop = next((j for j, x in enumerate(seq) if x in stops), len(seq))
            seq = seq[: min(first_stop + 1, limit)]
            start = len(t.ids)
            t.ids += seq
            t.agent_mask += [True] * len(seq)
            if logprobs:
                t.behaviour_logprobs += mu[i][: len(seq)]
            stopped = bool(seq) and seq[-1] in stops
            t.turns.append(Turn(start, len(t.ids), tokenizer.decode(seq[:-1] if stopped else seq)))
            if stopped:
                texts[b] = t.turns[-1].text
            else:
                _finish(t, why, ended=False)
        results = envs.step(texts) if texts else {}
        running = []
        for b, r in results.items():
            t = trajs[b]
            t.turns[-1].reward = r.reward
            t.counts.update(r.counts)
            if r.done:
                _finish(t, "failed" if r.failed else "done", ended=True, failed=r.failed)
                continue
            if turn + 1 == max_turns:
                _finish(t, "max_turns", ended=False)
                continue
            try:
                obs = observation_ids(tokenizer, r.messages)
            except Exception as e:  # the template raised (jinja2's TemplateError, ...)
                raise AgentError(
                    f"the chat template cannot render the observation after turn {turn + 1} of "
                    f"row {b} of the batch ({type(e).__name__}: {e}); set model.chat_template to "
                    "one that renders tool and user messages after an assistant turn"
                ) from None
            over = len(t.ids) + len(obs) >= max_tokens
            if max_context is not None and len(t.prompt_ids) + len(t.ids) + len(obs) >= max_context:
                _finish(t, "max_tokens" if over else "context", ended=False)
                continue
            if over:
                _finish(t, "max_tokens", ended=False)
                continue
            t.ids += obs
            t.agent_mask += [False] * len(obs)
            if logprobs:
                t.behaviour_logprobs += [0.0] * len(obs)
            t.turns[-1].observation = r.messages
            t.turns[-1].obs_end = len(t.ids)
            running.append(b)
    for b in running:  # only reachable when max_turns stopped the loop with rows still running
        _finish(trajs[b], "max_turns", ended=False)
    rewards = envs.outcome_rewards(list(range(B)))
    for b, t in enumerate(trajs):
        t.env_reward = 0.0 if t.failed else rewards[b]
    envs.release()
    return trajs


def _finish(t: Trajectory, stop: str, *, ended: bool, failed: bool = False) -> None:
    t.stop, t.ended, t.failed = stop, ended, failed


# ----------------------------------------------------------------------------------------------
# Into today's Rollout
# ----------------------------------------------------------------------------------------------


def to_rollout(trajs: list[Trajectory], pad_id: int, device="cpu") -> Rollout:
    """The trajectories as a :class:`~proximal.rollout.sampling.Rollout` with holes: prompts
    left-padded (P), responses — every token after the prompt — right-padded (T);
    ``response_mask`` = the agent mask, ``context_mask`` every real token (agent and observation:
    what attention sees, carried by ``select`` and ``experience.gather``); ``behaviour_logprobs`` the
    engine's log μ when the trajectories kept them."""
    prompt_ids, prompt_mask = pad_left([t.prompt_ids for t in trajs], pad_id, device)
    response_ids, token_mask = pad_right([t.ids for t in trajs], pad_id, device)
    agent = torch.zeros_like(token_mask, dtype=torch.bool)
    for b, t in enumerate(trajs):
        agent[b, : len(t.agent_mask)] = torch.tensor(t.agent_mask, dtype=torch.bool)
    ended = torch.tensor([t.ended for t in trajs], dtype=torch.bool, device=device)
    mu = None
    if (
        trajs
        and all(len(t.behaviour_logprobs) == len(t.ids) for t in trajs)
        and any(t.behaviour_logprobs for t in trajs)
    ):
        mu = torch.zeros(token_mask.shape, dtype=torch.float32)
        for b, t in enumerate(trajs):
            mu[b, : len(t.behaviour_logprobs)] = torch.tensor(
                t.behaviour_logprobs, dtype=torch.float32
            )
        mu = mu.to(device)
    return Rollout(
        prompt_ids,
        prompt_mask,
        response_ids,
        agent,
        ended,
        behaviour_logprobs=mu,
        context_mask=token_mask.bool(),
    )


def turn_rewards(
    trajs: list[Trajectory], T: int, dtype=torch.float32, device="cpu"
) -> torch.Tensor:
    """(B, T) each turn's reward on the last agent token of its turn, 0 elsewhere — added to the
    shaped rewards before GAE (the outcome score goes on the last agent token of the trajectory, by
    :func:`proximal.core.advantages.shape_rewards`). For GRPO/RLOO, the sum of a trajectory's
    turn rewards joins its score instead (their baselines are over whole trajectories)."""
    out = torch.zeros(len(trajs), T, dtype=dtype)
    for b, t in enumerate(trajs):
        for turn in t.turns:
            if turn.end > turn.start and turn.reward:
                out[b, turn.end - 1] += turn.reward
    return out.to(device)
