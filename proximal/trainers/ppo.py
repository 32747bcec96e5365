"""PPO-based RLHF with four models: actor π_θ, frozen reference π_ref, frozen reward model r_ψ, critic V_φ.

One step reads top to bottom in :func:`train`, along the data flow rollout → experience → update:
(1) a global batch of prompts, (2) responses sampled from π_θ, (3) scored by r_ψ and the reward
functions, (4) the experience — log π_old, log π_ref and V_old, (5) per-token rewards shaped with
β·KL, GAE and whitened advantages, (6) ``ppo.epochs`` passes of clipped-surrogate and clipped-value
updates over shuffled mini-batches (:func:`ppo_update`), (7) the KL controller's β, (8) logs and
checkpoints. The math is in :mod:`proximal.core` (each equation in docs/formulas.md); set-up,
checkpoints and logging are the shared layer's (:mod:`proximal.train`), models' set-up below the loop.

With several processes (``torchrun``) every rank samples, scores and computes the experience of its
share of the batch; the update then cuts mini-batches from the gathered batch in one global order
and each rank trains on its part, with every normaliser and decision global — so 1 and N processes
compute the same step (docs/distributed.md).

Tensor notation: B rollout batch, P padded prompt length, T padded response length, V vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from proximal import dist
from proximal.config import check_valid
from proximal.core import (
    aggregation_units,
    correction_weights,
    explained_variance,
    gae,
    make_kl_controller,
    masked_aggregate,
    nll_from_logprobs,
    ppo_policy_loss,
    shape_rewards,
    value_loss,
    whiten,
)
from proximal.data.chat import set_chat_template
from proximal.data.collate import pad_right
from proximal.data.prompts import load_texts
from proximal.data.sampler import Sampler
from proximal.models.flops import Tokens
from proximal.models.loading import ModelLoadError, load_tokenizer
from proximal.models.output import TokenScores, token_logprobs
from proximal.models.parallel import load_dtype, prepare_trained
from proximal.models.policy import build_critic, build_policy
from proximal.rollout.engine import row_seed
from proximal.rollout.experience import Experience, compute_experience, critic_values, gather
from proximal.rollout.sampling import response_logprobs
from proximal.rollout.scoring import build_scorer, same_tokenizer, score_metrics
from proximal.train.batches import accumulate
from proximal.train.checkpoint import export_final
from proximal.train.command import config_command
from proximal.train.correction import FirstStepLogprobs, mismatch_metrics
from proximal.train.optim import Trained, at_step, clip_and_step, optimizer_and_scheduler
from proximal.train.perf import global_tokens, online_step_flops
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
from proximal.trainers.ppo_config import PPOConfig

__all__ = ["PPOConfig", "train", "ppo_update", "cli"]


def train(cfg: PPOConfig, resume_dir: str | Path | None = None) -> Path:
    """Run PPO as configured; return the run directory. ``resume_dir`` continues a saved run exactly."""
    check_valid(cfg)
    t, r, p = cfg.train, cfg.rollout, cfg.ppo
    # Inputs, responder, models, held-out evaluation, sampler, engine: as every online method
    # (trainers/online.py)
    o = set_up("ppo", cfg, resume_dir, build_models)
    run, models = o.run, o.models
    tokenizer, actor, critic = models.tokenizer, models.actor, models.critic
    max_length = o.responder.max_tokens
    settings = PPOUpdate.of(cfg, max_length)  # what the update reads of the config
    ptx = load_ptx(cfg, tokenizer, run) if p.ptx_coef > 0 else None
    opt_steps = t.steps * p.epochs * (r.batch_size // p.mini_batch_size)
    actor_opt, actor_sched = optimizer_and_scheduler(actor, cfg.optim, total_steps=opt_steps)
    critic_opt, critic_sched = optimizer_and_scheduler(
        critic, cfg.optim, lr=cfg.optim.critic_lr, total_steps=opt_steps
    )
    kl_ctl = make_kl_controller(
        cfg.kl.controller,
        beta=cfg.kl.beta,
        target=cfg.kl.target,
        k_beta=cfg.kl.k_beta,
        horizon=cfg.kl.horizon,
    )
    bypass = r.correction_mode == "bypass"  # π_old := μ, the engine's log-probabilities
    trained = {"actor": (actor, actor_opt), "critic": (critic, critic_opt)}
    stateful = {
        "actor_scheduler": actor_sched,
        "critic_scheduler": critic_sched,
        "kl_controller": kl_ctl,
        "sampler": o.sampler,
        "ptx_sampler": ptx.sampler if ptx else None,
    }
    resident = dict(
        actor=actor,
        reference=models.reference.model,
        critic=critic,
        reward_model=models.scorer.reward_model,
    )
    start, counters = begin(o, cfg, trained, stateful, {"skipped_nonfinite": 0}, resident)

    for step in range(start + 1, t.steps + 1):
        t0 = time.perf_counter()
        # 1–3. A global batch of prompts x (the initial states s_1 = x); responses y ~ π_θ(·|x) until EOS, a
        # stop or T tokens, each row from its own seeded generator; scores r_ψ(x, y) (+ reward functions).
        # A row with a non-finite score is masked out of training, not dropped (rollout/collect.py).
        # With env/tools each row is a multi-turn trajectory whose response mask is the agent mask
        # (the observations attended to, never trained on: agents/collect.py).
        got = collect_step(o, cfg, step)
        rollout, scores, valid = got.rollout, got.scores, got.valid
        counters["skipped_nonfinite"] += int(dist.global_sum(got.nonfinite_rows()))

        # 4. Experience: log π_old, log π_ref and V_old on the sampled tokens (no gradients); log μ, the
        # engine's, came with the rollout (rollout.correction bypass: π_old := μ, not computed). When the
        # first epoch's actor forward sees exactly this batch (one process, one mini-batch, one micro-batch),
        # that pass runs now, with gradients, and its detached log-probabilities are log π_old.
        first = (
            first_pass(
                rollout,
                actor,
                r.temperature,
                entropy_coef=p.entropy_coef,
                path=t.logprobs,
                filter=r.replayed_filter,
            )
            if reuses_first_pass(
                p.reuse_first_pass,
                batch_size=r.batch_size,
                mini_batch_size=p.mini_batch_size,
                micro_batch_size=p.micro_batch_size,
            )
            else None
        )
        exp = compute_experience(
            rollout,
            scores,
            valid,
            actor=actor,
            reference=models.reference,
            critic=critic,
            temperature=r.temperature,
            micro_batch_size=p.micro_batch_size,
            old_pass=first is None and not bypass,
            logprobs_path=t.logprobs,
            filter=r.replayed_filter,
        )
        if first is not None:
            exp = exp.replace(
                old_logprobs=first.old_logprobs, old_full_logprobs=first.old_full_logprobs
            )
        pi_old = exp.old_logprobs  # this rank's rows; None with bypass and no first pass
        if bypass:
            exp = exp.replace(old_logprobs=exp.behaviour_logprobs)

        # 5. Per-token rewards R_t = −β·KL_t (+ r_ψ at the last token), GAE(γ, λ), whitened advantages.
        mask = exp.mask
        # (the KL on the full softmax: rollout.replay_filter truncates π_old's ratio, never the KL)
        rewards, kl = shape_rewards(
            exp.scores,
            exp.old_unfiltered,
            exp.ref_logprobs,
            rollout.response_mask,
            kl_ctl.beta,
            p.kl_estimator,
        )
        if got.turn_rewards is not None:  # multi-turn: on the last agent token of their turn
            rewards = rewards + got.turn_rewards
        advantages, returns = gae(rewards, exp.values, mask, p.gamma, p.lam)
        explained_var = float(
            explained_variance(exp.values, returns, mask, all_reduce=dist.all_reduce_sum)
        )
        if p.whiten_advantages:
            advantages = whiten(advantages, mask, all_reduce=dist.all_reduce_sum)
        exp = exp.replace(advantages=advantages, returns=returns)

        # 6. PPO epochs on the whole batch: clipped surrogate for the actor, clipped value loss for the critic.
        t1 = time.perf_counter()
        full = gather(exp)
        with at_step(step):
            update = ppo_update(
                full,
                settings,
                actor=Trained(actor, actor_opt, actor_sched),
                critic=Trained(critic, critic_opt, critic_sched),
                shuffle_seed=row_seed(t.seed, step, -1),
                ptx=ptx,
                tokenizer=tokenizer,
                first=first,
                record_first_step=pi_old is None,
            )
        updated(o, cfg, step)  # the engine (and a generator) take the new weights
        t_train = time.perf_counter() - t1
        # μ against π_old on the trained tokens: the experience's π_old (the first pass's: one process),
        # or with bypass the rows of the update's first mini-batch (all of them by default)
        if pi_old is not None:
            old, rows = (full.old_logprobs if not bypass else pi_old), full.valid
        else:
            old, rows = update.pop("first_step")
        mismatch = mismatch_metrics(
            old,
            full.behaviour_logprobs,
            full.mask & rows[:, None],
            mode=r.correction_mode,
            cap=r.correction_cap,
            band=r.correction_band,
            every_mode=r.staleness >= 1,
        )

        # 7. The KL controller sees the batch's mean sequence KL, d = mean_b Σ_t KL_t.
        seq_kl = dist.global_mean(kl.sum(dim=1), weights=valid.float())
        beta_used = kl_ctl.beta
        kl_ctl.update(seq_kl, n_steps=int(dist.global_sum(int(valid.sum()))))

        # 8. Log, sample rows, checkpoint. The step's model FLOPs: the actor's decode; π_old (unless the
        # first pass gave it), π_ref, V_old and r_ψ forward; the actor's and the critic's training passes.
        step_s = time.perf_counter() - t0
        flops = online_step_flops(
            run.shapes,
            prompt_mask=rollout.prompt_mask,
            response_mask=rollout.real_mask,
            policy="actor",
            forward=("reference", "critic", "reward_model")
            + (("actor",) if first is None and not bypass else ()),
            trained={"actor": update["trained"] + update["ptx"], "critic": update["trained"]},
            device=run.device,
        )
        w = valid.float()
        metrics = {
            "score/mean": dist.global_mean(scores, w),
            **score_metrics(got.components, valid, list(models.scorer.functions)),
            "reward/total_mean": dist.global_mean(rewards.sum(1), w),
            "kl/seq_mean": seq_kl,
            "kl/beta": beta_used,
            "kl/beta_next": kl_ctl.beta,
            **update.pop("stats"),
            **mismatch,
            "value/explained_variance": explained_var,
            **common_metrics(
                o,
                got,
                {"data/skipped_nonfinite": counters["skipped_nonfinite"]},
                step_s=step_s,
                t_train=t_train,
                tokens=update["tokens"],
                flops=flops,
                trained_tokens=update["tokens"] + update["ptx"].body,
            ),
        }
        log_step(
            o,
            cfg,
            step,
            got,
            metrics,
            {"score": metrics["score/mean"], "kl": seq_kl, "beta": kl_ctl.beta},
        )
        end_step(
            o,
            cfg,
            step,
            trained=trained,
            stateful=stateful,
            counters=counters,
            # the trained policy in the run directory itself and the critic in critic/, before the
            # last checkpoint: --model.path runs/ppo starts the next stage from the policy
            exports={"policy": (actor, tokenizer), "critic": (critic, tokenizer)},
            export=lambda: export_models(run.dir, actor, critic, tokenizer),
        )
    return finish(o, cfg, start, lambda: export_models(run.dir, actor, critic, tokenizer))


def export_models(run_dir: Path, actor, critic, tokenizer) -> None:
    """The final policy into ``run_dir`` itself (a model directory ``from_pretrained`` opens), the
    critic into ``run_dir/critic`` (:func:`proximal.train.checkpoint.export_final`)."""
    export_final(run_dir, actor, tokenizer)
    export_final(run_dir / "critic", critic, tokenizer)


# ----------------------------------------------------------------------------------------------
# The PPO update (the clipped surrogate, the clipped value loss, entropy and PTX)
# ----------------------------------------------------------------------------------------------


@dataclass
class PTXData:
    """The PTX term: pretraining texts, the sampler that picks a batch per optimiser step, the length
    texts are cut to, and γ_PTX > 0, the term's coefficient (with γ_PTX = 0 there is no PTXData)."""

    texts: list[str]
    sampler: Sampler
    max_length: int
    coef: float


