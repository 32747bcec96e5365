"""Held-out evaluation of a policy, the same for every method: the demo's report and ``proximal compare``.

:func:`evaluate_policy` samples a policy on held-out prompts exactly as the online trainers sample
(:func:`proximal.rollout.sampling.sample`, one seeded generator per response, temperature 1), then
scores every response with whatever is given: a gold score and a rule verifier (``module:function``
reward functions, or callables), the reward model r_ψ, and the exact KL to the reference. Nothing
here trains; the same ``seed`` gives the same responses, so two policies evaluated with one seed
are compared on common random numbers.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from proximal.agents.collect import run_responder
from proximal.config import ConfigError
from proximal.core.passk import group_metrics
from proximal.data.preferences import collate_pairs, load_preference_pairs
from proximal.data.prompts import PromptSet, load_prompts
from proximal.data.sources import read_rows
from proximal.models.heads import lm_logits
from proximal.models.loading import freeze, load_causal_lm, load_sequence_scorer, load_tokenizer
from proximal.models.output import token_kl
from proximal.models.policy import Reference
from proximal.models.reward import load_reward_model, pair_scores
from proximal.rollout.collect import Prompts, Responder, Sampling, SingleTurn
from proximal.rollout.engine import HFEngine, RolloutEngine, row_seed
from proximal.rollout.reward_functions import (
    DEFAULT_TIMEOUT_S,
    call_reward_functions,
    load_reward_function,
    reward_argument_problems,
)
from proximal.rollout.sampling import response_kl
from proximal.rollout.scoring import Scorer
from proximal.specs import import_spec
from proximal.train.sections import EnvSection, ToolsSection, agent_max_tokens

ScoreFn = Callable[[list[str], list[str]], list[float]]
AnswerFn = Callable[[str], "str | None"]


@torch.no_grad()
def evaluate_policy(
    policy: str | Path,
    *,
    reference: str | Path,
    prompts_file: str | Path,
    scores: dict[str, str | ScoreFn],
    max_new_tokens: int,
    max_prompt_length: int | None,
    reward_model: str | Path | None = None,
    weights: dict[str, float] | None = None,
    samples_per_prompt: int = 1,
    seed: int = 0,
    batch_size: int = 256,
    temperature: float = 1.0,
    greedy: bool = False,
    split: str | None = None,
    columns: dict[str, str] | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    env: dict | None = None,
    tools: dict | None = None,
    pass_k: list[int] | None = None,
    pass_threshold: float = 1.0,
    pass_score: str | None = None,
    answer: AnswerFn | None = None,
) -> dict:
    """Sample ``policy`` on the prompts of ``prompts_file`` and measure each response.

    ``scores`` maps a name to a score function ``f(prompts, completions) -> list[float]`` (or its
    ``module:function`` spec), called as the trainers call reward functions (a task's own: the digit
    task's gold score is :data:`proximal.tasks.digits.EVAL_SCORES`); each response has at most
    ``max_new_tokens`` tokens, and prompts longer than ``max_prompt_length`` keep their end (None:
    every prompt whole, as long as the data makes it). No task's scorer or lengths are assumed:
    the caller names them. Per
    response the result holds each of those (None where the function returned None: it does not
    apply to the row; its mean is over the rest), and

    * ``proxy`` — the reward model's score r_ψ(x, y) (with ``reward_model``), computed by the online
      trainers' own :class:`~proximal.rollout.scoring.Scorer`;
    * ``score`` (with ``weights``, ``{name: weight}`` over the names above) — their weighted sum, a
      run's total score when the weights are its ``model.reward_model_weight`` (as ``proxy``) and
      ``model.reward_function_weights``, over the sources that scored the row (None: none did);
    * ``kl`` — Σ_t KL(π(·|s_t) ‖ π_ref(·|s_t)) over the response's tokens, each term exact over the
      vocabulary (the states s_t are sampled). Its expectation is the sequence KL of the
      KL-regularised objective (Ziegler et al. 2019); PPO's ``kl/seq_mean`` estimates the same
      quantity with the sampled-token (k1) estimator;
    * ``length`` — response tokens including EOS (as the trainers' ``response/length_mean``);
      ``eos`` — whether it stopped before ``max_new_tokens``.

    Responses are sampled at ``temperature`` (``greedy``: the most likely token, top-k 1); the KL is
    the policy's own at temperature 1 either way. ``split`` and ``columns`` are the prompt loader's
    (docs/data.md). Returns the means under ``mean`` and every response under ``rows``. A run's
    ``eval`` section (:class:`TrainingEval`) computes the same numbers from the live models.

    ``env`` and ``tools`` — a run's ``env:`` and ``tools:`` sections as dicts (``factory``,
    ``max_turns``, ``max_tokens``; ``functions``, ``format``, ``timeout_s``, ``on_error``,
    ``workers``; missing keys take the sections' defaults) — make each response a multi-turn
    trajectory, the run's way (:func:`proximal.agents.collect.run_responder`; ``max_new_tokens``
    is one turn's limit). The functions then score the whole trajectory, ``kl`` and ``length``
    count the policy's own tokens, and each row has :data:`~proximal.agents.collect.AGENT_COLUMNS`
    (and ``env``, the environment's ``get_reward()``).

    ``pass_k`` (a list of k ≤ ``samples_per_prompt``) adds to the means ``pass@k`` for each k,
    ``mean@n`` and ``maj@n`` over the score named ``pass_score`` (None: ``score``, the weighted
    total), a response passing when that score ≥ ``pass_threshold``; ``answer`` gives maj@n's
    answer of a completion (None: the completion stripped). See :func:`pass_metrics`.
    """
    functions = {
        name: load_reward_function(f) if isinstance(f, str) else f for name, f in scores.items()
    }
    tokenizer = load_tokenizer(str(policy), role="policy")
    actor = load_causal_lm(str(policy), role="policy")
    ref = load_causal_lm(str(reference), role="reference")
    for m in (actor, ref):
        freeze(m)
    rm = rm_tokenizer = None
    if reward_model is not None:
        rm_tokenizer = load_tokenizer(str(reward_model), role="reward model", padding_side="right")
        rm = load_sequence_scorer(str(reward_model), pad_token_id=rm_tokenizer.pad_token_id)
        freeze(rm)
    responder = eval_responder(env or {}, tools or {}, max_new_tokens)
    try:
        responder.ready(tokenizer, actor)
        prompts = load_prompts(  # each row rendered with the tools its trajectory is offered
            str(prompts_file),
            tokenizer,
            max_length=max_prompt_length if max_prompt_length is not None else sys.maxsize,
            split=split,
            columns=columns,
            tools=responder.row_tools,
        )
        measured = evaluate_loaded(
            actor,
            reference=ref,
            tokenizer=tokenizer,
            prompts=prompts,
            functions=functions,
            reward_model=rm,
            reward_tokenizer=rm_tokenizer,
            weights=weights,
            samples_per_prompt=samples_per_prompt,
            max_new_tokens=max_new_tokens,
            seed=seed,
            batch_size=batch_size,
            temperature=temperature,
            greedy=greedy,
            timeout_s=timeout_s,
            responder=responder,
            pass_k=pass_k,
            pass_threshold=pass_threshold,
            pass_score=pass_score,
            answer=answer,
        )
    finally:
        responder.close()
    return {"policy": str(policy), **measured}


def eval_responder(env: dict, tools: dict, max_new_tokens: int) -> Responder:
    """The responder of a run's ``env`` and ``tools`` sections given as dicts (missing keys: the
    sections' defaults, :class:`~proximal.train.sections.EnvSection` and ``ToolsSection``; a key
    they do not have is ignored), its environments built and their workers started when either
    names anything. ``max_new_tokens`` is one turn's limit (``env.max_tokens`` null:
    ``env.max_turns`` of them)."""
    env_s, tools_s = _section(EnvSection, env), _section(ToolsSection, tools)
    return run_responder(
        env_s,
        tools_s,
        max_new_tokens=max_new_tokens,
        max_tokens=agent_max_tokens(env_s, max_new_tokens),
        has_reward_source=True,
    )


def _section(cls, values: dict):
    """``cls`` (a config section) with the fields ``values`` gives, the rest its defaults."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


@torch.no_grad()
def evaluate_loaded(
    actor: torch.nn.Module,
    *,
    reference,
    tokenizer,
    prompts: PromptSet,
    functions: dict[str, ScoreFn],
    reward_model: torch.nn.Module | None = None,
    reward_tokenizer=None,
    weights: dict[str, float] | None = None,
    samples_per_prompt: int = 1,
    max_new_tokens: int,
    seed: int = 0,
    batch_size: int = 256,
    temperature: float = 1.0,
    greedy: bool = False,
    engine: RolloutEngine | None = None,
    step: int | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    responder: Responder | None = None,
    pass_k: list[int] | None = None,
    pass_threshold: float = 1.0,
    pass_score: str | None = None,
    answer: AnswerFn | None = None,
) -> dict:
    """:func:`evaluate_policy` on models already loaded: ``actor`` (sampled through ``engine``, or
    an :class:`~proximal.rollout.engine.HFEngine` over it), ``reference`` (a module, a
    :class:`~proximal.models.policy.Reference` — a LoRA actor with its adapters off — or None: no
    ``kl``), the rendered ``prompts``, the score ``functions`` and the ``reward_model``. Response j
    (prompt j // samples_per_prompt) draws from the generator seeded ``row_seed(seed, 0, j)``,
    whatever the batch it falls in. ``step`` names the step in a failing function's message;
    ``timeout_s`` bounds each call of the functions (``model.reward_timeout_s``). ``responder``: how
    each response is made (:class:`~proximal.rollout.collect.Responder`; default one ``generate``):
    a run's multi-turn one draws turn 0 from that seed and turn k from ``row_seed`` of it and k, as
    its rollouts draw them, and leaves the environments' counts as they were (a run's ``agent/*``
    metrics never see the evaluation's calls). ``pass_k`` … ``answer``: :func:`pass_metrics`'s, its
    numbers added to the means.
    Returns ``{"n", "samples_per_prompt", "seed", "mean", "rows"}``."""
    scorer = Scorer(  # the reward model's scores as the trainers compute them
        tokenizer,
        reward_model=reward_model,
        reward_tokenizer=reward_tokenizer,
        micro_batch_size=batch_size,
    )
    order = [i for i in range(len(prompts)) for _ in range(samples_per_prompt)]
    device = next(actor.parameters()).device
    responder = responder if responder is not None else SingleTurn(max_new_tokens)
    engine = engine if engine is not None else HFEngine(actor, tokenizer.pad_token_id)
    sampling = Sampling(max_new_tokens, temperature, top_k=1 if greedy else 0)
    rows = []
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        seeds = [row_seed(seed, 0, j) for j in range(start, start + len(idx))]  # one per response
        batch = Prompts.of(prompts, idx, seeds)
        texts, messages, columns = batch.texts, batch.messages, batch.columns
        got = responder.respond(
            engine,
            tokenizer,
            batch,
            sampling,
            device=device,
            behaviour_logprobs=False,
            keep_counts=True,
        )
        r, given = got.rollout, got.completions
        completions = scorer.completions(r)
        scored = {}
        if reward_model is not None:
            _, components = scorer(
                r, texts, messages, columns=columns, step=step, completions=given
            )
            scored["proxy"] = [float(x) for x in components["reward_model"]]
        # The functions called as the trainers call them (their arguments, the time limit), their
        # scores kept in float64: a gold score's mean is exact, not float32's.
        arguments = scorer.function_arguments(r, texts, messages, columns, step, given)
        values, applies = call_reward_functions(
            functions, arguments, n=len(idx), step=step, timeout_s=timeout_s, dtype=torch.float64
        )
        scored.update(  # None where the function does not apply to the row (it returned None)
            {
                k: [float(x) if a else None for x, a in zip(v.tolist(), applies[k].tolist())]
                for k, v in values.items()
            }
        )
        scored.update(responder.eval_scores(got))  # a multi-turn run's environment outcome
        # over the sources that scored the row, as a run's total; None: none
        if weights is not None:
            scored["score"] = [_weighted(scored, weights, j) for j in range(len(idx))]
        kl = _sequence_kl(actor, reference, r)
        for j, completion in enumerate(completions):
            rows.append(
                {
                    "prompt": texts[j],
                    "response": completion,
                    **{k: v[j] for k, v in scored.items()},
                    **({"kl": float(kl[j])} if kl is not None else {}),
                    "length": int(r.response_mask[j].sum()),
                    "eos": bool(r.ended[j]),
                    **responder.eval_row(got, j),
                }
            )
    keys = [*scored, *(["kl"] if reference is not None else []), "length", "eos"]
    keys += responder.eval_keys
    mean = {k: _mean([row[k] for row in rows]) for k in keys}
    if pass_k:
        mean.update(
            pass_metrics(
                rows,
                samples_per_prompt,
                ks=pass_k,
                threshold=pass_threshold,
                score=pass_score,
                answer=answer,
            )
        )
    return {
        "n": len(rows),
        "samples_per_prompt": samples_per_prompt,
        "seed": seed,
        "mean": mean,
        "rows": rows,
    }


def pass_metrics(
    rows: list[dict],
    samples_per_prompt: int,
    *,
    ks: list[int],
    threshold: float,
    score: str | None = None,
    answer: AnswerFn | None = None,
) -> dict[str, float]:
    """``pass@k`` for each k of ``ks``, ``mean@n`` and ``maj@n`` (:func:`proximal.core.passk.
    group_metrics`) of :func:`evaluate_loaded`'s ``rows``: rows ``p·n … p·n + n − 1`` are prompt p's
    n = ``samples_per_prompt`` responses (as they are sampled, whatever the batches). Every number
    reads the rows' ``score`` (None: ``"score"``, the run's weighted total); a response passes when
    it is ≥ ``threshold`` (a None score, the function not applying, is no pass); maj@n's answer of a
    response is ``answer(response)`` (None: the response text stripped of surrounding whitespace).
    ConfigError when the rows have no such score."""
    name = score if score is not None else "score"
    if rows and name not in rows[0]:
        scores = [
            k for k, v in rows[0].items() if (v is None or isinstance(v, float)) and k != "kl"
        ]
        have = ", ".join(scores) or "none"
        said = "null (the run's total score, eval/score)" if score is None else repr(score)
        raise ConfigError(
            f"eval.pass_score = {said}: the held-out evaluation has no such score; it has: {have}"
        )
    n = samples_per_prompt
    groups = [rows[p : p + n] for p in range(0, len(rows), n)]
    extract = answer if answer is not None else str.strip
    return group_metrics(
        [[row[name] for row in g] for g in groups],
        [[extract(row["response"]) for row in g] for g in groups],
        ks=ks,
        threshold=threshold,
    )


def _weighted(scored: dict[str, list], weights: dict[str, float], j: int) -> float | None:
    """Row ``j``'s weighted sum over the sources that scored it (None: no source did)."""
    parts = [(w, scored[k][j]) for k, w in weights.items() if scored[k][j] is not None]
    return sum(w * x for w, x in parts) if parts else None


def _mean(values: list) -> float:
    """The mean over the rows that have a value (a score function's None left out); NaN for none."""
    have = [float(v) for v in values if v is not None]
    return sum(have) / len(have) if have else float("nan")


def _sequence_kl(actor, reference, r) -> torch.Tensor | None:
    """Σ_t of the exact KL(π ‖ π_ref) per state, (B,): None without a reference. A LoRA actor's
    reference is the actor with its adapters off, so the actor's side is taken first, outside it."""
    if reference is None:
        return None
    if isinstance(reference, Reference):
        if not reference.shares_actor:
            return response_kl(actor, reference.model, r).sum(1)
        P = r.prompt_ids.shape[1]
        ids, att = r.input_ids, r.attention_mask
        logits = lm_logits(actor, ids, att, P - 1, ids.shape[1] - 1)
        with reference.active() as ref:
            kl = token_kl(logits, ref, ids, att, P - 1, ids.shape[1] - 1, mask=r.response_mask)
        return kl.sum(1)
    return response_kl(actor, reference, r).sum(1)


# ----------------------------------------------------------------------------------------------
# During training: a run's ``eval`` section
# ----------------------------------------------------------------------------------------------

#: ``evaluate_loaded``'s mean keys → the metric names a run logs (``eval/<key>`` otherwise).
METRIC_NAMES = {"kl": "eval/kl_ref", "length": "eval/length_mean", "eos": "eval/eos_frac"}


@dataclass
class TrainingEval:
    """A run's sampled held-out evaluation (its ``eval`` section, :class:`proximal.train.sections.
    EvalSection`), ready to run on the live models: :meth:`due` says when, :meth:`__call__` returns
    the ``eval/*`` metrics — exactly :func:`evaluate_policy`'s means on the same weights with the
    same seed, renamed by :data:`METRIC_NAMES` (each score under ``eval/<name>``, the reward model's
    as ``eval/proxy``, the run's weighted total as ``eval/score``; with ``eval.pass_k``, ``eval/pass@k``
    for each k, ``eval/mean@n`` and ``eval/maj@n``: :func:`pass_metrics`).

    With several processes every rank evaluates every prompt (the same work and the same numbers on
    each; a sharded model's forward passes are collective), so keep held-out sets small."""

    prompts: PromptSet
    functions: dict[str, ScoreFn]
    weights: dict[str, float] | None
    every: int
    samples_per_prompt: int
    max_new_tokens: int
    seed: int
    batch_size: int
    temperature: float
    greedy: bool
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    responder: Responder | None = None  # env/tools: a multi-turn trajectory per response
    pass_k: list[int] | None = None  # eval.pass_k …: eval/pass@k, eval/mean@n, eval/maj@n
    pass_threshold: float = 1.0
    pass_score: str | None = None
    answer: AnswerFn | None = None

    def due(self, step: int, total: int) -> bool:
        """Before the first step (step 0), every ``every`` steps, after the last."""
        return step == 0 or step == total or (self.every > 0 and step % self.every == 0)

    def __call__(
        self,
        actor,
        *,
        reference,
        tokenizer,
        reward_model=None,
        reward_tokenizer=None,
        engine: RolloutEngine | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        out = evaluate_loaded(
            actor,
            reference=reference,
            tokenizer=tokenizer,
            prompts=self.prompts,
            functions=self.functions,
            reward_model=reward_model,
            reward_tokenizer=reward_tokenizer,
            weights=self.weights,
            samples_per_prompt=self.samples_per_prompt,
            max_new_tokens=self.max_new_tokens,
            seed=self.seed,
            batch_size=self.batch_size,
            temperature=self.temperature,
            greedy=self.greedy,
            engine=engine,
            step=step,
            timeout_s=self.timeout_s,
            responder=self.responder,
            pass_k=self.pass_k,
            pass_threshold=self.pass_threshold,
            pass_score=self.pass_score,
            answer=self.answer,
        )
        return {METRIC_NAMES.get(k, f"eval/{k}"): v for k, v in out["mean"].items()}


def held_out_metrics(
    evaluation: TrainingEval | None,
    total: int,
    actor,
    *,
    reference,
    tokenizer,
    scorer,
    engine: RolloutEngine | None,
    refresh: bool = False,
) -> Callable[[int], dict[str, float]]:
    """An online trainer's held-out evaluation bound to its live models: ``step → eval/* metrics``,
    empty when the run has no ``eval`` section or the step is not :meth:`TrainingEval.due` (of
    ``total`` steps). ``scorer``: the run's :class:`~proximal.rollout.scoring.Scorer` (its reward
    model and tokenizer score the held-out responses too). ``refresh``: ``engine`` is the
    evaluation's own (``eval.engine``), told the policy changed before each evaluation."""

    def at(step: int) -> dict[str, float]:
        if evaluation is None or not evaluation.due(step, total):
            return {}
        if refresh:
            engine.after_update()
        return evaluation(
            actor,
            reference=reference,
            tokenizer=tokenizer,
            reward_model=scorer.reward_model,
            reward_tokenizer=scorer.reward_tokenizer,
            engine=engine,
            step=step,
        )

    return at


def reward_weights(
    reward_model: str | None, reward_model_weight: float, function_weights: dict[str, float]
) -> dict[str, float]:
    """The weights of a run's total score over :func:`evaluate_loaded`'s names: the reward model's
    as ``"proxy"`` (when there is one), each reward function's under its ``module:function``."""
    return {**({"proxy": reward_model_weight} if reward_model else {}), **function_weights}


def eval_postfix(metrics: dict, keep_best: str | None) -> dict:
    """The progress bar's held-out entry of a row that has one: ``output.keep_best``'s metric, else
    ``eval/score``, else the first ``eval/*`` score."""
    names = [k for k in metrics if k.startswith("eval/")]
    for name in (keep_best, "eval/score", *names):
        if name in names:
            return {name.removeprefix("eval/"): metrics[name]}
    return {}


def training_eval(
    section,
    tokenizer,
    *,
    functions: dict[str, ScoreFn] | None = None,
    weights: dict[str, float] | None = None,
    max_new_tokens: int,
    seed: int,
    max_prompt_length: int,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    responder: Responder | None = None,
) -> TrainingEval | None:
    """A run's :class:`TrainingEval` from its ``eval`` section (None when ``eval.prompts`` is null):
    the prompts read and rendered now, before any model loads, with the loader every command uses
    (prompts longer than ``max_prompt_length`` keep their end); the run's reward ``functions`` and
    their ``weights`` (the reward model's as ``"proxy"``) plus ``eval.scores``. ``max_new_tokens``
    and ``seed`` stand in for the section's nulls; ``timeout_s`` bounds each call of a function.
    ``responder``: the run's (env/tools: its environments and limits, so each held-out response is
    a multi-turn trajectory as in its rollouts; the rows' ``tools`` columns are checked against
    them)."""
    if section.prompts is None:
        return None
    responder = responder if responder is not None else SingleTurn(max_new_tokens)
    prompts = load_prompts(
        section.prompts,
        tokenizer,
        max_length=max_prompt_length,
        split=section.split,
        columns=section.columns,
        tools=responder.row_tools,
    )
    extra = {
        name: import_spec(spec, f"eval.scores.{name}")
        for name, spec in (section.scores or {}).items()
    }
    functions = {**(functions or {}), **extra}
    # a column a function needs and these prompts lack: said now, not at the first evaluation
    problems = reward_argument_problems(functions, prompts.column_names(), str(section.prompts))
    if problems:
        raise ConfigError(f"eval.prompts: {problems[0]}")
    if problem := responder.check_offered(prompts.columns, str(section.prompts)):
        raise ConfigError(f"eval.prompts: {problem}")
    return TrainingEval(
        prompts=prompts,
        functions=functions,
        weights=weights,
        every=section.every,
        samples_per_prompt=section.samples_per_prompt,
        max_new_tokens=section.max_new_tokens or max_new_tokens,
        seed=section.seed if section.seed is not None else seed,
        batch_size=section.batch_size,
        temperature=section.temperature,
        greedy=section.greedy,
        timeout_s=timeout_s,
        responder=responder,
        pass_k=section.pass_k,
        pass_threshold=section.pass_threshold,
        pass_score=section.pass_score,
        answer=import_spec(section.answer, "eval.answer") if section.answer else None,
    )


@torch.no_grad()
def reward_model_gold_agreement(
    reward_model: str | Path,
    pairs_file: str | Path,
    gold: Callable[[str, str], float],
) -> float:
    """How often the reward model orders a held-out pair as ``gold(prompt, response)`` does (a task's
    gold score: the digit task's :func:`proximal.tasks.digits.gold`), over the pairs whose gold
    differs.

    Pairs are loaded, batched and scored exactly as ``proximal rm`` evaluates them.
    """
    tok = load_tokenizer(str(reward_model), role="reward model", padding_side="right")
    rm, _ = load_reward_model(str(reward_model), "float32", tok)
    freeze(rm)
    pairs, _ = load_preference_pairs(pairs_file, tok, max_length=10_000)
    records = [r for _, r in read_rows(pairs_file)]
    r_w, r_l = pair_scores(rm, collate_pairs(pairs, tok.pad_token_id))
    agree = n = 0
    for rec, s_w, s_l in zip(records, r_w.tolist(), r_l.tolist()):
        g_w, g_l = gold(rec["prompt"], rec["chosen"]), gold(rec["prompt"], rec["rejected"])
        if g_w != g_l:
            n += 1
            agree += (s_w > s_l) == (g_w > g_l)
    return agree / n
