"""On-policy distillation: the student samples, a frozen teacher grades every token (reverse KL).

Agarwal et al. 2024 (GKD); Thinking Machines, "On-policy distillation" (2025). The student π_θ
samples its own responses, exactly as in GRPO; a frozen teacher π_t with the same tokenizer grades
every sampled token; the student is trained to lower the reverse KL KL(π_θ ‖ π_t) on its own
distribution — optionally plus a verifier's reward, "distill plus verify" in one run.

One step reads top to bottom in :func:`train`: (1) a global batch of prompts, (2) G responses to
each sampled from π_θ (G = 1 by default), (3) scored when a reward source is given, (4) the
experience: log π_old (the student that sampled) and log π_t (the teacher, in micro-batches, as
GRPO's reference), gathered so every rank holds the whole batch, (5) per-token advantages
A_t = −(log π_old − log π_t), discounted with ``distill.discount``
(:func:`proximal.core.reverse_kl_advantages`), plus ``distill.reward_weight``·(r − the group's
mean score), (6) ``distill.iterations`` passes of the clipped surrogate over mini-batches, a mean
over every token (GRPO's update, :func:`proximal.trainers.grpo.grpo_update`, with no KL term: the
teacher is the signal) — or, with ``distill.loss: jsd``, of GKD's generalised JSD(β) over the whole
vocabulary at each sampled position (:func:`jsd_update`), (7) logs and checkpoints. The shared
pieces are the online layer's (:mod:`proximal.trainers.online`).

Tensor notation: B responses in the generation batch (rollout.batch_size prompts × G), T padded
response length.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from proximal import dist
from proximal.config import ConfigError, check_valid
from proximal.core import (
    group_advantages,
    linear_generalized_jsd,
    masked_sum,
    reverse_kl_advantages,
)
from proximal.data.chat import set_chat_template
from proximal.models.flops import Tokens
from proximal.models.output import lm_hidden, output_head
from proximal.models.policy import build_policy, load_teacher
from proximal.rollout.collect import Responses
from proximal.rollout.engine import row_seed
from proximal.rollout.experience import Experience, compute_experience, gather
from proximal.rollout.sampling import Rollout
from proximal.rollout.scoring import build_scorer, score_metrics
from proximal.train.batches import accumulate
from proximal.train.checkpoint import export_final
from proximal.train.command import config_command
from proximal.train.correction import mismatch_metrics
from proximal.train.optim import Trained, at_step, clip_and_step, optimizer_and_scheduler
from proximal.train.perf import online_step_flops
from proximal.trainers.distill_config import AGGREGATION, DistillConfig
from proximal.trainers.grpo import GRPOUpdate, grpo_update
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

__all__ = ["DistillConfig", "train", "cli"]


def train(cfg: DistillConfig, resume_dir: str | Path | None = None) -> Path:
    """Run on-policy distillation as configured; return the run directory. ``resume_dir``
    continues a saved run exactly."""
    check_valid(cfg)
    t, r, d = cfg.train, cfg.rollout, cfg.distill
    # Inputs, models (the teacher's tokenizer checked before its weights load), held-out
    # evaluation, sampler, engine: as every online method (trainers/online.py)
    o = set_up("distill", cfg, resume_dir, build_models)
    run, models = o.run, o.models
    tokenizer, actor, teacher = models.tokenizer, models.actor, models.teacher
    settings = update_settings(cfg, o.responder.max_tokens)
    if d.lam > 0:  # GKD's λ: some responses are the data's teacher-written completions
        if d.completion_column not in o.prompts.column_names():
            raise ConfigError(
                f"distill.lam = {d.lam} reads the teacher-written completions from the column "
                f"distill.completion_column = {d.completion_column!r}, which {cfg.data.prompts} "
                f"does not have (its columns: {', '.join(o.prompts.column_names()) or 'none'})"
            )
        o.responder = TeacherWritten(o.responder, d.lam, d.completion_column, r.max_new_tokens)
    G, mini = r.group_size, cfg.mini_batch_size
    bypass = r.correction_mode == "bypass"  # π_old := μ, the engine's log-probabilities
    reward = cfg.has_reward and d.reward_weight > 0
    opt, sched = optimizer_and_scheduler(
        actor, cfg.optim, total_steps=t.steps * d.iterations * (cfg.responses_per_step // mini)
    )
    trained = {"actor": (actor, opt)}
    stateful = {"actor_scheduler": sched, "sampler": o.sampler}
    resident = dict(actor=actor, teacher=teacher.model, reward_model=models.scorer.reward_model)
    counters = {"skipped_nonfinite": 0}
    start, counters = begin(o, cfg, trained, stateful, counters, resident)

    for step in range(start + 1, t.steps + 1):
        t0 = time.perf_counter()
        # 1–3. A global batch of prompts; G responses ~ π_θ to each, each row from its own seeded
        # generator; scored when a reward source is given (otherwise every score is 0).
        got = collect_step(o, cfg, step, group_size=G)
        counters["skipped_nonfinite"] += int(dist.global_sum(got.nonfinite_rows()))

        # 4. Experience: log π_old (the student that sampled; the advantage needs it before the
        # update) and the teacher's log π_t of the same tokens, micro-batch by micro-batch (in the
        # reference's place). The sampled reverse KL over the student's own rows (not the
        # teacher-written ones of distill.lam), then gathered: every rank holds the whole batch.
        local = compute_experience(
            got.rollout,
            got.scores,
            got.valid,
            actor=actor,
            reference=teacher,
            temperature=r.temperature,
            micro_batch_size=d.micro_batch_size,
            old_pass=True,
            logprobs_path=t.logprobs,
            filter=r.replayed_filter,
        )
        own = local.mask
        if got.records is not None and d.lam > 0:
            written = torch.tensor([x["teacher_written"] for x in got.records], device=own.device)
            own = own & ~written[:, None]
        reverse_kl = dist.global_sum(
            masked_sum((local.old_unfiltered - local.ref_logprobs).double(), own), run.device
        ) / max(dist.global_sum(own.sum(), run.device), 1.0)
        exp = gather(local)
        if bypass:
            exp = exp.replace(old_logprobs=exp.behaviour_logprobs)
        mask = exp.mask  # (B, T) the valid rows' response tokens

        # 5. The per-token reward −(log π_old − log π_t) (on the full softmax: a replayed filter
        # truncates the ratio's π_old, never the teacher's comparison) and its discounted return;
        # with a reward, w·(r_i − its group's mean) on every token of response i.
        student = exp.old_unfiltered
        advantages = reverse_kl_advantages(student, exp.ref_logprobs, mask, d.discount)
        if reward:
            by_group = group_advantages(exp.scores, G, scale="none", valid=exp.valid)
            advantages = advantages + torch.where(
                mask, d.reward_weight * by_group[:, None].to(advantages.dtype), 0.0
            )
        # the teacher's log-probabilities are in the advantages (reverse_kl; jsd reads the teacher's
        # whole distribution in its update instead); the update has no KL term
        exp = exp.replace(advantages=advantages, ref_logprobs=None)

        # 6. μ iterations over mini-batches, a mean over every token of each: of
        # −min(ρ·Â, clip(ρ, 1 − ε, 1 + ε_high)·Â) (reverse_kl), or of JSD(β) over the vocabulary
        # between the student's and the teacher's next-token distributions (jsd).
        t1 = time.perf_counter()
        with at_step(step):
            if d.loss == "jsd":
                update = jsd_update(
                    exp,
                    settings,
                    actor=Trained(actor, opt, sched),
                    teacher=teacher.model,
                    beta=d.beta,
                    shuffle_seed=row_seed(t.seed, step, -1),
                )
            else:
                update = grpo_update(
                    exp,
                    settings,
                    actor=Trained(actor, opt, sched),
                    shuffle_seed=row_seed(t.seed, step, -1),
                )
        updated(o, cfg, step)  # the engine (and a generator) take the new weights
        t_train = time.perf_counter() - t1
        mismatch = mismatch_metrics(
            exp.old_logprobs,
            exp.behaviour_logprobs,
            mask,
            mode=r.correction_mode,
            cap=r.correction_cap,
            band=r.correction_band,
            every_mode=r.staleness >= 1,
        )

        # 7. Log, sample rows, checkpoint. The step's model FLOPs: the student's decode; π_old,
        # the teacher and r_ψ forward; the student's training.
        step_s = time.perf_counter() - t0
        flops = online_step_flops(
            run.shapes,
            prompt_mask=got.rollout.prompt_mask,
            response_mask=got.rollout.real_mask,
            policy="actor",
            # (jsd: the teacher's forward again in the update, not counted)
            forward=("actor", "teacher", "reward_model"),
            trained={"actor": update["trained"]},
            device=run.device,
        )
        metrics = {
            "distill/reverse_kl": reverse_kl,
            **(
                {
                    "score/mean": dist.global_mean(got.scores, got.valid.float()),
                    **score_metrics(got.components, got.valid, list(models.scorer.functions)),
                }
                if cfg.has_reward
                else {}
            ),
            "data/trained_frac": float(exp.valid.float().mean()),
            **update.pop("stats"),
            **mismatch,
            **common_metrics(
                o,
                got,
                {"data/skipped_nonfinite": counters["skipped_nonfinite"]},
                step_s=step_s,
                t_train=t_train,
                tokens=update["tokens"],
                flops=flops,
            ),
        }
        postfix = {"reverse_kl": reverse_kl}
        if cfg.has_reward:
            postfix["score"] = metrics["score/mean"]
        log_step(o, cfg, step, got, metrics, postfix)
        end_step(
            o,
            cfg,
            step,
            trained=trained,
            stateful=stateful,
            counters=counters,
            exports={"policy": (actor, tokenizer)},
            export=lambda: export_final(run.dir, actor, tokenizer),
        )
    return finish(o, cfg, start, lambda: export_final(run.dir, actor, tokenizer))


def update_settings(cfg: DistillConfig, max_length: int) -> GRPOUpdate:
    """What GRPO's update (:func:`~proximal.trainers.grpo.grpo_update`) reads, from the
    ``distill`` section: the clipped token surrogate, a mean over every token, no KL term."""
    d, r = cfg.distill, cfg.rollout
    return GRPOUpdate(
        aggregation=AGGREGATION,
        iterations=d.iterations,
        mini_batch_size=cfg.mini_batch_size,
        micro_batch_size=d.micro_batch_size,
        clip_eps=d.clip_eps,
        clip_eps_high=d.clip_eps_high,
        beta=0.0,
        temperature=r.temperature,
        max_length=max_length,
        max_grad_norm=cfg.optim.max_grad_norm,
        logprobs_path=cfg.train.logprobs,
        correction=r.correction_mode,
        correction_cap=r.correction_cap,
        correction_band=r.correction_band,
        filter=r.replayed_filter,
    )


class TeacherWritten:
    """GKD's mix of on- and off-policy data (Agarwal et al. 2024, algorithm 1): each row of a step
    is, with probability ``lam`` (``distill.lam`` = 1 − GKD's λ, the student's share), answered by
    its prompt row's teacher-written completion (the data column ``column``, tokenised without
    special tokens, the EOS appended, cut at ``max_new_tokens``) instead of the student's sample.
    The draw is the row's own, from a generator seeded by the row's seed
    (:func:`~proximal.rollout.engine.row_seed`, offset so that it is not the sampling stream), so it
    is the same on any number of processes and after ``--resume``. Each row's ``samples.jsonl``
    record says ``teacher_written``. A written row has no engine log-probabilities: with ``lam`` > 0
    the batch has none (``rollout/mismatch_*`` are NaN).

    A :class:`~proximal.rollout.collect.Responder` around the run's single-turn one (``inner``),
    whose other hooks it passes on."""

    def __init__(self, inner, lam: float, column: str, max_new_tokens: int):
        self.inner, self.lam, self.column, self.max_new_tokens = inner, lam, column, max_new_tokens
        self.max_tokens, self.row_tools, self.eval_keys = (
            inner.max_tokens,
            inner.row_tools,
            inner.eval_keys,
        )

    def written(self, seeds: list[int]) -> list[bool]:
        """Which rows (by their seeds) take the teacher's completion."""
        draw = [
            float(torch.rand((), generator=torch.Generator().manual_seed((s + _WRITTEN) % 2**63)))
            for s in seeds
        ]
        return [u < self.lam for u in draw]

    def ready(self, tokenizer, policy) -> None:
        self.inner.ready(tokenizer, policy)

    def respond(self, engine, tokenizer, prompts, sampling, *, device, **kw):
        got = self.inner.respond(engine, tokenizer, prompts, sampling, device=device, **kw)
        written = self.written(prompts.seeds)
        ro = got.rollout
        rows, ended = [], []
        for i, w in enumerate(written):
            if w:
                text = (prompts.columns[i] or {}).get(self.column)
                if text is None:
                    raise ConfigError(
                        f"distill.lam: the prompt row {prompts.texts[i][:60]!r} has no "
                        f"{self.column!r} (distill.completion_column) to take as the teacher's"
                    )
                ids = tokenizer(str(text), add_special_tokens=False)["input_ids"]
                ids = (ids + [tokenizer.eos_token_id])[: self.max_new_tokens]
                rows.append(ids)
                ended.append(ids[-1] == tokenizer.eos_token_id)
            else:
                n = int(ro.response_mask[i].sum())
                rows.append(ro.response_ids[i, :n].tolist())
                ended.append(bool(ro.ended[i]))
        T = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), T), tokenizer.pad_token_id, dtype=ro.response_ids.dtype)
        mask = torch.zeros(len(rows), T, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=ids.dtype)
            mask[i, : len(r)] = True
        rollout = Rollout(
            ro.prompt_ids,
            ro.prompt_mask,
            ids.to(device),
            mask.to(device),
            torch.tensor(ended, device=device),
            behaviour_logprobs=None,
        )
        records = [{"teacher_written": w} for w in written]
        return Responses(rollout, records=records)

    def outcome(self, got, scores, components):
        return self.inner.outcome(got, scores, components)

    def drop(self, got, valid, *, step, group_size, device):
        return self.inner.drop(got, valid, step=step, group_size=group_size, device=device)

    def metrics(self, got, dropped) -> dict[str, float]:
        w = torch.tensor([r["teacher_written"] for r in got.records], dtype=torch.float64)
        return {
            **self.inner.metrics(got, dropped),
            "distill/teacher_written_frac": dist.global_mean(w),
        }

    def check_offered(self, columns, source):
        return self.inner.check_offered(columns, source)

    def eval_scores(self, got):
        return self.inner.eval_scores(got)

    def eval_row(self, got, j):
        return self.inner.eval_row(got, j)

    def close(self) -> None:
        self.inner.close()