def load_ptx(cfg: PPOConfig, tokenizer, run) -> PTXData:
    """``data.ptx_file``'s texts with their own sampler (``data.ptx_batch_size`` rows a step,
    seeded ``train.seed`` + 7), ``data.ptx_max_length`` and ``ppo.ptx_coef``."""
    texts = load_texts(cfg.data.ptx_file, tokenizer=tokenizer)
    sampler = Sampler(
        len(texts),
        cfg.data.ptx_batch_size,
        seed=cfg.train.seed + 7,
        rank=run.rank,
        world_size=run.world_size,
    )
    return PTXData(texts, sampler, cfg.data.ptx_max_length, cfg.ppo.ptx_coef)


@dataclass
class FirstPass:
    """The first epoch's actor forward over the whole batch, run before the experience: its
    log-probabilities (and entropies), ``scores``, carry their graph into the first optimiser step;
    detached, the log-probabilities are log π_old (0 after each row's end)."""

    scores: TokenScores | None
    old_logprobs: torch.Tensor
    # log π_old on the full softmax where old_logprobs replay the filter (rollout.replay_filter)
    old_full_logprobs: torch.Tensor | None = None

    def take(self) -> TokenScores:
        """The scores, handed over once: after the first epoch neither the update nor the training
        loop holds their graph — the hidden states and, on the logits path, the (B, T, V) logits (on
        the wide-vocab work 262 MB, alive through the later epochs and into the next step
        otherwise)."""
        scores, self.scores = self.scores, None
        return scores


