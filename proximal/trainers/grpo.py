"""Critic-free online RL: GRPO (Shao et al. 2024, DeepSeekMath), its Dr. GRPO (Liu et al. 2025) and
DAPO (Yu et al. 2025) variants, and RLOO (Ahmadian et al. 2024) — two models, the actor π_θ and
(β > 0) the frozen reference π_ref, plus a reward model and/or rule verifiers.

One step reads top to bottom in :func:`train`, along the same data flow as PPO's: (1) a global batch
of prompts, (2) G responses to each sampled from π_θ — a group —, (3) scored, (4) the experience:
log π_old and (β > 0) log π_ref, gathered so that every rank holds the whole generation batch,
(5) one advantage per response from its group's scores instead of a critic and GAE, with DAPO's
filters, (6) ``grpo.iterations`` passes of the clipped surrogate + β·k3 over mini-batches
(:func:`grpo_update`), (7) logs and checkpoints. Steps 1–4 are PPO's own code
(:mod:`proximal.rollout`); the math is in :mod:`proximal.core` (docs/formulas.md); set-up,
checkpoints and logging are the shared layer's (:mod:`proximal.train`).

With several processes each rank samples, scores and computes the experience of whole prompts (a
group never splits across ranks, :func:`proximal.rollout.collect.collect`); after the gather every
rank computes the same advantages from the whole batch (so ``grpo.advantage: batch`` needs no
reduction), and the update cuts mini-batches in one global order, each rank training on its part
with every normaliser global — so 1 and N processes compute the same step.

Tensor notation: B responses in the generation batch (rollout.batch_size prompts × G), P padded
prompt length, T padded response length, V vocabulary.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from proximal import dist
from proximal.agents.collect import run_responder, run_tools
from proximal.config import check_valid
from proximal.core import (
    aggregation_units,
    cispo_policy_loss,
    correction_weights,
    grpo_advantages,
    grpo_policy_loss,
    gspo_policy_loss,
    kl_penalty,
    kl_reward_advantages,
    masked_aggregate,
    masked_sum,
    reference_kl_loss,
    reinforce_pp_advantages,
    sequence_correction_weights,
)
from proximal.data.chat import set_chat_template
from proximal.data.sampler import Sampler
from proximal.evaluation import (
    eval_postfix,
    held_out_metrics,
    reward_weights,
    training_eval,
)
from proximal.logging import write_samples
from proximal.models.flops import Tokens
from proximal.models.policy import build_policy
from proximal.rollout.collect import collect, load_inputs
from proximal.rollout.engine import HFEngine, row_seed
from proximal.rollout.experience import Experience, compute_experience, gather
from proximal.rollout.sampling import response_logprobs
from proximal.rollout.scoring import build_scorer, score_metrics
from proximal.train.batches import accumulate
from proximal.train.checkpoint import export_final
from proximal.train.command import config_command
from proximal.train.correction import FirstStepLogprobs, mismatch_metrics
from proximal.train.optim import Trained, at_step, clip_and_step, optimizer_and_scheduler
from proximal.train.perf import online_step_flops
from proximal.train.run import due, open_run
from proximal.train.sections import agent_max_tokens
from proximal.trainers.grpo_config import ADVANTAGES, REINFORCE_PP, GRPOConfig

__all__ = ["GRPOConfig", "train", "grpo_update", "cli"]


def train(cfg: GRPOConfig, resume_dir: str | Path | None = None) -> Path:
    """Run GRPO (or RLOO, Dr. GRPO, DAPO) as configured; return the run directory. ``resume_dir``
    continues a saved run exactly."""
    check_valid(cfg)
    t, mc, r, g = cfg.train, cfg.model, cfg.rollout, cfg.grpo
    run = open_run(
        "grpo",
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
    d = cfg.data
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
    )
    # How each prompt is answered: one response, or with env / tools a multi-turn trajectory per
    # row (docs/agents.md) — chosen here, once
    responder = run_responder(
        cfg.env,
        cfg.tools,
        max_new_tokens=r.max_new_tokens,
        max_tokens=agent_max_tokens(cfg.env, r.max_new_tokens),
        has_reward_source=mc.reward_model is not None or bool(mc.reward_functions),
        columns=prompts.columns,
        source=str(d.prompts),
        log=str(Path(run.dir) / "tools.log"),  # the tools' prints, not the trainer's stdout
    )
    max_length = responder.max_tokens
    models = build_models(cfg, run.device, run.world_size, functions)
    tokenizer, actor = models.tokenizer, models.actor
    responder.ready(tokenizer, actor)  # multi-turn: the chat template checked, the context taken
    evaluation = training_eval(
        cfg.eval,
        tokenizer,
        functions=functions,
        weights=reward_weights(mc.reward_model, mc.reward_model_weight, mc.function_weights()),
        max_new_tokens=r.max_new_tokens,
        seed=t.seed,
        max_prompt_length=d.max_prompt_length,
        timeout_s=mc.reward_timeout_s,
        # env/tools: the held-out responses are trajectories, with the run's environments and limits
        responder=responder,
    )
    sampler = Sampler(
        len(prompts),
        r.batch_size,
        seed=t.seed,
        shuffle=cfg.data.shuffle,
        rank=run.rank,
        world_size=run.world_size,
    )
    G, mini = r.group_size, cfg.mini_batch_size
    one_step_per_batch = g.iterations == 1 and mini == cfg.responses_per_step
    kl_reward = g.kl == "reward"  # β·k1 in the rewards: needs log π_old before the update
    bypass = r.correction_mode == "bypass"  # π_old := μ, the engine's log-probabilities
    # π_old is computed in the experience unless the update's forward is it (one optimiser step per
    # batch) or bypass replaces it; then the rollout/* metrics read the update's first forward.
    old_in_experience = (not one_step_per_batch or kl_reward) and not bypass
    opt, sched = optimizer_and_scheduler(
        actor, cfg.optim, total_steps=t.steps * g.iterations * (cfg.responses_per_step // mini)
    )
    engine = HFEngine(
        actor,
        tokenizer.pad_token_id,
        gather_weights=r.gather_weights,
        lean_decode=r.lean_decode,
        precision=r.engine_precision(t.precision),
    )
    trained = {"actor": (actor, opt)}
    stateful = {"actor_scheduler": sched, "sampler": sampler}
    start, counters = run.restore(trained, stateful)
    counters = {"skipped_nonfinite": 0, "skipped_uniform_groups": 0, **counters}
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
    run.record_models(
        engine=engine,
        actor=actor,
        reference=models.reference.model if models.reference is not None else None,
        reward_model=models.scorer.reward_model,
    )
    run.track_best(cfg.output.keep_best, cfg.output.keep_best_mode)

    # The sampled held-out metrics (``eval``) at a step, {} when none are due.
    held_out = held_out_metrics(
        evaluation,
        t.steps,
        actor,
        reference=models.reference,
        tokenizer=tokenizer,
        scorer=models.scorer,
        engine=engine,
    )

    if start == 0 and evaluation is not None:
        run.log(0, held_out(0))  # the starting policy

    for step in range(start + 1, t.steps + 1):
        t0 = time.perf_counter()
        # 1–3. A global batch of prompts q; G responses o_1 … o_G ~ π_θ(·|q) to each (rows b·G … b·G + G − 1),
        # each row from its own seeded generator; scores r_i from the reward model and/or verifiers. A row
        # with a non-finite score is masked out of training, not dropped (rollout/collect.py).
        # With env/tools each row is a multi-turn trajectory whose response mask is the agent mask
        # (agents/collect.py), and its score its outcome plus its turn rewards: the group's baseline
        # is over whole trajectories.
        source = dict(
            prompt_set=prompts,
            sampler=sampler,
            engine=engine,
            scorer=models.scorer,
            tokenizer=tokenizer,
            seed=t.seed,
            device=run.device,
            group_size=G,
            **r.collect_kwargs(),
        )
        got = collect(step, responder=responder, **source)
        if got.turn_rewards is not None:  # GRPO/RLOO: the baseline is over whole trajectories
            got.scores = got.scores + got.turn_rewards.sum(1)
        counters["skipped_nonfinite"] += int(dist.global_sum(got.nonfinite_rows()))

        # 4. Experience: log π_old (the policy that sampled; μ > 1 iterations all ratio against it — not
        # computed when the batch gets one optimiser step: π_old is then the policy in the update's own
        # forward) and, with β > 0, log π_ref — no critic; log μ, the engine's, came with the rollout
        # (rollout.correction bypass: π_old := μ). Gathered: every rank holds the whole batch from here on.
        exp = gather(
            compute_experience(
                got.rollout,
                got.scores,
                got.valid,
                actor=actor,
                reference=models.reference,
                temperature=r.temperature,
                micro_batch_size=g.micro_batch_size,
                old_pass=old_in_experience,
                logprobs_path=t.logprobs,
            )
        )
        if bypass:
            exp = exp.replace(old_logprobs=exp.behaviour_logprobs)
        scored = exp.valid  # (B,) rows with a finite score; exp.valid becomes the rows trained on

        # 5. One advantage per response from its group's scores (no critic, no GAE); DAPO's filters leave
        # truncated responses and groups without signal out of the update. REINFORCE++ instead: one per
        # token, the returns of the score (less its group's mean, _baseline) and of the KL reward,
        # whitened over the batch. With grpo.kl reward the KL is a per-token reward k1 = log π_old − log π_ref.
        advantages, train_rows, uniform = grpo_advantages(
            exp.scores,
            exp.valid,
            exp.rollout.ended,
            G,
            scale=ADVANTAGES.get(g.advantage, "none"),  # REINFORCE++: only the filters are used
            eps=g.advantage_eps,
            skip_uniform_groups=g.skip_uniform_groups,
            mask_truncated=g.mask_truncated,
        )
        kl = kl_penalty(exp.old_logprobs, exp.ref_logprobs, "k1") if kl_reward else None
        if g.advantage in REINFORCE_PP:
            advantages = reinforce_pp_advantages(
                exp.scores,
                kl
                if kl_reward
                else torch.zeros_like(exp.rollout.response_mask, dtype=torch.float32),
                exp.rollout.response_mask,
                g.beta if kl_reward else 0.0,
                baseline=REINFORCE_PP[g.advantage],
                group_size=G,
                valid=exp.valid,
            )
        elif kl_reward:
            advantages = kl_reward_advantages(advantages, kl, exp.rollout.response_mask, g.beta)
        exp = exp.replace(advantages=advantages, valid=train_rows)
        if g.skip_uniform_groups:
            counters["skipped_uniform_groups"] += int(uniform.sum())

        # 6. μ iterations of −min(ρ·Â, clip(ρ, 1 − ε, 1 + ε_high)·Â) + β·k3 (grpo.objective clip; or
        # GSPO's, CISPO's) over mini-batches of the batch.
        t1 = time.perf_counter()
        with at_step(step):
            update = grpo_update(
                exp,
                actor=Trained(actor, opt, sched),
                aggregation=cfg.aggregation,
                objective=g.objective,
                dual_clip=g.dual_clip,
                entropy_coef=g.entropy_coef,
                iterations=g.iterations,
                mini_batch_size=mini,
                micro_batch_size=g.micro_batch_size,
                clip_eps=g.clip_eps,
                clip_eps_high=g.clip_eps_high,
                beta=0.0 if kl_reward else g.beta,
                temperature=r.temperature,
                max_length=max_length,
                max_grad_norm=cfg.optim.max_grad_norm,
                shuffle_seed=row_seed(t.seed, step, -1),
                logprobs_path=t.logprobs,
                correction=r.correction_mode,
                correction_cap=r.correction_cap,
                correction_band=r.correction_band,
                record_first_step=not old_in_experience,
            )
        engine.after_update()
        t_train = time.perf_counter() - t1
        # μ against π_old on the trained tokens (those of the update's first mini-batch when π_old was
        # its forward: all of them by default)
        old, rows = (exp.old_logprobs, exp.valid) if old_in_experience else update.pop("first_step")
        mismatch = mismatch_metrics(
            old,
            exp.behaviour_logprobs,
            exp.mask & rows[:, None],
            mode=r.correction_mode,
            cap=r.correction_cap,
            band=r.correction_band,
        )

        # 7. Log, sample rows, checkpoint. Means over the rows with a finite score go through the
        # distributed helpers, from each rank's own rows; the std and what the filters decided are
        # read from the gathered batch, which every rank holds whole. The step's model FLOPs: the
        # actor's decode; π_old (when computed), π_ref (β > 0) and r_ψ forward; the actor's training.
        step_s = time.perf_counter() - t0
        flops = online_step_flops(
            run.shapes,
            prompt_mask=got.rollout.prompt_mask,
            response_mask=got.rollout.real_mask,
            policy="actor",
            forward=("reference", "reward_model") + (("actor",) if old_in_experience else ()),
            trained={"actor": update["trained"]},
            device=run.device,
        )
        w, lengths = got.valid.float(), got.rollout.response_mask.sum(1).float()
        metrics = {
            "score/mean": dist.global_mean(got.scores, w),
            "score/std": float(exp.scores[scored].double().std()) if int(scored.sum()) > 1 else 0.0,
            **score_metrics(got.components, got.valid, list(models.scorer.functions)),
            "data/uniform_group_frac": float(uniform.float().mean()),
            "data/trained_frac": float(exp.valid.float().mean()),
            **update.pop("stats"),
            **mismatch,
            "response/length_mean": dist.global_mean(lengths, w),
            "response/eos_frac": dist.global_mean(got.rollout.ended.float(), w),
            "data/skipped_nonfinite": counters["skipped_nonfinite"],
            "data/skipped_uniform_groups": counters["skipped_uniform_groups"],
            "data/epoch": sampler.epoch,
            "data/prompts_skipped_too_long": prompts.skipped_too_long,
            "data/prompts_truncated": prompts.truncated,
            "data/prompts_skipped_empty": prompts.skipped_empty,
            "speed/gen_tokens_per_s": dist.global_sum(lengths.sum()) / max(got.generate_s, 1e-9),
            "speed/train_tokens_per_s": update["tokens"] / max(t_train, 1e-9),
            **run.utilisation(step_s, flops=flops, tokens=update["tokens"]),
            "time/step_s": step_s,
            "time/wall_s": run.wall_s(),
            **got.metrics,  # the responder's (agent/*)
        }
        metrics.update(held_out(step))
        run.log(
            step,
            metrics,
            postfix={
                "score": metrics["score/mean"],
                "uniform": metrics["data/uniform_group_frac"],
                **({"kl": metrics["kl/ref_k3"]} if "kl/ref_k3" in metrics else {}),
                **({"turns": metrics["agent/turns"]} if "agent/turns" in metrics else {}),
                **eval_postfix(metrics, cfg.output.keep_best),
            },
        )
        if run.is_main:
            write_samples(
                run.dir,
                step,
                got.prompts,
                models.scorer.completions(got.rollout),
                got.scores,
                got.components,
                got.valid,
                cfg.output.samples_per_step,
                extra=got.records,
            )
        # A stop signal (SIGTERM, SIGUSR1, SIGINT) on any rank: this step's checkpoint, then the end.
        if step == t.steps:
            # The trained policy (safetensors + tokenizer) in the run directory itself, before the
            # last checkpoint: --model.path runs/grpo starts the next stage from it.
            export_final(run.dir, actor, tokenizer)
        stop = run.stop_requested()
        if stop or due(step, t.steps, t.save_every) or run.new_best(step):
            run.save(
                step,
                trained=trained,
                stateful=stateful,
                counters=counters,
                exports={"policy": (actor, tokenizer)},
                keep=t.keep_checkpoints,
            )
        if stop:
            run.stop(step)

    if start == t.steps:  # --resume of a finished run: its policy written again
        export_final(run.dir, actor, tokenizer)
    responder.close()
    run.finish()
    return run.dir


# ----------------------------------------------------------------------------------------------
# Step 6: the update
# ----------------------------------------------------------------------------------------------

#: Statistics averaged over the valid tokens of each mini-batch (weighted by their count).
_TOKEN_STATS = (
    ("policy/clipfrac_low", "clipfrac_low"),
    ("policy/clipfrac_high", "clipfrac_high"),
    ("policy/ratio_mean", "ratio_mean"),
    ("policy/approx_kl", "approx_kl"),
    ("kl/ref_k3", "kl_ref"),
    ("advantage/token_mean", "advantage_mean"),
)
#: Losses (already normalised shares of the mini-batch's loss: their sum over micro-batches and ranks is it).
_LOSS_STATS = (("loss/total", "loss"), ("loss/policy", "pg_loss"), ("loss/kl", "kl_loss"))
#: Extremes over the valid tokens of each mini-batch (a micro-batch without one reports ∓inf).
_MAX_STATS = (("policy/ratio_max", "ratio_max"), ("advantage/max", "advantage_max"))
_MIN_STATS = (("policy/ratio_min", "ratio_min"), ("advantage/min", "advantage_min"))
#: Every statistic of an update that took at least one optimiser step.
_UPDATE_KEYS = [name for name, _ in _TOKEN_STATS + _LOSS_STATS] + [
    "policy/entropy",
    "policy/ratio_max",
    "policy/ratio_min",
    "advantage/max",
    "advantage/min",
    "policy/clipfrac",
    "lr/actor",
    "grad_norm/actor",
]


def grpo_update(
    exp: Experience,
    *,
    actor: Trained,
    aggregation: str,
    objective: str = "clip",
    dual_clip: float | None = None,
    entropy_coef: float = 0.0,
    iterations: int,
    mini_batch_size: int,
    micro_batch_size: int,
    clip_eps: float | None,
    clip_eps_high: float | None,
    beta: float,
    temperature: float,
    max_length: int,
    max_grad_norm: float,
    shuffle_seed: int,
    logprobs_path: str = "fused",
    correction: str = "none",
    correction_cap: float = 2.0,
    correction_band: list[float] | None = None,
    record_first_step: bool = False,
) -> dict:
    """``iterations`` (μ) passes over shuffled mini-batches of the **whole** generation batch ``exp``
    (every rank holds it), each pass against the same π_old (``exp.old_logprobs``, recorded when the batch
    was sampled; None when the batch gets one optimiser step: then the forward's own log-probabilities,
    detached); rank r trains on the r-th part of each mini-batch, in micro-batches whose gradients
    accumulate (:func:`proximal.train.batches.accumulate`).

    The loss is normalised by the aggregation's unit count over the whole mini-batch
    (:func:`proximal.core.aggregation_units`: valid tokens for DAPO's token-mean, responses for the
    two sequence means) divided by the number of ranks, because FSDP averages gradients over ranks:
    the accumulated gradient is exactly that of the mini-batch's loss whatever the micro-batch size
    and the number of processes (the bug TRL fixed in huggingface/trl#3938). With
    ``mini_batch_size`` = the batch (the default) that is the whole generation batch.
    ``logprobs_path``: ``train.logprobs`` (:func:`proximal.models.output.token_logprobs`).

    ``objective`` (``grpo.objective``): ``clip`` is :func:`proximal.core.grpo_policy_loss` (with
    ``dual_clip``); ``gspo`` / ``gspo_token`` :func:`proximal.core.gspo_policy_loss` and ``cispo``
    :func:`proximal.core.cispo_policy_loss`, each plus :func:`proximal.core.reference_kl_loss` when
    there is a reference and β > 0. ``entropy_coef`` > 0 subtracts c·S[π_θ] (aggregated like the
    loss) and trains through the entropy. GSPO's statistics are means over responses and are
    averaged over them; the others' (and every objective's KL to the reference) over tokens.

    ``correction`` (``rollout.correction``, with ``correction_cap`` and ``correction_band``): the
    detached weights of :func:`proximal.core.correction_weights` from π_old (the ``old`` each micro
    step ratios against) and μ (``exp.behaviour_logprobs``) on each token's policy-gradient term — for
    GSPO one per response, :func:`proximal.core.sequence_correction_weights`; ``bypass`` has
    ``exp.old_logprobs`` = μ already and no weights.

    Returns ``{"stats": {...}, "tokens": int, "trained": Tokens}``: statistics averaged over the
    optimiser steps, and the tokens this update passed through the actor (all ranks): their count,
    and with their lengths and scored positions for the FLOP count. With ``record_first_step``
    also ``"first_step"``: the forward's log-probabilities of each row it saw before the first
    optimiser step, (B, T), and those rows, (B,) bool — log π_old there
    (:class:`proximal.train.correction.FirstStepLogprobs`), every rank's.
    """
    W, rank = dist.world_size(), dist.rank()
    B = len(exp)
    corrected = correction not in ("none", "bypass")
    if corrected and exp.behaviour_logprobs is None:
        raise ValueError(f"rollout.correction {correction} needs the engine's log-probabilities")
    band = None if correction_band is None else tuple(correction_band)
    token_stats = _TOKEN_STATS + (
        (("policy/clipfrac_dual", "clipfrac_dual"),) if dual_clip is not None else ()
    )
    per_response = objective in ("gspo", "gspo_token")  # stats are means over responses
    per_rank = mini_batch_size // W
    gen = torch.Generator().manual_seed(shuffle_seed)
    device = exp.rollout.response_ids.device
    history: dict[str, list[float]] = {}
    tokens, trained = 0, Tokens()
    first = (
        FirstStepLogprobs(B, exp.rollout.response_ids.shape[1], device)
        if record_first_step
        else None
    )
    for _iteration in range(iterations):
        order = torch.randperm(B, generator=gen).to(device)
        for start in range(0, B, mini_batch_size):
            mini = order[start : start + mini_batch_size]
            units = float(aggregation_units(exp.mask[mini], aggregation))
            # every row of this mini-batch left out (filters, non-finite): the same on every rank
            if units == 0:
                continue
            norm = units / W

            def micro_step(idx: torch.Tensor) -> dict:
                m = exp.select(idx)
                mask = m.mask
                scores = response_logprobs(
                    actor.module,
                    m.rollout,
                    temperature,
                    mask=mask,
                    entropy="trained" if entropy_coef > 0 else "logged",
                    path=logprobs_path,
                )
                logprobs, token_ent = scores.logprobs, scores.entropy
                old = (
                    m.old_logprobs if m.old_logprobs is not None else logprobs.detach()
                )  # one step: π_old = π_θ
                if first is not None and not history:  # no optimiser step yet: π_θ = π_old
                    first.put(idx, logprobs)
                w = None  # the rollout correction's weights from π_old/μ (bypass: old is μ, none)
                if corrected and per_response:
                    w = sequence_correction_weights(
                        correction, old, m.behaviour_logprobs, mask, cap=correction_cap, band=band
                    )
                elif corrected:
                    w, _ = correction_weights(
                        correction, old, m.behaviour_logprobs, mask, cap=correction_cap, band=band
                    )
                if objective == "clip":
                    loss, st = grpo_policy_loss(
                        logprobs,
                        old,
                        m.ref_logprobs,
                        m.advantages,
                        mask,
                        clip_eps=clip_eps,
                        clip_eps_high=clip_eps_high,
                        beta=beta,
                        aggregation=aggregation,
                        max_response_length=max_length,
                        normalizer=norm,
                        dual_clip=dual_clip,
                        is_weights=w,
                    )
                else:
                    if objective == "cispo":
                        high = clip_eps if clip_eps_high is None else clip_eps_high
                        pg, st = cispo_policy_loss(
                            logprobs,
                            old,
                            m.advantages,
                            mask,
                            high,
                            clip_eps,
                            normalizer=norm,
                            is_weights=w,
                        )
                    else:
                        pg, st = gspo_policy_loss(
                            logprobs,
                            old,
                            m.advantages,
                            mask,
                            clip_eps,
                            clip_eps_high,
                            token_level=objective == "gspo_token",
                            normalizer=norm,
                            is_weights=w,
                        )
                    kl_loss, kl_ref = torch.zeros_like(pg), torch.zeros_like(pg)
                    if m.ref_logprobs is not None:
                        kl_loss, kl_ref = reference_kl_loss(
                            logprobs,
                            m.ref_logprobs,
                            mask,
                            beta,
                            aggregation,
                            max_length=max_length,
                            normalizer=norm,
                        )
                    loss = pg + kl_loss
                    st = {**st, "kl_loss": kl_loss.detach(), "kl_ref": kl_ref}
                if entropy_coef > 0:  # the bonus: −c·S, aggregated like the loss
                    loss = loss - entropy_coef * masked_aggregate(
                        token_ent, mask, aggregation, max_length=max_length, normalizer=norm
                    )
                loss.backward()
                entropy = masked_sum(token_ent.detach(), mask)
                n_tok = mask.sum().double()
                n_unit = mask.any(1).sum().double() if per_response else n_tok
                return {
                    "n_tokens": n_tok,
                    "n_units": n_unit,
                    "entropy_sum": entropy,
                    "seen_tokens": m.rollout.attention_mask.sum(),
                    "seen_squares": m.rollout.attention_mask.sum(1).square().sum(),
                    "scored_tokens": mask.sum(),
                    **{
                        name: st[k] * (n_tok if k == "kl_ref" else n_unit)
                        for name, k in token_stats
                    },
                    **{name: (loss if k == "loss" else st[k]) for name, k in _LOSS_STATS},
                    **{name: st[k] for name, k in _MAX_STATS + _MIN_STATS},
                }

            sums = accumulate(
                mini[rank * per_rank : (rank + 1) * per_rank],
                micro_batch_size,
                micro_step,
                device,
                maxima=[name for name, _ in _MAX_STATS],
                minima=[name for name, _ in _MIN_STATS],
            )
            n = sums["n_tokens"]
            row = {
                name: sums[name] / (n if k == "kl_ref" else sums["n_units"])
                for name, k in token_stats
            }
            row.update({name: sums[name] / W for name, _ in _LOSS_STATS})
            row["policy/entropy"] = sums["entropy_sum"] / n
            row.update({name: sums[name] for name, _ in _MAX_STATS + _MIN_STATS})
            row["policy/clipfrac"] = row["policy/clipfrac_low"] + row["policy/clipfrac_high"]
            tokens += int(sums["seen_tokens"])
            trained += Tokens(
                int(sums["seen_tokens"]), int(sums["seen_squares"]), int(sums["scored_tokens"])
            )
            row["lr/actor"] = actor.scheduler.get_last_lr()[0]  # the rate this step runs at
            row["grad_norm/actor"] = clip_and_step(
                actor.module, actor.optimizer, actor.scheduler, max_grad_norm, what="actor"
            )
            for k, v in row.items():
                history.setdefault(k, []).append(v)
    pick = {name: max for name, _ in _MAX_STATS} | {name: min for name, _ in _MIN_STATS}
    # A step whose every row was left out takes no optimiser step: its update statistics are NaN (null
    # in metrics.jsonl), so every line has the same keys.
    stats = {k: math.nan for k in _UPDATE_KEYS + [name for name, _ in token_stats]}
    stats.update({k: pick[k](v) if k in pick else sum(v) / len(v) for k, v in history.items()})
    if exp.ref_logprobs is None:
        del stats["kl/ref_k3"]  # no reference was loaded: there is nothing to report
    stats["policy/optimizer_steps"] = len(history.get("grad_norm/actor", []))
    out = {"stats": stats, "tokens": tokens, "trained": trained}
    if first is not None:
        out["first_step"] = first.gathered()
    return out


# ----------------------------------------------------------------------------------------------
# Set-up: the models
# ----------------------------------------------------------------------------------------------


@dataclass
class GRPOModels:
    tokenizer: object
    actor: torch.nn.Module
    reference: object | None  # proximal.models.policy.Reference; None when grpo.beta = 0
    scorer: object  # proximal.rollout.scoring.Scorer


def build_models(
    cfg: GRPOConfig, device: torch.device, world_size: int, functions: dict
) -> GRPOModels:
    """The actor, the reference (only when β > 0: frozen copy, or with LoRA the actor with its adapters
    off) and the scorer, loaded in train.precision's dtypes, placed and sharded across processes."""
    mc, t = cfg.model, cfg.train
    tokenizer, actor, reference = build_policy(
        mc.path,
        lora=mc.lora(),
        precision=t.precision,
        device=device,
        world_size=world_size,
        activation_checkpointing=t.activation_checkpointing,
        reference=cfg.grpo.beta > 0,
        frozen_sharding=mc.frozen_sharding,
        merge_lora=cfg.output.merge_lora,
    )
    set_chat_template(tokenizer, mc.chat_template)  # the prompts' template, saved with the policy
    scorer = build_scorer(
        tokenizer,
        reward_model=mc.reward_model,
        reward_model_weight=mc.reward_model_weight,
        functions=functions,
        function_weights=mc.function_weights(),
        precision=t.precision,
        device=device,
        world_size=world_size,
        frozen_sharding=mc.frozen_sharding,
        micro_batch_size=cfg.grpo.micro_batch_size,
        timeout_s=mc.reward_timeout_s,
    )
    return GRPOModels(tokenizer, actor, reference, scorer)


def cli(argv: list[str]) -> int:
    return config_command(
        argv, prog="grpo", description=__doc__.splitlines()[0], config_cls=GRPOConfig, train=train
    )