#: Added to a row's seed for its teacher-written draw (a stream apart from its sampling's).
_WRITTEN = 0x7EAC4E2


#: Statistics of a jsd update: its loss (summed over micro-batches and ranks: each is its share).
_JSD_KEYS = ("loss/total", "distill/jsd", "grad_norm/actor", "lr/actor")


def jsd_update(
    exp: Experience,
    s: GRPOUpdate,
    *,
    actor: Trained,
    teacher: torch.nn.Module,
    beta: float,
    shuffle_seed: int,
) -> dict:
    """``s.iterations`` passes over shuffled mini-batches of the whole batch ``exp`` (every rank
    holds it), each an optimiser step on the generalised JSD(β) between the student's and the
    teacher's next-token distributions at every valid response position
    (:func:`proximal.core.linear_generalized_jsd`, from both models' last hidden states, a chunk of
    positions at a time), a mean over the mini-batch's valid tokens: its sum over each rank's
    micro-batches is divided by the mini-batch's token count ÷ the number of ranks, so 1 and N
    processes and any micro-batch size take the same step. The teacher's forward runs again here,
    without gradients (its hidden states are not kept from the experience).

    Returns ``{"stats": {...}, "tokens": int, "trained": Tokens}``, as
    :func:`~proximal.trainers.grpo.grpo_update`."""
    W, rank = dist.world_size(), dist.rank()
    B = len(exp)
    per_rank = s.mini_batch_size // W
    gen = torch.Generator().manual_seed(shuffle_seed)
    device = exp.rollout.response_ids.device
    history: dict[str, list[float]] = {}
    tokens, trained = 0, Tokens()
    for _iteration in range(s.iterations):
        order = torch.randperm(B, generator=gen).to(device)
        for start in range(0, B, s.mini_batch_size):
            mini = order[start : start + s.mini_batch_size]
            units = float(exp.mask[mini].sum())
            if units == 0:  # every row of this mini-batch left out: the same on every rank
                continue
            sums = accumulate(
                mini[rank * per_rank : (rank + 1) * per_rank],
                s.micro_batch_size,
                lambda idx: jsd_micro_step(exp, idx, s, actor.module, teacher, beta, units / W),
                device,
            )
            tokens += int(sums["seen_tokens"])
            trained += Tokens(
                int(sums["seen_tokens"]), int(sums["seen_squares"]), int(sums["scored_tokens"])
            )
            row = {
                "loss/total": float(sums["loss"]) / W,
                "distill/jsd": float(sums["jsd_sum"]) / units,
                "lr/actor": actor.scheduler.get_last_lr()[0],
                "grad_norm/actor": clip_and_step(
                    actor.module, actor.optimizer, actor.scheduler, s.max_grad_norm, what="actor"
                ),
            }
            for k, v in row.items():
                history.setdefault(k, []).append(v)
    stats = {k: math.nan for k in _JSD_KEYS}
    stats.update({k: sum(v) / len(v) for k, v in history.items()})
    stats["policy/optimizer_steps"] = len(history.get("grad_norm/actor", []))
    return {"stats": stats, "tokens": tokens, "trained": trained}


