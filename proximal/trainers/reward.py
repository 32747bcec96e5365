"""Reward-model training on preference pairs with the Bradley–Terry loss (seed §2, item 3).

``proximal rm --config rm.yaml [--section.key value ...]`` fits R_ψ so that
P(y_w ≻ y_l | x) = σ(R_ψ(x, y_w) − R_ψ(x, y_l)) explains the preference data, and saves an
``AutoModelForSequenceClassification`` checkpoint with one label. ``proximal ppo`` loads it as the
frozen reward model and as the critic's initialisation.

The score of a sequence is the scalar head's output at its last real token — for a response, the EOS
appended after it — computed by :func:`proximal.models.heads.last_token_scores`, the very function
PPO scores rollouts with. Batches are padded on the right. For a tokenizer whose pad token differs
from EOS this is exactly what the checkpoint's own ``model(...).logits`` returns (Hugging Face pools
the rightmost non-pad token); when pad = EOS, plain ``model(...).logits`` skips the trailing EOS and
reads the token before it, so score through ``last_token_scores`` (see docs/rm.md).

Config layout, optimizer, schedule and batching are those of ``proximal sft``
(:mod:`proximal.trainers.sft`), so the two commands are configured the same way.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from proximal.config import option, save_config, section
from proximal.core import bradley_terry_loss
from proximal.data.preferences import collate_pairs, load_preference_pairs
from proximal.data.sft import ON_TOO_LONG
from proximal.models.heads import last_token_scores
from proximal.models.loading import DTYPES
from proximal.trainers.common import (TrainSection, build_optimizer, check_fits, common_errors, data_metrics,
                                      finalize_run, index_batches, lr_at, plan_steps, prepare_output_dir,
                                      resolve_device, run_and_report, set_lr, to_device)

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclass
class RMModel:
    path: str = option("", "Initial weights: a causal-LM checkpoint (usually the SFT model; a zero-initialised "
                           "one-output head replaces the LM head) or an existing one-label sequence-"
                           "classification checkpoint (trained further as is). Its tokenizer is loaded from "
                           "the same place and saved with the result. Required.")
    dtype: str = option("float32", "Dtype the weights are loaded and trained in. float32 is the safe "
                                   "choice for AdamW; bfloat16 halves memory.", choices=tuple(DTYPES))


@dataclass
class RMData:
    train_file: str = option("", "JSONL training file of preference pairs: {\"prompt\": str, \"chosen\": str, "
                                 "\"rejected\": str} with an optional numeric \"margin\", or chat messages "
                                 "(docs/rm.md). Required.")
    eval_file: str | None = option(None, "JSONL file in the same format for held-out accuracy, loss and reward "
                                         "gap; null = no held-out evaluation.")
    max_length: int = option(512, "Longest prompt + response + EOS, in tokens, for either side of a pair. A "
                                  "longer row is an error naming its file and line, or is dropped (see "
                                  "on_too_long).")
    on_too_long: str = option("error", "What to do with a pair where either side is longer than max_length: "
                                       "'error' stops with its file:line; 'skip' drops the pair and counts it "
                                       "in metrics.jsonl.", choices=ON_TOO_LONG)


@dataclass
class RMOutput:
    dir: str = option("runs/rm", "Run directory: receives the sequence-classification checkpoint (safetensors "
                                 "+ tokenizer), config.yaml and metrics.jsonl.")
    overwrite: bool = option(False, "Replace an existing run in `dir`. Without it, a non-empty `dir` is an "
                                    "error, so a finished run is never clobbered by accident.")


@dataclass
class RMConfig:
    """``proximal rm`` configuration."""
    model: RMModel = section(RMModel, "The model the reward model starts from.")
    data: RMData = section(RMData, "Preference pairs.")
    train: TrainSection = section(TrainSection, "Optimisation (batch sizes count pairs).")
    output: RMOutput = section(RMOutput, "Where the run is written.")
    seed: int = option(0, "Seed for shuffling and any randomness in the model (dropout).")

    def validate(self) -> list[str]:
        return common_errors(self)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def pair_scores(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r_w, r_l)``, each (B,), from a batch built by :func:`collate_pairs` (chosen rows first)."""
    scores = last_token_scores(model, batch["input_ids"], batch["attention_mask"]).float()
    B = scores.shape[0] // 2
    return scores[:B], scores[B:]


