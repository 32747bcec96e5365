"""What the online methods (PPO, GRPO and RLOO) share around their algorithm: the run's inputs, its
responder, models, engine, held-out evaluation and sampler (:func:`set_up`); restoring and beginning
the run (:func:`begin`); the step's collect arguments, the metrics every online step logs, the log
line and the sampled rows (:func:`common_metrics`, :func:`log_step`); the checkpoint, the stop and
the final export (:func:`end_step`, :func:`finish`).

Functions and one dataclass, no base class: each trainer's ``train`` calls them in order and keeps
its own algorithm — experience, advantages, update — readable top to bottom between them, as the
numbered steps of its docs page (docs/ppo.md, docs/grpo.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from proximal import dist
from proximal.agents.collect import run_responder, run_tools
from proximal.config import ConfigError
from proximal.data.prompts import PromptSet
from proximal.data.sampler import Sampler
from proximal.evaluation import (
    TrainingEval,
    eval_postfix,
    held_out_metrics,
    reward_weights,
    training_eval,
)
from proximal.logging import write_samples
from proximal.rollout.collect import (
    Collected,
    Responder,
    Sampling,
    collect,
    draw,
    load_inputs,
    score,
)
from proximal.rollout.engine import RolloutEngine, build_engine
from proximal.rollout.generator import (
    StaleRollouts,
    pin_process,
    scheduled_version,
    split_cores,
    staleness_of,
)
from proximal.rollout.reward_http import load_served_rewards
from proximal.rollout.vllm import preflight_problems
from proximal.train.run import Run, due, open_run
from proximal.train.sections import agent_max_tokens


@dataclass
class Online:
    """An online run's shared pieces, as :func:`set_up` builds them: the run, its reward
    ``functions`` and ``prompts``, the ``responder`` (one response, or a multi-turn trajectory, per
    prompt row), the trainer's ``models`` (its ``build_models``: ``tokenizer``, ``actor``,
    ``reference``, ``scorer``…), the held-out ``evaluation`` (None: none), the prompt ``sampler``
    and the rollout ``engine``. ``held_out``: step → ``eval/*`` metrics, once :func:`begin` ran."""

    run: Run
    functions: dict
    prompts: PromptSet
    responder: Responder
    models: object
    evaluation: TrainingEval | None
    sampler: Sampler
    engine: RolloutEngine
    held_out: Callable[[int], dict] = field(default=lambda step: {})
    eval_engine: RolloutEngine | None = None  # eval.engine, where it is not the rollout's
    # rollout.staleness ≥ 1: the batches a generator process samples ahead (None: synchronous),
    # with what the generator builds its responder and engine from
    stale: StaleRollouts | None = None
    make_responder: Callable[[], Responder] | None = None
    engine_kwargs: dict = field(default_factory=dict)

    def collect_args(self, cfg, group_size: int = 1) -> dict:
        """What :func:`proximal.rollout.collect.collect` takes from the run, as keyword arguments
        (the sampling, stops and guards of ``cfg.rollout``; ``group_size`` responses per prompt)."""
        return dict(
            prompt_set=self.prompts,
            sampler=self.sampler,
            engine=self.engine,
            scorer=self.models.scorer,
            tokenizer=self.models.tokenizer,
            seed=cfg.train.seed,
            device=self.run.device,
            group_size=group_size,
            responder=self.responder,
            **cfg.rollout.collect_kwargs(),
        )


def set_up(method: str, cfg, resume_dir, build_models: Callable) -> Online:
    """The run opened (:func:`~proximal.train.run.open_run`); the reward functions and prompts
    loaded first, so that a mistake in either is reported before any model loads; the responder
    chosen, once (``env`` / ``tools``: a multi-turn trajectory per row, docs/agents.md); the models
    built by the trainer's ``build_models(cfg, device, world_size, functions)``; the held-out
    evaluation (``eval``), the prompt sampler and the rollout engine over the actor."""
    t, mc, r, d = cfg.train, cfg.model, cfg.rollout, cfg.data
    run = open_run(
        method,
        output_dir=cfg.output.dir,
        overwrite=cfg.output.overwrite,
        seed=t.seed,
        device=t.device,
        dist_timeout_s=t.dist_timeout_s,
        cpu_matmul=t.cpu_matmul,
        compile=t.compile,
        resume_dir=resume_dir,
        total=t.steps,
        verbose=cfg.output.verbose,
    )
    functions, prompts = load_inputs(
        mc.reward_functions,
        d.prompts,
        mc.path,
        max_prompt_length=d.max_prompt_length,
        on_long_prompt=d.on_long_prompt,
        on_empty_prompt=d.on_empty_prompt,
        chat_template=mc.chat_template,
        split=d.split,
        columns=d.columns,
        tools=run_tools(cfg.env, cfg.tools),  # each row rendered with the tools it is offered
        reward_function_kwargs=mc.reward_function_kwargs,
        served=load_served_rewards(mc.reward_urls, mc.reward_judges, mc.http_settings()),
    )
    make_responder = functools.partial(
        run_responder,
        cfg.env,
        cfg.tools,
        max_new_tokens=r.max_new_tokens,
        max_tokens=agent_max_tokens(cfg.env, r.max_new_tokens),
        has_reward_source=mc.reward_model is not None or bool(functions),
        columns=prompts.columns,
        source=str(d.prompts),
        log=str(Path(run.dir) / "tools.log"),  # the tools' prints, not the trainer's stdout
    )
    responder = make_responder()
    if "vllm" in (
        r.engine,
        cfg.eval.engine,
    ):  # before any model loads: package, architecture, heads
        vllm_preflight(mc.path, device=run.device.type)
    models = build_models(cfg, run.device, run.world_size, functions)
    responder.ready(models.tokenizer, models.actor)  # multi-turn: the chat template, the context
    evaluation = training_eval(
        cfg.eval,
        models.tokenizer,
        functions=functions,
        weights=reward_weights(mc.reward_model, mc.reward_model_weight, mc.function_weights()),
        max_new_tokens=r.max_new_tokens,
        seed=t.seed,
        max_prompt_length=d.max_prompt_length,
        timeout_s=mc.reward_timeout_s,
        responder=responder,  # env/tools: the held-out responses are trajectories, as the run's
    )
    sampler = Sampler(
        len(prompts),
        r.batch_size,
        seed=t.seed,
        shuffle=d.shuffle,
        rank=run.rank,
        world_size=run.world_size,
    )
    engine_kwargs = dict(
        gather_weights=r.gather_weights,
        lean_decode=r.lean_decode,
        precision=r.engine_precision(t.precision),
        kv_cache_bytes=int(r.kv_cache_gib * 2**30),
        max_model_len=longest_sequence(cfg),
        seed=t.seed + run.rank,
    )
    engine = build_engine(r.engine, models.actor, models.tokenizer.pad_token_id, **engine_kwargs)
    eval_engine = None
    if evaluation is not None and (cfg.eval.engine or r.engine) != r.engine:
        eval_engine = build_engine(
            cfg.eval.engine,
            models.actor,
            models.tokenizer.pad_token_id,
            gather_weights=r.gather_weights,
            lean_decode=r.lean_decode,
            kv_cache_bytes=int(cfg.eval.kv_cache_gib * 2**30),
            max_model_len=longest_sequence(cfg),
            seed=t.seed + run.rank,
            kv_field="eval.kv_cache_gib",
        )
    stale = None
    if r.staleness >= 1:
        stale = StaleRollouts(r.staleness, r.staleness_mode, timeout_s=r.generator_timeout_s)
    return Online(
        run,
        functions,
        prompts,
        responder,
        models,
        evaluation,
        sampler,
        engine,
        eval_engine=eval_engine,
        stale=stale,
        make_responder=make_responder,
        engine_kwargs=engine_kwargs,
    )


def longest_sequence(cfg) -> int:
    """The longest prompt plus response an online run makes (rollout and held-out evaluation):
    the vllm engine's ``max_model_len``."""
    r = cfg.rollout
    response = agent_max_tokens(cfg.env, r.max_new_tokens)
    if cfg.eval.prompts is not None:
        response = max(response, agent_max_tokens(cfg.env, cfg.eval.max_new_tokens or 0))
    return cfg.data.max_prompt_length + response


def vllm_preflight(source, *, device: str) -> None:
    """ConfigError (one line) when vLLM is missing or cannot run the policy at ``source``: read
    from its config alone, before any weight loads. A policy given as a Python object is checked
    when the engine is built."""
    if not isinstance(source, str):
        return
    problems = preflight_problems(source, device=device)
    if problems:
        raise ConfigError(problems[0])


def begin(
    o: Online, cfg, trained: dict, stateful: dict, counters: dict, resident: dict
) -> tuple[int, dict]:
    """``(start step, counters)``: the checkpoint restored (``trained``, ``stateful``; the
    ``counters``' zeros under the restored values), the run begun (progress, loggers),
    ``models.json`` written of ``resident`` (``{name: module}``, in order) and the engine, the best
    checkpoint tracked (``output.keep_best``), :attr:`Online.held_out` bound to the live models,
    and the starting policy evaluated on a fresh run."""
    t, r, run = cfg.train, cfg.rollout, o.run
    if o.stale is not None:  # its batches in flight are checkpointed with the rest
        stateful["rollouts"] = o.stale
    start, restored = run.restore(trained, stateful)
    counters = {**counters, **restored}
    run.begin(
        cfg,
        start=start,
        total=t.steps,
        counters=counters,
        progress=cfg.output.progress,
        tensorboard=cfg.output.tensorboard,
        wandb_project=cfg.output.wandb_project,
        precision=t.precision,
        rollout_precision=r.engine_precision(t.precision),
    )
    run.record_models(engine=o.engine, **resident)
    run.track_best(cfg.output.keep_best, cfg.output.keep_best_mode)
    o.held_out = held_out_metrics(  # the sampled held-out metrics (eval) at a step, {} when not due
        o.evaluation,
        t.steps,
        o.models.actor,
        reference=o.models.reference,
        tokenizer=o.models.tokenizer,
        scorer=o.models.scorer,
        engine=o.eval_engine or o.engine,
        refresh=o.eval_engine is not None,  # an engine of its own takes the weights before each
    )
    if start == 0 and o.evaluation is not None:
        run.log(0, o.held_out(0))  # the starting policy
    if o.stale is not None:
        start_generator(o, cfg, start)
    return start, counters


def start_generator(o: Online, cfg, start: int) -> None:
    """rollout.staleness k ≥ 1: the trainer and the generator pinned to their cores (CPU, one
    process), the generator started over the policy as restored (version ``start``), and the
    batches of steps start + 1 … start + 1 + k requested that the checkpoint did not hold, by
    version ``start`` (:func:`~proximal.rollout.generator.scheduled_version`) — on a fresh run
    those of steps 1 … k + 1, all of version 0."""
    r, k = cfg.rollout, cfg.rollout.staleness
    trainer_cores, generator_cores = split_cores(
        r.generator_cores, device=o.run.device.type, world_size=o.run.world_size
    )
    if trainer_cores is not None:  # put back when the generator stops (StaleRollouts.close)
        o.stale.unpin = pin_process(trainer_cores)
    o.stale.start(
        o.models.actor,
        o.models.tokenizer,
        version=start,
        make_responder=o.make_responder,
        engine=r.engine,
        engine_kwargs=o.engine_kwargs,
        device=o.run.device,
        cores=generator_cores,
        threads=len(generator_cores) if generator_cores else torch.get_num_threads(),
    )
    for step in range(start + 1, min(start + 1 + k, cfg.train.steps) + 1):
        if step not in o.stale.pending:
            request(o, cfg, step, scheduled_version(step, k, start))
    if trainer_cores is not None and o.run.is_main:
        o.run.say(
            f"rollout.staleness {k} ({r.staleness_mode}): generator on core(s) "
            f"{','.join(map(str, generator_cores))}, trainer on "
            f"{','.join(map(str, trainer_cores))}; correction {r.correction_mode}"
        )


def request(o: Online, cfg, step: int, version: int) -> None:
    """Ask the generator for ``step``'s batch, sampled by ``version``: its prompts drawn now."""
    r, group_size = cfg.rollout, getattr(cfg.rollout, "group_size", 1)
    drawn = draw(
        step, prompt_set=o.prompts, sampler=o.sampler, seed=cfg.train.seed, group_size=group_size
    )
    sampling = Sampling(
        r.max_new_tokens, r.temperature, r.top_p, r.top_k, r.stop_token_ids, r.stop_strings
    )
    o.stale.request(step, version, drawn, sampling)


def collect_step(o: Online, cfg, step: int, group_size: int = 1) -> Collected:
    """Steps 1–3 of step ``step``: sampled now by the policy as it is (rollout.staleness 0,
    :func:`~proximal.rollout.collect.collect`), or taken from the generator, which sampled it by
    the version of step − k, and scored here (``rollout/staleness``, ``rollout/version`` and
    ``time/wait_s``, the seconds the trainer waited for it, among its metrics)."""
    if o.stale is None:
        return collect(step, **o.collect_args(cfg, group_size=group_size))
    taken = o.stale.take(step, o.run.device)
    r = cfg.rollout
    got = score(
        step,
        taken.drawn,
        taken.responses,
        taken.generate_s,
        scorer=o.models.scorer,
        responder=o.responder,
        device=o.run.device,
        missing_eos_penalty=r.missing_eos_penalty,
        nonfinite=r.nonfinite_scores,
        group_size=group_size,
    )
    got.metrics.update(
        {
            "rollout/staleness": staleness_of(step, taken.version),
            "rollout/version": taken.version,
            "time/wait_s": taken.wait_s,
        }
    )
    return got


def updated(o: Online, cfg, step: int) -> None:
    """After step ``step``'s update: the engine told; with a generator, version ``step`` published
    to it and the batch of step ``step`` + 1 + k requested of that version."""
    o.engine.after_update()
    if o.stale is None:
        return
    o.stale.published(step)
    ahead = step + 1 + cfg.rollout.staleness
    if ahead <= cfg.train.steps:
        request(o, cfg, ahead, step)


def common_metrics(
    o: Online,
    got: Collected,
    counted: dict[str, int],
    *,
    step_s: float,
    t_train: float,
    tokens: int,
    flops,
    trained_tokens: int | None = None,
) -> dict[str, float]:
    """The metrics every online step logs after its method's own: the responses' length and EOS
    share over the rows trained on, the data counters (``counted``, ``{"data/…": n}``), the epoch
    and the prompts the loader skipped or cut, the generation and training speeds (``tokens``
    trained in ``t_train`` s), the utilisation (``flops``; ``trained_tokens``, default ``tokens``),
    the step's and the run's time, and the responder's (``agent/*``)."""
    w, lengths = got.valid.float(), got.rollout.response_mask.sum(1).float()
    prompts = o.prompts
    return {
        "response/length_mean": dist.global_mean(lengths, w),
        "response/eos_frac": dist.global_mean(got.rollout.ended.float(), w),
        **counted,
        "data/epoch": o.sampler.epoch,
        "data/prompts_skipped_too_long": prompts.skipped_too_long,
        "data/prompts_truncated": prompts.truncated,
        "data/prompts_skipped_empty": prompts.skipped_empty,
        "speed/gen_tokens_per_s": dist.global_sum(lengths.sum()) / max(got.generate_s, 1e-9),
        "speed/train_tokens_per_s": tokens / max(t_train, 1e-9),
        **o.run.utilisation(
            step_s, flops=flops, tokens=tokens if trained_tokens is None else trained_tokens
        ),
        "time/step_s": step_s,
        "time/wall_s": o.run.wall_s(),
        **got.metrics,  # the responder's (agent/*)
    }


def log_step(o: Online, cfg, step: int, got: Collected, metrics: dict, postfix: dict) -> None:
    """The step's metrics logged with the held-out ones when due (the progress line: ``postfix``,
    the agent turns, the held-out score), and its rows written to ``samples.jsonl``."""
    metrics.update(o.held_out(step))
    o.run.log(
        step,
        metrics,
        postfix={
            **postfix,
            **({"turns": metrics["agent/turns"]} if "agent/turns" in metrics else {}),
            **eval_postfix(metrics, cfg.output.keep_best),
        },
    )
    if o.run.is_main:
        write_samples(
            o.run.dir,
            step,
            got.prompts,
            o.models.scorer.completions(got.rollout),
            got.scores,
            got.components,
            got.valid,
            cfg.output.samples_per_step,
            extra=got.records,
        )


def end_step(
    o: Online,
    cfg,
    step: int,
    *,
    trained: dict,
    stateful: dict,
    counters: dict,
    exports: dict,
    export: Callable[[], None],
) -> None:
    """After the last step the trained models exported (``export``), before its checkpoint; a
    checkpoint when due (``train.save_every``), on a new best or on a stop signal (SIGTERM,
    SIGUSR1, SIGINT) on any rank — then, on a signal, the end."""
    t = cfg.train
    if step == t.steps:
        export()
    stop = o.run.stop_requested()
    if stop or due(step, t.steps, t.save_every) or o.run.new_best(step):
        o.run.save(
            step,
            trained=trained,
            stateful=stateful,
            counters=counters,
            exports=exports,
            keep=t.keep_checkpoints,
        )
    if stop:
        o.run.stop(step)


def finish(o: Online, cfg, start: int, export: Callable[[], None]) -> Path:
    """The run's end: a ``--resume`` of a finished run writes its models again (``export``); the
    responder's workers stopped and the engine closed. Returns the run directory."""
    if start == cfg.train.steps:
        export()
    o.responder.close()
    if o.stale is not None:
        o.stale.close()
    o.engine.close()
    if o.eval_engine is not None:
        o.eval_engine.close()
    o.run.finish()
    return o.run.dir