def jsd_micro_step(
    exp: Experience,
    idx: torch.Tensor,
    s: GRPOUpdate,
    model,
    teacher,
    beta: float,
    norm: float,
) -> dict:
    """One micro-batch (rows ``idx``): the teacher's and the student's hidden states at the
    response positions (the student's with gradients), JSD(β) summed over the valid positions and
    divided by ``norm`` (the mini-batch's tokens per rank), backward; its sums for the statistics."""
    m = exp.select(idx)
    r = m.rollout
    P, L = r.prompt_ids.shape[1], r.input_ids.shape[1]
    with torch.no_grad():
        h_t, head_t = lm_hidden(teacher, r.input_ids, r.attention_mask, P - 1, L - 1)
    h_s, head_s = lm_hidden(model, r.input_ids, r.attention_mask, P - 1, L - 1)
    total, _ = linear_generalized_jsd(
        h_s, head_s.weight, h_t, head_t.weight, m.mask, beta, s.temperature, reduction="sum"
    )
    loss = total / norm
    loss.backward()
    return {
        "loss": loss.detach(),
        "jsd_sum": total.detach().double(),
        "seen_tokens": r.attention_mask.sum(),
        "seen_squares": r.attention_mask.sum(1).square().sum(),
        "scored_tokens": m.mask.sum(),
    }