def reuses_first_pass(
    enabled: bool, *, batch_size: int, mini_batch_size: int, micro_batch_size: int
) -> bool:
    """Whether the first epoch's actor forward can be the experience's (``ppo.reuse_first_pass`` is
    ``enabled``): one process, and the batch is one mini-batch of one micro-batch, so that epoch's
    only actor forward sees exactly the rollout."""
    return (
        enabled
        and dist.world_size() == 1
        and mini_batch_size >= batch_size
        and micro_batch_size >= batch_size
    )


def first_pass(
    rollout,
    actor,
    temperature: float,
    *,
    entropy_coef: float,
    path: str = "fused",
    filter: tuple[int, float] | None = None,
) -> FirstPass:
    """π_θ's response log-probabilities with gradients — and the entropies the first update reads,
    trained on when ``entropy_coef`` > 0 — and log π_old: the log-probabilities detached, computed
    exactly as :func:`proximal.rollout.experience.compute_experience` computes them (``path``:
    ``train.logprobs``; ``filter``: ``rollout.replay_filter``'s (top_k, top_p)).

    Only the actor's pass is shared: V_old needs a critic forward anyway, and sharing that one too would
    keep both models' activations alive together until the first backward (measured on the tiny
    benchmark work: 230 MB more peak memory for 0.04 s a step)."""
    scores = response_logprobs(
        actor, rollout, temperature, entropy=_entropy_mode(entropy_coef), path=path, filter=filter
    )
    full = None if scores.full_logprobs is None else scores.full_logprobs.detach()
    return FirstPass(scores, scores.logprobs.detach(), full)