def train(cfg: RMConfig) -> Path:
    """Train a reward model from ``cfg.model.path`` on ``cfg.data.train_file``; return the run directory."""
    from tqdm.auto import tqdm
    from transformers import set_seed

    from proximal.logging import MetricsLogger
    from proximal.models.loading import load_tokenizer

    # 1. Output directory, seed, tokenizer and data (data errors surface before the model loads).
    out = prepare_output_dir(cfg.output.dir, cfg.output.overwrite)
    set_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.model.path, role="model.path", padding_side="right")
    d, t = cfg.data, cfg.train
    train_set, train_report = load_preference_pairs(d.train_file, tokenizer, max_length=d.max_length,
                                                    on_too_long=d.on_too_long)
    eval_set, eval_report = (load_preference_pairs(d.eval_file, tokenizer, max_length=d.max_length,
                                                   on_too_long=d.on_too_long) if d.eval_file else ([], None))
    total_steps, steps_per_epoch = plan_steps(len(train_set), t, d.train_file)

    # 2. Model (a fresh zero head on a causal LM, or an existing classifier), optimizer, run files.
    device = resolve_device(t.device)
    model, new_head = load_reward_model(cfg.model.path, cfg.model.dtype, tokenizer)
    model.to(device)
    check_fits(model, tokenizer, d.max_length, cfg.model.path)
    optimizer = build_optimizer(model, t.lr, t.weight_decay)
    save_config(cfg, out / "config.yaml")
    logger = MetricsLogger(out)
    pad = tokenizer.pad_token_id

    def evaluate() -> dict:
        model.eval()
        chosen, rejected, margins = [], [], []
        with torch.no_grad():
            for i in range(0, len(eval_set), t.micro_batch_size):
                batch = to_device(collate_pairs(eval_set[i:i + t.micro_batch_size], pad), device)
                r_w, r_l = pair_scores(model, batch)
                chosen.append(r_w)
                rejected.append(r_l)
                margins.append(batch.get("margin", torch.zeros_like(r_w)))
        model.train()
        r_w, r_l = torch.cat(chosen), torch.cat(rejected)
        loss, stats = bradley_terry_loss(r_w, r_l, torch.cat(margins))
        both = torch.cat([r_w, r_l])
        return {"eval/loss": loss, "eval/accuracy": stats["accuracy"], "eval/reward_gap": stats["score_gap"],
                "eval/chosen_reward": r_w.mean(), "eval/rejected_reward": r_l.mean(),
                "eval/reward_std": both.std(unbiased=False)}

    # 3. Step 0: data counts and the held-out metrics before any update.
    first = {**data_metrics("train", train_report), **data_metrics("eval", eval_report),
             "train/total_steps": total_steps, "model/new_head": int(new_head)}
    if eval_set:
        first.update(evaluate())
    logger.log(0, first)

    # 4. The loop: each optimizer step accumulates batch_size / micro_batch_size micro-batches of pairs.
    model.train()
    batches = index_batches(len(train_set), t.batch_size, cfg.seed)
    bar = tqdm(range(1, total_steps + 1), desc="rm", unit="step", disable=None, dynamic_ncols=True)
    for step in bar:
        rows = [train_set[i] for i in next(batches)]
        set_lr(optimizer, lr_at(step, t.lr, t.warmup_steps, total_steps))
        loss_sum = acc_sum = gap_sum = 0.0
        for i in range(0, len(rows), t.micro_batch_size):
            batch = to_device(collate_pairs(rows[i:i + t.micro_batch_size], pad), device)
            r_w, r_l = pair_scores(model, batch)
            loss, stats = bradley_terry_loss(r_w, r_l, batch.get("margin", 0.0))
            weight = r_w.shape[0] / t.batch_size  # the loss is a mean over pairs: weight each micro-batch by its share
            (loss * weight).backward()
            loss_sum += float(loss.detach()) * weight
            acc_sum += float(stats["accuracy"]) * weight
            gap_sum += float(stats["score_gap"]) * weight
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # 5. Log; evaluate every eval_every steps and after the last one.
        row = {"train/loss": loss_sum, "train/accuracy": acc_sum, "train/reward_gap": gap_sum,
               "train/grad_norm": float(grad_norm), "train/lr": optimizer.param_groups[0]["lr"],
               "train/epoch": step / steps_per_epoch}
        if eval_set and (step == total_steps or (t.eval_every and step % t.eval_every == 0)):
            row.update(evaluate())
        logger.log(step, row)
        bar.set_postfix({"loss": f"{loss_sum:.4f}", "acc": f"{float(row.get('eval/accuracy', acc_sum)):.3f}"})
    bar.close()
    logger.close()

    # 6. Save the one-label classifier (safetensors + tokenizer) next to config.yaml and metrics.jsonl.
    finalize_run(out, model, tokenizer)
    return out


def load_reward_model(path: str, dtype: str, tokenizer):
    """``(model, new_head)``: a one-label sequence classifier with ``config.pad_token_id`` set.

    A checkpoint whose architecture is already ``...ForSequenceClassification`` keeps its head; any
    other (a causal LM, e.g. the SFT model) gets a fresh zero-initialised one, so every initial score is
    0 and the first steps cannot be dominated by a random head.
    """
    from transformers import AutoConfig

    from proximal.models.loading import ModelLoadError, load_sequence_scorer

    try:
        architectures = AutoConfig.from_pretrained(path).architectures or []
    except Exception as e:
        raise ModelLoadError(f"model.path: cannot read a model config from {path!r}: {e}") from e
    new_head = not any(a.endswith("ForSequenceClassification") for a in architectures)
    model = load_sequence_scorer(path, role="model.path", dtype=dtype, new_head=new_head)
    # HF's own pooling (used by anyone calling model(...).logits on the saved checkpoint) needs it.
    model.config.pad_token_id = tokenizer.pad_token_id
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        warnings.warn(f"the tokenizer's pad token is its EOS token ({tokenizer.eos_token!r}): score this reward "
                      "model with proximal.models.heads.last_token_scores (as proximal ppo does), not with "
                      "model(...).logits, whose pooling skips the trailing EOS", stacklevel=2)
    return model, new_head


def cli(argv: list[str]) -> int:
    from proximal.cli import config_command

    def run(cfg: RMConfig) -> int:
        return run_and_report("rm", train, cfg, ("eval/accuracy", "held-out accuracy"))

    return config_command(argv, prog="rm", description="Reward-model training on preference pairs with the "
                          "Bradley-Terry loss.", config_cls=RMConfig, run=run, resumable=False)