@dataclass
class DistillModels:
    tokenizer: object
    actor: torch.nn.Module
    teacher: object  # proximal.models.policy.Reference (its .active() yields the frozen teacher)
    scorer: object  # proximal.rollout.scoring.Scorer
    reference: None = None  # no reference: the held-out evaluation's KL has nothing to read


def build_models(
    cfg: DistillConfig, device: torch.device, world_size: int, functions: dict
) -> DistillModels:
    """The student (with LoRA: its adapters), the teacher (its tokenizer checked against the
    student's, then loaded frozen, under ``model.frozen_sharding``) and the scorer, in
    train.precision's dtypes, placed and sharded across processes."""
    mc, t = cfg.model, cfg.train
    tokenizer, actor, _ = build_policy(
        mc.path,
        lora=mc.lora(),
        precision=t.precision,
        device=device,
        world_size=world_size,
        activation_checkpointing=t.activation_checkpointing,
        reference=False,
        frozen_sharding=mc.frozen_sharding,
        merge_lora=cfg.output.merge_lora,
    )
    teacher = load_teacher(
        mc.teacher,
        tokenizer,
        precision=t.precision,
        device=device,
        world_size=world_size,
        frozen_sharding=mc.frozen_sharding,
    )
    if cfg.distill.loss == "jsd":
        check_jsd_heads(actor, teacher.model)
    set_chat_template(tokenizer, mc.chat_template)  # the prompts' template, saved with the student
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
        micro_batch_size=cfg.distill.micro_batch_size,
        timeout_s=mc.reward_timeout_s,
    )
    return DistillModels(tokenizer, actor, teacher, scorer)