def _entropy_mode(entropy_coef: float) -> str:
    """The bonus c2·S is trained on when c2 > 0; otherwise S is only logged (no gradient)."""
    return "trained" if entropy_coef > 0 else "logged"


@dataclass(frozen=True)
class PPOUpdate:
    """PPO's update settings, built once where the run is built (:meth:`of`): the ``ppo.*`` fields
    the update reads, the sampling ``temperature`` (``rollout.temperature``), ``max_length`` (the
    longest response: ``rollout.max_new_tokens``, or an agent run's budget), ``max_grad_norm``
    (``optim.*``), ``logprobs_path`` (``train.logprobs``), the rollout correction
    (``rollout.correction``, ``correction_cap``, ``correction_band``) and the filter π_θ is
    computed under (``rollout.replay_filter``: (top_k, top_p), or None)."""

    epochs: int
    mini_batch_size: int
    micro_batch_size: int
    aggregation: str
    clip_eps: float
    value_clip_eps: float
    entropy_coef: float
    vf_coef: float
    target_kl: float | None
    temperature: float
    max_length: int
    max_grad_norm: float
    dual_clip: float | None = None
    logprobs_path: str = "fused"
    correction: str = "none"
    correction_cap: float = 2.0
    correction_band: list[float] | None = None
    filter: tuple[int, float] | None = None

    @classmethod
    def of(cls, cfg: PPOConfig, max_length: int) -> PPOUpdate:
        p, r = cfg.ppo, cfg.rollout
        return cls(
            epochs=p.epochs,
            mini_batch_size=p.mini_batch_size,
            micro_batch_size=p.micro_batch_size,
            aggregation=p.aggregation,
            clip_eps=p.clip_eps,
            value_clip_eps=p.value_clip_eps,
            entropy_coef=p.entropy_coef,
            vf_coef=p.vf_coef,
            target_kl=p.target_kl,
            temperature=r.temperature,
            max_length=max_length,
            max_grad_norm=cfg.optim.max_grad_norm,
            dual_clip=p.dual_clip,
            logprobs_path=cfg.train.logprobs,
            correction=r.correction_mode,
            correction_cap=r.correction_cap,
            correction_band=r.correction_band,
            filter=r.replayed_filter,
        )


