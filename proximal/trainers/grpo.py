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
from proximal.models.flops import Tokens
from proximal.models.policy import build_policy
from proximal.rollout.engine import row_seed
from proximal.rollout.experience import Experience, compute_experience, gather
from proximal.rollout.sampling import response_logprobs
from proximal.rollout.scoring import build_scorer, score_metrics
from proximal.train.batches import accumulate
from proximal.train.checkpoint import export_final
from proximal.train.command import config_command
from proximal.train.correction import FirstStepLogprobs, mismatch_metrics
from proximal.train.optim import Trained, at_step, clip_and_step, optimizer_and_scheduler
from proximal.train.perf import online_step_flops
from proximal.trainers.grpo_config import ADVANTAGES, REINFORCE_PP, GRPOConfig
from proximal.trainers.online import (
    begin,
    collect_step,
    common_metrics,
    end_step,
    finish,
    log_step,
    set_up,
    updated,
)

__all__ = ["GRPOConfig", "train", "grpo_update", "cli"]


def train(cfg: GRPOConfig, resume_dir: str | Path | None = None) -> Path:
    """Run GRPO (or RLOO, Dr. GRPO, DAPO) as configured; return the run directory. ``resume_dir``
    continues a saved run exactly."""
    check_valid(cfg)
    t, r, g = cfg.train, cfg.rollout, cfg.grpo
    # Inputs, responder, models, held-out evaluation, sampler, engine: as every online method
    # (trainers/online.py)
    o = set_up("grpo", cfg, resume_dir, build_models)
    run, models = o.run, o.models
    tokenizer, actor = models.tokenizer, models.actor
    settings = GRPOUpdate.of(cfg, o.responder.max_tokens)  # what the update reads of the config
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
    trained = {"actor": (actor, opt)}
    stateful = {"actor_scheduler": sched, "sampler": o.sampler}
    resident = dict(
        actor=actor,
        reference=models.reference.model if models.reference is not None else None,
        reward_model=models.scorer.reward_model,
    )
    counters = {"skipped_nonfinite": 0, "skipped_uniform_groups": 0}
    start, counters = begin(o, cfg, trained, stateful, counters, resident)

    for step in range(start + 1, t.steps + 1):
        t0 = time.perf_counter()
        # 1–3. A global batch of prompts q; G responses o_1 … o_G ~ π_θ(·|q) to each (rows b·G … b·G + G − 1),
        # each row from its own seeded generator; scores r_i from the reward model and/or verifiers. A row
        # with a non-finite score is masked out of training, not dropped (rollout/collect.py).
        # With env/tools each row is a multi-turn trajectory whose response mask is the agent mask
        # (agents/collect.py), and its score its outcome plus its turn rewards: the group's baseline
        # is over whole trajectories.
        got = collect_step(o, cfg, step, group_size=G)
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
                filter=r.replayed_filter,
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
        # (on the full softmax: rollout.replay_filter truncates π_old's ratio, never the KL)
        kl = kl_penalty(exp.old_unfiltered, exp.ref_logprobs, "k1") if kl_reward else None
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
                settings,
                actor=Trained(actor, opt, sched),
                shuffle_seed=row_seed(t.seed, step, -1),
                record_first_step=not old_in_experience,
            )
        updated(o, cfg, step)  # the engine (and a generator) take the new weights
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
            every_mode=r.staleness >= 1,
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
        w = got.valid.float()
        counted = {
            f"data/{k}": counters[k] for k in ("skipped_nonfinite", "skipped_uniform_groups")
        }
        metrics = {
            "score/mean": dist.global_mean(got.scores, w),
            "score/std": float(exp.scores[scored].double().std()) if int(scored.sum()) > 1 else 0.0,
            **score_metrics(got.components, got.valid, list(models.scorer.functions)),
            "data/uniform_group_frac": float(uniform.float().mean()),
            "data/trained_frac": float(exp.valid.float().mean()),
            **update.pop("stats"),
            **mismatch,
            **common_metrics(
                o,
                got,
                counted,
                step_s=step_s,
                t_train=t_train,
                tokens=update["tokens"],
                flops=flops,
            ),
        }
        postfix = {
            "score": metrics["score/mean"],
            "uniform": metrics["data/uniform_group_frac"],
            **({"kl": metrics["kl/ref_k3"]} if "kl/ref_k3" in metrics else {}),
        }
        log_step(o, cfg, step, got, metrics, postfix)
        end_step(
            o,
            cfg,
            step,
            trained=trained,
            stateful=stateful,
            counters=counters,
            # the trained policy (safetensors + tokenizer) in the run directory itself, before the
            # last checkpoint: --model.path runs/grpo starts the next stage from it
            exports={"policy": (actor, tokenizer)},
            export=lambda: export_final(run.dir, actor, tokenizer),
        )
    return finish(o, cfg, start, lambda: export_final(run.dir, actor, tokenizer))


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