def check_jsd_heads(student, teacher) -> None:
    """ConfigError (one line) unless both output layers are plain (V, H) products of the same V,
    without a bias or a logit soft-cap: what :func:`proximal.core.linear_generalized_jsd` takes."""
    vocab = []
    for who, model in (("student (model.path)", student), ("teacher (model.teacher)", teacher)):
        head = output_head(model)
        if isinstance(head, str):
            raise ConfigError(f"distill.loss jsd cannot read the {who}'s output layer: {head}")
        if head.bias is not None or head.softcap is not None:
            raise ConfigError(
                f"distill.loss jsd: the {who}'s output layer has a "
                f"{'bias' if head.bias is not None else 'logit soft-cap'}, which the chunked JSD "
                "does not take; use distill.loss reverse_kl"
            )
        vocab.append(head.weight.shape[0])
    if vocab[0] != vocab[1]:
        raise ConfigError(
            f"distill.loss jsd compares whole distributions, but the student's output layer has "
            f"{vocab[0]} rows and the teacher's {vocab[1]}; use distill.loss reverse_kl (it reads "
            "the sampled tokens only)"
        )


def cli(argv: list[str]) -> int:
    return config_command(
        argv,
        prog="distill",
        description=__doc__.splitlines()[0],
        config_cls=DistillConfig,
        train=train,
    )