def ppo_update(
    exp: Experience,
    s: PPOUpdate,
    *,
    actor: Trained,
    critic: Trained,
    shuffle_seed: int,
    ptx: PTXData | None = None,
    tokenizer=None,
    first: FirstPass | None = None,
    record_first_step: bool = False,
) -> dict:
    """The settings ``s`` (:class:`PPOUpdate`). ``epochs`` passes over shuffled mini-batches of
    ``mini_batch_size`` rows of the **whole** batch
    ``exp`` (every rank holds it, :func:`proximal.rollout.experience.gather`); rank r trains on the r-th
    part of each mini-batch, in micro-batches of ``micro_batch_size`` rows whose gradients accumulate
    — first the actor's, then its step, then the critic's and its step, so only one model's gradients
    are held at a time.

    The losses (``ppo.*`` of the config, docs/formulas.md): the actor's −(L^CLIP(``clip_eps``) +
    ``entropy_coef``·S), plus ``ptx.coef``·(−L^PTX) with ``ptx``; the critic's ``vf_coef``·
    L^VF(``value_clip_eps``). Every loss is normalised by the ``aggregation``'s unit count over the
    whole mini-batch (:func:`proximal.core.aggregation_units`) divided by the number of ranks, because
    FSDP averages gradients over ranks: the accumulated gradient is exactly that of the mini-batch's
    loss, whatever the micro-batch size and the number of processes. The ``target_kl`` early stop
    (None: never) is decided on the global approximate KL, so every rank stops at the same
    mini-batch.

    With ``first`` (:func:`reuses_first_pass`), the first epoch's one mini-batch is the whole batch in
    rollout order — a mini-batch's loss does not depend on the order of its rows — and its actor
    forward is ``first``'s; the shuffle generator still draws that epoch's order, so every later epoch
    sees the rows in the same order as without it.

    ``logprobs_path``: ``train.logprobs`` for the actor's and PTX's log-probabilities
    (:func:`proximal.models.output.token_logprobs`).

    ``correction`` (``rollout.correction``, with ``correction_cap`` and ``correction_band``): the
    detached weights of :func:`proximal.core.correction_weights` from π_old (``exp.old_logprobs``) and μ
    (``exp.behaviour_logprobs``) on each token's clipped-surrogate term; ``bypass`` has
    ``exp.old_logprobs`` = μ already and no weights.

    Returns ``{"stats": {...}, "tokens": int, "trained": Tokens, "ptx": Tokens}``: mean losses and
    statistics over the optimiser steps, and the tokens this update passed through the models (all
    ranks): their count, those of the rollout's rows for the FLOP count, and PTX's. With
    ``record_first_step`` also ``"first_step"``: the actor forward's log-probabilities of the rows it
    saw before the first optimiser step (so log π_old there), (B, T), and those rows, (B,) bool —
    every rank's (:class:`proximal.train.correction.FirstStepLogprobs`).
    """
    W, rank = dist.world_size(), dist.rank()
    B, mb = len(exp), min(s.mini_batch_size, len(exp))
    per_rank = mb // W
    g = torch.Generator().manual_seed(shuffle_seed)
    device = exp.rollout.response_ids.device
    history: dict[str, list[float]] = {}
    tokens, trained, ptx_tokens = 0, Tokens(), Tokens()
    stopped, epochs_run = False, 0
    if s.correction not in ("none", "bypass") and exp.behaviour_logprobs is None:
        raise ValueError(f"rollout.correction {s.correction} needs the engine's log-probabilities")
    recorder = (
        FirstStepLogprobs(B, exp.rollout.response_ids.shape[1], device)
        if record_first_step
        else None
    )
    for epoch in range(s.epochs):
        epochs_run += 1
        order = torch.randperm(B, generator=g).to(device)
        for start in range(0, B, mb):
            mini = order[start : start + mb]
            units = float(aggregation_units(exp.mask[mini], s.aggregation))
            if units == 0:  # every row of this mini-batch was masked out: the same on every rank
                continue
            norm = units / W
            if first is not None and epoch == 0:
                # one mini-batch of one micro-batch: the rollout itself
                micro, given, rows = [exp], [first.take()], [torch.arange(B, device=device)]
            else:
                own = mini[rank * per_rank : (rank + 1) * per_rank]
                rows = list(own.split(s.micro_batch_size))
                micro, given = [exp.select(idx) for idx in rows], None
            # the rates this step runs at
            lrs = (actor.scheduler.get_last_lr()[0], critic.scheduler.get_last_lr()[0])

            # The actor: −(L^CLIP + c2·S), plus γ_PTX·(−L^PTX), then one optimiser step.
            row = actor_pass(
                micro,
                actor.module,
                clip_eps=s.clip_eps,
                dual_clip=s.dual_clip,
                entropy_coef=s.entropy_coef,
                aggregation=s.aggregation,
                norm=norm,
                temperature=s.temperature,
                max_length=s.max_length,
                given=given,
                path=s.logprobs_path,
                filter=s.filter,
                correction=s.correction,
                correction_cap=s.correction_cap,
                correction_band=s.correction_band,
                # no optimiser step yet: the forward is π_old
                record=(recorder, rows) if recorder is not None and not history else None,
            )
            given = None  # the first pass's graph is not held through the critic's pass
            if ptx is not None:
                loss, seen = ptx_step(actor.module, tokenizer, ptx, path=s.logprobs_path)
                ptx_tokens += seen
                (ptx.coef * loss).backward()
                row["loss/ptx"] = dist.global_sum(loss.detach()) / W
            row["grad_norm/actor"] = clip_and_step(
                actor.module, actor.optimizer, actor.scheduler, s.max_grad_norm, what="actor"
            )
            # The critic: c1·L^VF, then one optimiser step.
            row.update(
                critic_pass(
                    micro,
                    critic.module,
                    value_clip_eps=s.value_clip_eps,
                    vf_coef=s.vf_coef,
                    aggregation=s.aggregation,
                    norm=norm,
                    max_length=s.max_length,
                )
            )
            row["grad_norm/critic"] = clip_and_step(
                critic.module, critic.optimizer, critic.scheduler, s.max_grad_norm, what="critic"
            )
            tokens += sum(int(m.rollout.attention_mask.sum()) for m in micro)
            for m in micro:
                trained += Tokens.from_masks(m.rollout.attention_mask, m.mask)
            for k, v in row.items():
                history.setdefault(k, []).append(v)
            if s.target_kl is not None and row["policy/approx_kl"] > s.target_kl:
                stopped = True  # a global value, so every rank agrees
                break
        if stopped:
            break
    stats = {
        k: (max(v) if k == "policy/ratio_max" else sum(v) / len(v)) for k, v in history.items()
    }
    stats["policy/epochs_run"] = epochs_run
    # mini-batches with rows to train on
    stats["policy/optimizer_steps"] = len(history.get("grad_norm/actor", []))
    stats["policy/early_stopped"] = float(stopped)
    if history:
        stats["lr/actor"], stats["lr/critic"] = lrs
    out = {
        "stats": stats,
        "tokens": int(dist.global_sum(tokens)),
        "trained": global_tokens(trained, device),
        "ptx": ptx_tokens,
    }
    if recorder is not None:
        out["first_step"] = recorder.gathered()
    return out