@dataclass(frozen=True)
class GRPOUpdate:
    """GRPO's (and RLOO's) update settings, built once where the run is built (:meth:`of`): the
    ``grpo.*`` fields the update reads (``beta``: 0 when the KL is in the rewards), the top-level
    ``aggregation`` and mini-batch size, the sampling ``temperature`` (``rollout.temperature``),
    ``max_length`` (the longest response: ``rollout.max_new_tokens``, or an agent run's budget),
    ``max_grad_norm`` (``optim.*``), ``logprobs_path`` (``train.logprobs``), the rollout
    correction (``rollout.correction``, ``correction_cap``, ``correction_band``) and the filter
    π_θ is computed under (``rollout.replay_filter``: (top_k, top_p), or None)."""

    aggregation: str
    iterations: int
    mini_batch_size: int
    micro_batch_size: int
    clip_eps: float | None
    clip_eps_high: float | None
    beta: float
    temperature: float
    max_length: int
    max_grad_norm: float
    objective: str = "clip"
    dual_clip: float | None = None
    entropy_coef: float = 0.0
    logprobs_path: str = "fused"
    correction: str = "none"
    correction_cap: float = 2.0
    correction_band: list[float] | None = None
    filter: tuple[int, float] | None = None

    @classmethod
    def of(cls, cfg: GRPOConfig, max_length: int) -> GRPOUpdate:
        g, r = cfg.grpo, cfg.rollout
        return cls(
            aggregation=cfg.aggregation,
            iterations=g.iterations,
            mini_batch_size=cfg.mini_batch_size,
            micro_batch_size=g.micro_batch_size,
            clip_eps=g.clip_eps,
            clip_eps_high=g.clip_eps_high,
            beta=0.0 if g.kl == "reward" else g.beta,  # β·k1 in the rewards: not in the loss
            temperature=r.temperature,
            max_length=max_length,
            max_grad_norm=cfg.optim.max_grad_norm,
            objective=g.objective,
            dual_clip=g.dual_clip,
            entropy_coef=g.entropy_coef,
            logprobs_path=cfg.train.logprobs,
            correction=r.correction_mode,
            correction_cap=r.correction_cap,
            correction_band=r.correction_band,
            filter=r.replayed_filter,
        )

    @property
    def corrected(self) -> bool:
        """The rollout correction weighs the loss (not none, not bypass)."""
        return self.correction not in ("none", "bypass")

    @property
    def per_response(self) -> bool:
        """GSPO's statistics are means over responses."""
        return self.objective in ("gspo", "gspo_token")


