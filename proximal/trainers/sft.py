"""Supervised fine-tuning: the SFT model that the RLHF methods start from and stay near.

``proximal sft --config sft.yaml [--section.key value ...]`` trains a causal LM on prompt/response
pairs with the next-token loss on the **response tokens only** (the prompt is given, not learned),
logs the held-out loss, and writes a Hugging Face checkpoint into ``output.dir``;
``proximal sft --resume RUN_DIR`` continues an interrupted run exactly.

The file reads top to bottom: the config, the loop in :func:`train`, its per-micro-batch step.
The loss is :func:`proximal.core.sft_loss`; the run's life (checkpoints, resume, logs, several
processes) is the shared layer's (:mod:`proximal.train`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from proximal.config import check_valid, option, section
from proximal.core import sft_loss
from proximal.data.sampler import Sampler
from proximal.data.sft import ON_EMPTY, ON_TOO_LONG, collate_sft, load_sft_examples
from proximal.logging import read_metrics
from proximal.models.heads import lm_logits
from proximal.models.loading import check_fits, load_causal_lm, load_tokenizer
from proximal.models.parallel import load_dtype, prepare_trained
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
)

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclass
class SFTData:
    train_file: str = option(
        "",
        'JSONL training file, one record per line: {"prompt": str, '
        '"response": str} or {"messages": [...]} whose last message is the '
        "assistant's response (docs/sft.md). Required.",
    )
    eval_file: str | None = option(
        None, "JSONL file in the same format for the held-out loss; null = no held-out evaluation."
    )
    max_length: int = option(
        512,
        "Longest prompt + response + EOS, in tokens. A longer row is an error "
        "naming its file and line, or is dropped (see on_too_long).",
    )
    on_too_long: str = option(
        "error",
        "What to do with a row longer than max_length: 'error' stops with "
        "its file:line; 'skip' drops it and counts it in metrics.jsonl.",
        choices=ON_TOO_LONG,
    )
    on_empty: str = option(
        "error",
        "What to do with a row whose response is empty: 'error' stops with its "
        "file:line; 'skip' drops it and counts it in metrics.jsonl.",
        choices=ON_EMPTY,
    )

    def problems(self, name: str = "data") -> list[str]:
        e = [] if self.train_file else [f"{name}.train_file is required (a JSONL file)"]
        if self.max_length < 2:
            e.append(
                f"{name}.max_length = {self.max_length} must be at least 2 (a prompt token and EOS)"
            )
        return e


@dataclass
class SFTConfig:
    """``proximal sft`` configuration."""

    model: ModelSection = section(ModelSection, "The causal LM to fine-tune.")
    data: SFTData = section(SFTData, "Prompt/response data.")
    optim: OptimSection = section(OptimSection, "Optimisation.", schedule="linear")
    train: BatchTrainSection = section(
        BatchTrainSection, "Steps, batches, devices, checkpoints.", save_every=500
    )
    output: OutputSection = section(OutputSection, "Where the run is written.", dir="runs/sft")

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


def train(cfg: SFTConfig, resume_dir: str | Path | None = None) -> Path:
    """Fine-tune ``cfg.model.path`` on ``cfg.data.train_file``; return the run directory (the checkpoint)."""
    check_valid(cfg)
    t, d = cfg.train, cfg.data

    # 1. The run, the tokenizer and the data (data errors surface before the model loads).
    run = open_run(
        "sft",
        output_dir=cfg.output.dir,
        overwrite=cfg.output.overwrite,
        seed=t.seed,
        device=t.device,
        dist_timeout_s=t.dist_timeout_s,
        resume_dir=resume_dir,
    )
    tokenizer = load_tokenizer(cfg.model.path, role="model.path", padding_side="right")
    train_set, train_report = load_sft_examples(
        d.train_file,
        tokenizer,
        max_length=d.max_length,
        on_too_long=d.on_too_long,
        on_empty=d.on_empty,
    )
    eval_set, eval_report = (
        load_sft_examples(
            d.eval_file,
            tokenizer,
            max_length=d.max_length,
            on_too_long=d.on_too_long,
            on_empty=d.on_empty,
        )
        if d.eval_file
        else ([], None)
    )
    total = plan_steps(
        len(train_set),
        steps=t.steps,
        epochs=t.epochs,
        batch_size=t.batch_size,
        warmup_steps=cfg.optim.warmup_steps,
        train_file=d.train_file,
    )

    # 2. Model, optimiser and schedule, sampler; the checkpoint's state when resuming.
    model = load_causal_lm(
        cfg.model.path, role="model.path", dtype=load_dtype(t.precision, trained=True)
    )
    check_fits(model, tokenizer, d.max_length, cfg.model.path)
    model.generation_config.eos_token_id = (
        tokenizer.eos_token_id
    )  # so sampling from the result stops at EOS
    model.generation_config.pad_token_id = tokenizer.pad_token_id
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
            lambda idx: nll_step(model, [eval_set[i] for i in idx], pad, run.device),
            run.device,
        )
        model.train()
        return {"eval/loss": s["loss_sum"] / s["tokens"], "eval/tokens": int(s["tokens"])}

    # 3. Step 0: data counts and the held-out loss before any update.
    if start == 0:
        first = {
            **train_report.metrics("train"),
            **(eval_report.metrics("eval") if eval_report else {}),
            "train/total_steps": total,
        }
        run.log(0, {**first, **(held_out() if eval_set else {})})

    # 4. The loop: each optimiser step accumulates this rank's micro-batches of the global batch.
    for step in range(start + 1, total + 1):
        batch = [train_set[i] for i in sampler.next_global_batch()]
        n_tokens = sum(
            e.n_targets for e in batch
        )  # the whole batch's, so every share is normalised alike
        s = accumulate(
            sampler.local_part(batch),
            t.micro_batch_size,
            lambda rows: nll_step(model, rows, pad, run.device, n_tokens / W),
            run.device,
        )
        lr = scheduler.get_last_lr()[0]  # the rate this step runs at
        with at_step(step):
            grad_norm = clip_and_step(model, optimizer, scheduler, cfg.optim.max_grad_norm)

        # 5. Log; evaluate every eval_every steps and after the last one; checkpoint.
        row = {
            "train/loss": s["loss_sum"] / n_tokens,
            "train/tokens": n_tokens,
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
            postfix={k.split("/")[1]: row[k] for k in ("train/loss", "eval/loss") if k in row},
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

    # 6. The fine-tuned model (safetensors + tokenizer) next to config.yaml and metrics.jsonl.
    export_final(run.dir, model, tokenizer)
    run.finish()
    return run.dir


def nll_step(
    model, rows, pad_id: int, device, normalizer: float | None = None
) -> dict[str, torch.Tensor]:
    """One micro-batch's response-token NLL. With ``normalizer`` (the whole batch's token count ÷ the
    ranks) its share of the batch loss is back-propagated; without (evaluation) nothing is. Returns
    the NLL sum and the token count, for logging."""
    b = {k: v.to(device) for k, v in collate_sft(rows, pad_id).items()}
    mask = b["response_mask"][:, 1:]
    norm = normalizer if normalizer is not None else float(mask.sum())
    logits = lm_logits(
        model, b["input_ids"], b["attention_mask"], 0, b["input_ids"].shape[1] - 1
    )  # predict 1 … L−1
    loss = sft_loss(logits, b["input_ids"][:, 1:], mask, normalizer=norm)
    if normalizer is not None:
        loss.backward()
    return {"loss_sum": loss.detach() * norm, "tokens": mask.sum()}


def cli(argv: list[str]) -> int:
    def summary(run_dir: Path) -> str:
        values = [
            r["eval/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "eval/loss" in r
        ]
        change = f"held-out loss {values[0]:.4f} -> {values[-1]:.4f}; " if values else ""
        return f"{change}checkpoint saved to {run_dir}"

    return config_command(
        argv,
        prog="sft",
        description="Supervised fine-tuning of a causal LM on prompt/response "
        "pairs (loss on response tokens only).",
        config_cls=SFTConfig,
        train=train,
        summary=summary,
    )