def actor_pass(
    micro: list[Experience],
    actor,
    *,
    clip_eps: float,
    dual_clip: float | None = None,
    entropy_coef: float,
    aggregation: str,
    norm: float,
    temperature: float,
    max_length: int,
    given: list[TokenScores] | None = None,
    path: str = "fused",
    filter: tuple[int, float] | None = None,
    correction: str = "none",
    correction_cap: float = 2.0,
    correction_band: list[float] | None = None,
    record: tuple[FirstStepLogprobs, list[torch.Tensor]] | None = None,
) -> dict[str, float]:
    """Back-propagate the actor's loss −(L^CLIP + c2·S) over this rank's micro-batches of a
    mini-batch; its global stats (token means over the mini-batch's valid tokens; losses summed over
    ranks ÷ W; the largest ratio). ``given``: each micro-batch's log-probabilities and entropies,
    already computed with gradients (:class:`FirstPass`); ``path``: ``train.logprobs``;
    ``filter``: ``rollout.replay_filter``'s (top_k, top_p), the truncated support log π_θ is
    computed on (the entropy stays the full softmax's).
    ``correction``: the rollout correction's weights on each token's surrogate (:func:`ppo_update`).
    ``record``: a recorder and each micro-batch's rows of the batch, to keep the forward's
    log-probabilities (:class:`proximal.train.correction.FirstStepLogprobs`)."""
    device = micro[0].rollout.response_ids.device
    corrected = correction not in ("none", "bypass")
    band = None if correction_band is None else tuple(correction_band)

    def step(part: list) -> dict:
        [(m, scores, rows)] = part
        mask, n = m.mask, m.mask.sum().double()
        if scores is None:  # log π_θ and S in one pass (the entropy trained on only when c2 > 0)
            scores = response_logprobs(
                actor,
                m.rollout,
                temperature,
                mask=mask,
                entropy=_entropy_mode(entropy_coef),
                path=path,
                filter=filter,
            )
        logprobs = scores.logprobs
        if record is not None:
            record[0].put(rows, logprobs)
        w = None  # the rollout correction's weights from π_old/μ (bypass: m.old_logprobs is μ)
        if corrected:
            w, _ = correction_weights(
                correction,
                m.old_logprobs,
                m.behaviour_logprobs,
                mask,
                cap=correction_cap,
                band=band,
            )
        entropy = masked_aggregate(
            scores.entropy, mask, aggregation, max_length=max_length, normalizer=norm
        )
        pg_loss, pg = ppo_policy_loss(
            logprobs,
            m.old_logprobs,
            m.advantages,
            mask,
            clip_eps=clip_eps,
            aggregation=aggregation,
            max_length=max_length,
            normalizer=norm,
            dual_clip=dual_clip,
            is_weights=w,
        )
        (pg_loss - entropy_coef * entropy).backward()
        return {
            "clipfrac": pg["clipfrac"].double() * n,  # token means, weighted by their count
            "clipfrac_dual": pg["clipfrac_dual"].double() * n,
            "approx_kl": pg["approx_kl"].double() * n,
            "approx_kl_k1": pg["approx_kl_k1"].double() * n,
            "n_tokens": n,
            "loss": pg_loss.detach(),  # shares of the mini-batch's loss: they add up to it
            "entropy": entropy.detach(),
            "ratio_max": pg["ratio_max"],  # −inf for a micro-batch without a valid token
        }

    # Each of accumulate's rows is a micro-batch already (cut by index in ppo_update), with its scores
    # when the first pass gave them: it takes them one at a time.
    given = given if given is not None else [None] * len(micro)
    rows = record[1] if record is not None else [None] * len(micro)
    s = accumulate(list(zip(micro, given, rows)), 1, step, device, maxima=("ratio_max",))
    W = dist.world_size()
    dual = {"policy/clipfrac_dual": s["clipfrac_dual"] / s["n_tokens"]} if dual_clip else {}
    return {
        **dual,
        "policy/clipfrac": s["clipfrac"] / s["n_tokens"],
        "policy/approx_kl": s["approx_kl"] / s["n_tokens"],
        "policy/approx_kl_k1": s["approx_kl_k1"] / s["n_tokens"],
        "loss/policy": s["loss"] / W,
        "policy/entropy": s["entropy"] / W,
        "policy/ratio_max": s["ratio_max"],
    }


