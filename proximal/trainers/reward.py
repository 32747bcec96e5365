"""Reward-model training on preference pairs with the Bradley–Terry loss.

``proximal rm --config rm.yaml [--section.key value ...]`` fits R_ψ so that
P(y_w ≻ y_l | x) = σ(R_ψ(x, y_w) − R_ψ(x, y_l)) (Bradley & Terry 1952; Christiano et al. 2017)
explains the preference data, and saves an ``AutoModelForSequenceClassification`` checkpoint with
one label; ``proximal rm --resume RUN_DIR`` continues a run exactly. ``proximal ppo`` loads the result
as the frozen reward model and as the critic's initialisation.

The score of a sequence is the scalar head's output at its last real token — for a response, the EOS
appended after it — computed by :func:`proximal.models.heads.last_token_scores`, the very function
PPO scores rollouts with. Batches are padded on the right. For a tokenizer whose pad token differs
from EOS this is exactly what the checkpoint's own ``model(...).logits`` returns (Hugging Face pools
the rightmost non-pad token); when pad = EOS, plain ``model(...).logits`` skips the trailing EOS and
reads the token before it, so score through ``last_token_scores`` (see docs/rm.md).

Config layout, optimiser, schedule, batching and checkpoints are the shared layer's, as in
``proximal sft`` (:mod:`proximal.trainers.sft`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from proximal.config import check_valid, option, section
from proximal.core import bradley_terry_loss
from proximal.data.preferences import collate_pairs, load_preference_pairs
from proximal.data.sampler import Sampler
from proximal.logging import read_metrics
from proximal.models.loading import check_fits, load_tokenizer
from proximal.models.parallel import load_dtype, prepare_trained
from proximal.models.reward import load_reward_model, pair_scores
from proximal.train.batches import accumulate, evaluate, plan_steps
from proximal.train.checkpoint import export_final
from proximal.train.command import config_command
from proximal.train.optim import at_step, clip_and_step, optimizer_and_scheduler
from proximal.train.run import check_per_rank, open_run
from proximal.train.sections import (
    RENAMED_BATCH_FIELDS,
    BatchTrainSection,
    ModelSection,
    OptimSection,
    OutputSection,
    PreferenceDataSection,
)

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclass
class RMModel(ModelSection):
    path: str = option(
        "",
        "Initial weights: a causal-LM checkpoint (usually the SFT model; a zero-initialised "
        "one-output head replaces the LM head) or an existing one-label sequence-"
        "classification checkpoint (trained further as is). Its tokenizer is loaded from "
        "the same place and saved with the result. Required.",
    )


@dataclass
class RMConfig:
    """``proximal rm`` configuration."""

    model: RMModel = section(RMModel, "The model the reward model starts from.")
    data: PreferenceDataSection = section(PreferenceDataSection, "Preference pairs.")
    optim: OptimSection = section(OptimSection, "Optimisation.", schedule="linear")
    train: BatchTrainSection = section(
        BatchTrainSection, "Steps, batches (counting pairs), devices, checkpoints.", save_every=500
    )
    output: OutputSection = section(OutputSection, "Where the run is written.", dir="runs/rm")

    RENAMED: ClassVar[dict[str, str]] = RENAMED_BATCH_FIELDS

    def validate(self) -> list[str]:
        e = (
            self.model.problems()
            + self.data.problems()
            + self.optim.problems()
            + self.train.problems()
        )
        e += self.output.problems()
        if self.train.batch_size >= 1 and self.train.micro_batch_size >= 1:
            check_per_rank(
                e,
                "train.batch_size",
                self.train.batch_size,
                "train.micro_batch_size",
                self.train.micro_batch_size,
            )
        return e


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def train(cfg: RMConfig, resume_dir: str | Path | None = None) -> Path:
    """Train a reward model from ``cfg.model.path`` on ``cfg.data.train_file``; return the run directory."""
    check_valid(cfg)
    t, d = cfg.train, cfg.data

    # 1. The run, the tokenizer and the data (data errors surface before the model loads).
    run = open_run(
        "rm",
        output_dir=cfg.output.dir,
        overwrite=cfg.output.overwrite,
        seed=t.seed,
        device=t.device,
        dist_timeout_s=t.dist_timeout_s,
        resume_dir=resume_dir,
    )
    tokenizer = load_tokenizer(cfg.model.path, role="model.path", padding_side="right")
    load = dict(max_length=d.max_length, on_too_long=d.on_too_long, on_empty=d.on_empty)
    train_set, train_report = load_preference_pairs(d.train_file, tokenizer, **load)
    eval_set, eval_report = (
        load_preference_pairs(d.eval_file, tokenizer, **load) if d.eval_file else ([], None)
    )
    total = plan_steps(
        len(train_set),
        steps=t.steps,
        epochs=t.epochs,
        batch_size=t.batch_size,
        warmup_steps=cfg.optim.warmup_steps,
        train_file=d.train_file,
    )

    # 2. Model (a fresh zero head on a causal LM, or an existing classifier), optimiser, sampler, resume.
    model, new_head = load_reward_model(
        cfg.model.path, load_dtype(t.precision, trained=True), tokenizer
    )
    check_fits(model, tokenizer, d.max_length, cfg.model.path)
    prepare_trained(
        model,
        device=run.device,
        precision=t.precision,
        world_size=run.world_size,
        activation_checkpointing=t.activation_checkpointing,
    )
    model.train()
    optimizer, scheduler = optimizer_and_scheduler(model, cfg.optim, total_steps=total)
    sampler = Sampler(
        len(train_set),
        t.batch_size,
        seed=t.seed,
        drop_last=True,
        rank=run.rank,
        world_size=run.world_size,
    )
    trained, stateful = {"model": (model, optimizer)}, {"scheduler": scheduler, "sampler": sampler}
    start, counters = run.restore(trained, stateful)
    run.begin(
        cfg,
        start=start,
        total=total,
        counters=counters,
        progress=cfg.output.progress,
        tensorboard=cfg.output.tensorboard,
        wandb_project=cfg.output.wandb_project,
    )
    run.record_models(model=model)
    pad, W = tokenizer.pad_token_id, run.world_size

    def held_out() -> dict:
        model.eval()
        s = evaluate(
            len(eval_set),
            t.micro_batch_size,
            lambda idx: pair_step(model, [eval_set[i] for i in idx], pad, run.device),
            run.device,
        )
        model.train()
        n = s["pairs"]
        var = (s["reward_sq_sum"] / (2 * n)) - (
            (s["chosen_sum"] + s["rejected_sum"]) / (2 * n)
        ) ** 2
        return {
            "eval/loss": s["loss_sum"] / n,
            "eval/accuracy": s["correct"] / n,
            "eval/reward_gap": s["gap_sum"] / n,
            "eval/chosen_reward": s["chosen_sum"] / n,
            "eval/rejected_reward": s["rejected_sum"] / n,
            "eval/reward_std": max(var, 0.0) ** 0.5,
        }

    # 3. Step 0: data counts and the held-out metrics before any update.
    if start == 0:
        first = {
            **train_report.metrics("train"),
            **(eval_report.metrics("eval") if eval_report else {}),
            "train/total_steps": total,
            "model/new_head": int(new_head),
        }
        run.log(0, {**first, **(held_out() if eval_set else {})})

    # 4. The loop: each optimiser step accumulates this rank's micro-batches of pairs.
    for step in range(start + 1, total + 1):
        batch = [train_set[i] for i in sampler.next_global_batch()]
        s = accumulate(
            sampler.local_part(batch),
            t.micro_batch_size,
            lambda rows: pair_step(model, rows, pad, run.device, len(batch) / W),
            run.device,
        )
        lr = scheduler.get_last_lr()[0]  # the rate this step runs at
        with at_step(step):
            grad_norm = clip_and_step(model, optimizer, scheduler, cfg.optim.max_grad_norm)

        # 5. Log; evaluate every eval_every steps and after the last one; checkpoint.
        n = len(batch)
        row = {
            "train/loss": s["loss_sum"] / n,
            "train/accuracy": s["correct"] / n,
            "train/reward_gap": s["gap_sum"] / n,
            "train/grad_norm": grad_norm,
            "train/lr": lr,
            "train/epoch": step / sampler.steps_per_epoch,
            "time/wall_s": run.wall_s(),
        }
        if eval_set and (step == total or (t.eval_every and step % t.eval_every == 0)):
            row.update(held_out())
        run.log(
            step,
            row,
            postfix={
                "loss": row["train/loss"],
                "acc": row.get("eval/accuracy", row["train/accuracy"]),
            },
        )
        if run.save_due(step, total, t.save_every):
            run.save(
                step,
                trained=trained,
                stateful=stateful,
                counters=counters,
                exports={"model": (model, tokenizer)},
                keep=t.keep_checkpoints,
            )

    # 6. The one-label classifier (safetensors + tokenizer) next to config.yaml and metrics.jsonl.
    export_final(run.dir, model, tokenizer)
    run.finish()
    return run.dir


def pair_step(
    model, pairs, pad_id: int, device, normalizer: float | None = None
) -> dict[str, torch.Tensor]:
    """One micro-batch of pairs: the Bradley–Terry loss, back-propagated as this micro-batch's share of
    the batch's mean when ``normalizer`` (the batch's pairs ÷ the ranks) is given. Returns sums for logging."""
    batch = {k: v.to(device) for k, v in collate_pairs(pairs, pad_id).items()}
    r_w, r_l = pair_scores(model, batch)
    norm = normalizer if normalizer is not None else float(len(pairs))
    loss, _ = bradley_terry_loss(r_w, r_l, batch.get("margin", 0.0), normalizer=norm)
    if normalizer is not None:
        loss.backward()
    r_w, r_l = r_w.detach(), r_l.detach()
    return {
        "loss_sum": loss.detach() * norm,
        "correct": (r_w > r_l).sum(),
        "gap_sum": (r_w - r_l).sum(),
        "chosen_sum": r_w.sum(),
        "rejected_sum": r_l.sum(),
        "reward_sq_sum": (r_w**2).sum() + (r_l**2).sum(),
        "pairs": torch.tensor(len(pairs)),
    }


def cli(argv: list[str]) -> int:
    def summary(run_dir: Path) -> str:
        values = [
            r["eval/accuracy"]
            for r in read_metrics(run_dir / "metrics.jsonl")
            if "eval/accuracy" in r
        ]
        change = f"held-out accuracy {values[0]:.4f} -> {values[-1]:.4f}; " if values else ""
        return f"{change}checkpoint saved to {run_dir}"

    return config_command(
        argv,
        prog="rm",
        description="Reward-model training on preference pairs with the Bradley-Terry loss.",
        config_cls=RMConfig,
        train=train,
        summary=summary,
    )
