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

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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
from proximal.rollout.collect import Collected, Responder, load_inputs
from proximal.rollout.engine import RolloutEngine, build_engine
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
    responder = run_responder(
        cfg.env,
        cfg.tools,
        max_new_tokens=r.max_new_tokens,
        max_tokens=agent_max_tokens(cfg.env, r.max_new_tokens),
        has_reward_source=mc.reward_model is not None or bool(functions),
        columns=prompts.columns,
        source=str(d.prompts),
        log=str(Path(run.dir) / "tools.log"),  # the tools' prints, not the trainer's stdout
    )
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
    engine = build_engine(
        r.engine,
        models.actor,
        models.tokenizer.pad_token_id,
        gather_weights=r.gather_weights,
        lean_decode=r.lean_decode,
        precision=r.engine_precision(t.precision),
        kv_cache_bytes=int(r.kv_cache_gib * 2**30),
        max_model_len=longest_sequence(cfg),
        seed=t.seed + run.rank,
    )
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
    return start, counters


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
    o.engine.close()
    if o.eval_engine is not None:
        o.eval_engine.close()
    o.run.finish()
    return o.run.dir