def critic_pass(
    micro: list[Experience],
    critic,
    *,
    value_clip_eps: float,
    vf_coef: float,
    aggregation: str,
    norm: float,
    max_length: int,
) -> dict[str, float]:
    """Back-propagate c1·L^VF over this rank's micro-batches of a mini-batch (cut as for
    :func:`actor_pass`); its global stats."""
    device = micro[0].rollout.response_ids.device

    def step(part: list[Experience]) -> dict:
        [m] = part
        mask, n = m.mask, m.mask.sum().double()
        values = critic_values(critic, m.rollout)
        vf_loss, vf = value_loss(
            values,
            m.values,
            m.returns,
            mask,
            value_clip_eps,
            aggregation=aggregation,
            max_length=max_length,
            normalizer=norm,
        )
        (vf_coef * vf_loss).backward()
        return {"clipfrac": vf["vf_clipfrac"].double() * n, "n_tokens": n, "loss": vf_loss.detach()}

    s = accumulate(micro, 1, step, device)
    return {
        "value/clipfrac": s["clipfrac"] / s["n_tokens"],
        "loss/value": s["loss"] / dist.world_size(),
    }


def ptx_step(actor, tokenizer, ptx: PTXData, *, path: str = "fused") -> tuple[torch.Tensor, Tokens]:
    """This rank's share of −L^PTX on the next global batch of pretraining texts (normalised by the
    whole batch's token count, like the PPO losses); ``path``: ``train.logprobs``. With it, the
    whole batch's tokens (every rank's), for the step's FLOP count."""
    batch = ptx.sampler.next_global_batch()
    rows = [
        tokenizer(ptx.texts[i], add_special_tokens=True).input_ids[: ptx.max_length] for i in batch
    ]
    total = sum(max(len(x) - 1, 0) for x in rows)  # predicted tokens, all ranks
    mine = ptx.sampler.local_part(rows)
    ids, att = pad_right(mine, tokenizer.pad_token_id, next(actor.parameters()).device)
    mask = att[:, 1:].bool()
    logprobs = token_logprobs(
        actor, ids, att, 0, ids.shape[1] - 1, ids[:, 1:], mask=mask, path=path
    ).logprobs  # position i predicts token i + 1
    # −L^PTX = ptx_loss's mean NLL, from the log-probabilities (core.losses.nll_from_logprobs)
    loss = nll_from_logprobs(logprobs, mask, normalizer=total / dist.world_size())
    return loss, Tokens.of([len(x) for x in rows], head=total)