def grpo_update(
    exp: Experience,
    s: GRPOUpdate,
    *,
    actor: Trained,
    shuffle_seed: int,
    record_first_step: bool = False,
) -> dict:
    """The settings ``s`` (:class:`GRPOUpdate`). ``iterations`` (μ) passes over shuffled
    mini-batches of the **whole** generation batch ``exp`` (every rank holds it), each pass against
    the same π_old (``exp.old_logprobs``, recorded when the batch was sampled; None when the batch
    gets one optimiser step: then the forward's own log-probabilities, detached); rank r trains on
    the r-th part of each mini-batch, in micro-batches whose gradients accumulate
    (:func:`proximal.train.batches.accumulate`; each one :func:`micro_step`).

    The loss is normalised by the aggregation's unit count over the whole mini-batch
    (:func:`proximal.core.aggregation_units`: valid tokens for DAPO's token-mean, responses for the
    two sequence means) divided by the number of ranks, because FSDP averages gradients over ranks:
    the accumulated gradient is exactly that of the mini-batch's loss whatever the micro-batch size
    and the number of processes (the bug TRL fixed in huggingface/trl#3938). With
    ``mini_batch_size`` = the batch (the default) that is the whole generation batch.
    ``logprobs_path``: ``train.logprobs`` (:func:`proximal.models.output.token_logprobs`).

    The objective (:func:`policy_loss`) and the rollout correction (:func:`correction_weights_of`)
    are those of ``s``.

    Returns ``{"stats": {...}, "tokens": int, "trained": Tokens}``: statistics averaged over the
    optimiser steps, and the tokens this update passed through the actor (all ranks): their count,
    and with their lengths and scored positions for the FLOP count. With ``record_first_step``
    also ``"first_step"``: the forward's log-probabilities of each row it saw before the first
    optimiser step, (B, T), and those rows, (B,) bool — log π_old there
    (:class:`proximal.train.correction.FirstStepLogprobs`), every rank's.
    """
    W, rank = dist.world_size(), dist.rank()
    B = len(exp)
    if s.corrected and exp.behaviour_logprobs is None:
        raise ValueError(f"rollout.correction {s.correction} needs the engine's log-probabilities")
    token_stats = _TOKEN_STATS + (
        (("policy/clipfrac_dual", "clipfrac_dual"),) if s.dual_clip is not None else ()
    )
    per_rank = s.mini_batch_size // W
    gen = torch.Generator().manual_seed(shuffle_seed)
    device = exp.rollout.response_ids.device
    history: dict[str, list[float]] = {}
    tokens, trained = 0, Tokens()
    first = (
        FirstStepLogprobs(B, exp.rollout.response_ids.shape[1], device)
        if record_first_step
        else None
    )
    for _iteration in range(s.iterations):
        order = torch.randperm(B, generator=gen).to(device)
        for start in range(0, B, s.mini_batch_size):
            mini = order[start : start + s.mini_batch_size]
            units = float(aggregation_units(exp.mask[mini], s.aggregation))
            # every row of this mini-batch left out (filters, non-finite): the same on every rank
            if units == 0:
                continue
            record = first if not history else None  # no optimiser step yet: π_θ = π_old
            sums = accumulate(
                mini[rank * per_rank : (rank + 1) * per_rank],
                s.micro_batch_size,
                lambda idx: micro_step(exp, idx, s, actor.module, units / W, token_stats, record),
                device,
                maxima=[name for name, _ in _MAX_STATS],
                minima=[name for name, _ in _MIN_STATS],
            )
            row = _step_row(sums, token_stats, W)
            tokens += int(sums["seen_tokens"])
            trained += Tokens(
                int(sums["seen_tokens"]), int(sums["seen_squares"]), int(sums["scored_tokens"])
            )
            row["lr/actor"] = actor.scheduler.get_last_lr()[0]  # the rate this step runs at
            row["grad_norm/actor"] = clip_and_step(
                actor.module, actor.optimizer, actor.scheduler, s.max_grad_norm, what="actor"
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


def micro_step(
    exp: Experience,
    idx: torch.Tensor,
    s: GRPOUpdate,
    model,
    norm: float,
    token_stats: tuple,
    record: FirstStepLogprobs | None = None,
) -> dict:
    """One micro-batch (rows ``idx`` of ``exp``): log π_θ and the entropy in one forward, the
    loss (normalised by ``norm``, the mini-batch's units per rank) backward, and its sums for the
    step's statistics (:func:`_step_row`). ``record``: where the forward's log-probabilities go
    before the first optimiser step (they are log π_old there)."""
    m = exp.select(idx)
    mask = m.mask
    scores = response_logprobs(
        model,
        m.rollout,
        s.temperature,
        mask=mask,
        entropy="trained" if s.entropy_coef > 0 else "logged",
        path=s.logprobs_path,
        filter=s.filter,
    )
    logprobs, token_ent = scores.logprobs, scores.entropy
    # one step: π_old = π_θ
    old = m.old_logprobs if m.old_logprobs is not None else logprobs.detach()
    if record is not None:
        record.put(idx, logprobs)
    w = correction_weights_of(s, old, m.behaviour_logprobs, mask)
    loss, st = policy_loss(s, logprobs, old, m, mask, norm, w, kl_logprobs=scores.unfiltered)
    if s.entropy_coef > 0:  # the bonus: −c·S, aggregated like the loss
        loss = loss - s.entropy_coef * masked_aggregate(
            token_ent, mask, s.aggregation, max_length=s.max_length, normalizer=norm
        )
    loss.backward()
    entropy = masked_sum(token_ent.detach(), mask)
    n_tok = mask.sum().double()
    n_unit = mask.any(1).sum().double() if s.per_response else n_tok
    return {
        "n_tokens": n_tok,
        "n_units": n_unit,
        "entropy_sum": entropy,
        "seen_tokens": m.rollout.attention_mask.sum(),
        "seen_squares": m.rollout.attention_mask.sum(1).square().sum(),
        "scored_tokens": mask.sum(),
        **{name: st[k] * (n_tok if k == "kl_ref" else n_unit) for name, k in token_stats},
        **{name: (loss if k == "loss" else st[k]) for name, k in _LOSS_STATS},
        **{name: st[k] for name, k in _MAX_STATS + _MIN_STATS},
    }


def correction_weights_of(
    s: GRPOUpdate, old: torch.Tensor, behaviour: torch.Tensor | None, mask: torch.Tensor
) -> torch.Tensor | None:
    """The rollout correction's detached weights from π_old (``old``, the one each micro step
    ratios against) and μ (``behaviour``) on each token's policy-gradient term
    (:func:`proximal.core.correction_weights`) — for GSPO one per response,
    :func:`proximal.core.sequence_correction_weights`; None for none and bypass (bypass has
    ``exp.old_logprobs`` = μ already)."""
    if not s.corrected:
        return None
    band = None if s.correction_band is None else tuple(s.correction_band)
    if s.per_response:
        return sequence_correction_weights(
            s.correction, old, behaviour, mask, cap=s.correction_cap, band=band
        )
    w, _ = correction_weights(s.correction, old, behaviour, mask, cap=s.correction_cap, band=band)
    return w


def policy_loss(
    s: GRPOUpdate,
    logprobs: torch.Tensor,
    old: torch.Tensor,
    m: Experience,
    mask: torch.Tensor,
    norm: float,
    w: torch.Tensor | None,
    *,
    kl_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """``(loss, stats)`` of ``s.objective`` (``grpo.objective``): ``clip`` is
    :func:`proximal.core.grpo_policy_loss` (with ``dual_clip``); ``gspo`` / ``gspo_token``
    :func:`proximal.core.gspo_policy_loss` and ``cispo`` :func:`proximal.core.cispo_policy_loss`,
    each plus :func:`proximal.core.reference_kl_loss` when there is a reference and β > 0.
    ``kl_logprobs``: log π_θ on the full softmax for the KL term where ``logprobs`` replay the
    engine's filter (None: ``logprobs``)."""
    kl_logprobs = logprobs if kl_logprobs is None else kl_logprobs
    if s.objective == "clip":
        return grpo_policy_loss(
            logprobs,
            old,
            m.ref_logprobs,
            m.advantages,
            mask,
            clip_eps_low=s.clip_eps,
            clip_eps_high=s.clip_eps_high,
            beta=s.beta,
            aggregation=s.aggregation,
            max_length=s.max_length,
            normalizer=norm,
            dual_clip=s.dual_clip,
            is_weights=w,
            kl_logprobs=kl_logprobs,
        )
    if s.objective == "cispo":
        pg, st = cispo_policy_loss(
            logprobs,
            old,
            m.advantages,
            mask,
            clip_eps_low=s.clip_eps,
            clip_eps_high=s.clip_eps_high,
            normalizer=norm,
            is_weights=w,
        )
    else:
        pg, st = gspo_policy_loss(
            logprobs,
            old,
            m.advantages,
            mask,
            clip_eps_low=s.clip_eps,
            clip_eps_high=s.clip_eps_high,
            token_level=s.objective == "gspo_token",
            normalizer=norm,
            is_weights=w,
        )
    kl_loss, kl_ref = torch.zeros_like(pg), torch.zeros_like(pg)
    if m.ref_logprobs is not None:
        kl_loss, kl_ref = reference_kl_loss(
            kl_logprobs,
            m.ref_logprobs,
            mask,
            s.beta,
            s.aggregation,
            max_length=s.max_length,
            normalizer=norm,
        )
    return pg + kl_loss, {**st, "kl_loss": kl_loss.detach(), "kl_ref": kl_ref}


def _step_row(sums: dict, token_stats: tuple, W: int) -> dict:
    """One optimiser step's statistics from its micro-batches' sums (:func:`micro_step`): token
    (or, for GSPO, response) means, the losses (summed over ranks, each 1/W of the mini-batch's),
    the entropy per token, the maxima and minima."""
    n = sums["n_tokens"]
    row = {name: sums[name] / (n if k == "kl_ref" else sums["n_units"]) for name, k in token_stats}
    row.update({name: sums[name] / W for name, _ in _LOSS_STATS})
    row["policy/entropy"] = sums["entropy_sum"] / n
    row.update({name: sums[name] for name, _ in _MAX_STATS + _MIN_STATS})
    row["policy/clipfrac"] = row["policy/clipfrac_low"] + row["policy/clipfrac_high"]
    return row


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