# ----------------------------------------------------------------------------------------------
# Set-up: the models
# ----------------------------------------------------------------------------------------------


@dataclass
class PPOModels:
    tokenizer: object
    actor: torch.nn.Module
    reference: object  # proximal.models.policy.Reference
    critic: torch.nn.Module
    scorer: object  # proximal.rollout.scoring.Scorer


def build_models(
    cfg: PPOConfig, device: torch.device, world_size: int, functions: dict
) -> PPOModels:
    """The four models, loaded in train.precision's dtypes, placed, and sharded across processes."""
    mc, t = cfg.model, cfg.train
    lora = mc.lora()
    tokenizer, actor, reference = build_policy(
        mc.path,
        lora=lora,
        precision=t.precision,
        device=device,
        world_size=world_size,
        activation_checkpointing=t.activation_checkpointing,
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
        micro_batch_size=cfg.ppo.micro_batch_size,
        timeout_s=mc.reward_timeout_s,
    )
    if mc.critic == "reward_model":
        if not same_tokenizer(tokenizer, scorer.reward_tokenizer):
            raise ModelLoadError(
                f"model.critic = reward_model, but the reward model's tokenizer ({mc.reward_model}) "
                f"differs from the policy's ({mc.path}); the critic reads the policy's tokens. "
                "Set model.critic: policy, or a critic checkpoint with the policy's tokenizer."
            )
    elif mc.critic != "policy":
        critic_tok = load_tokenizer(mc.critic, role="critic tokenizer (model.critic)")
        if not same_tokenizer(tokenizer, critic_tok):
            raise ModelLoadError(
                f"model.critic {mc.critic!r}: its tokenizer differs from the policy's "
                f"({mc.path}); the critic must read the policy's tokens"
            )
    critic = build_critic(
        mc.critic,
        policy_path=mc.path,
        reward_model_path=mc.reward_model,
        dtype=load_dtype(t.precision, trained=True),
        pad_token_id=tokenizer.pad_token_id,
        lora=lora if mc.critic_lora else None,
    )
    prepare_trained(
        critic,
        device=device,
        precision=t.precision,
        world_size=world_size,
        activation_checkpointing=t.activation_checkpointing,
        merge_lora=cfg.output.merge_lora,  # with model.critic_lora
    )
    return PPOModels(tokenizer, actor, reference, critic, scorer)


def cli(argv: list[str]) -> int:
    return config_command(
        argv, prog="ppo", description=__doc__.splitlines()[0], config_cls=PPOConfig, train=train
    )
