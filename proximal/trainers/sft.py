"""Supervised fine-tuning: the SFT model that PPO starts from (actor) and stays near (reference), seed §2.

``proximal sft --config sft.yaml [--section.key value ...]`` trains a causal LM on prompt/response
pairs with the next-token loss on the **response tokens only** (the prompt is given, not learned),
logs the held-out loss, and saves a Hugging Face checkpoint into ``output.dir``.

The file reads top to bottom: the config, the loss, the loop in :func:`train`. The helpers the loop
uses (optimizer, schedule, batching, output directory) live in :mod:`proximal.trainers.common`,
shared with the reward-model trainer so the two commands behave alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from proximal.config import option, save_config, section
from proximal.core import logprobs_from_logits, masked_sum
from proximal.data.sft import ON_TOO_LONG, collate_sft, load_sft_examples
from proximal.models.loading import DTYPES
from proximal.trainers.common import (TrainSection, build_optimizer, check_fits, common_errors, data_metrics,
                                      finalize_run, index_batches, lr_at, plan_steps, prepare_output_dir,
                                      resolve_device, run_and_report, set_lr, to_device)

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclass
class SFTModel:
    path: str = option("", "Causal LM to fine-tune: a local directory or a hub id. Its tokenizer is "
                           "loaded from the same place and saved with the result. Required.")
    dtype: str = option("float32", "Dtype the weights are loaded and trained in. float32 is the safe "
                                   "choice for AdamW; bfloat16 halves memory.", choices=tuple(DTYPES))


@dataclass
class SFTData:
    train_file: str = option("", "JSONL training file, one record per line: {\"prompt\": str, "
                                 "\"response\": str} or {\"messages\": [...]} whose last message is the "
                                 "assistant's response (docs/sft.md). Required.")
    eval_file: str | None = option(None, "JSONL file in the same format for the held-out loss; null = no "
                                         "held-out evaluation.")
    max_length: int = option(512, "Longest prompt + response + EOS, in tokens. A longer row is an error "
                                  "naming its file and line, or is dropped (see on_too_long).")
    on_too_long: str = option("error", "What to do with a row longer than max_length: 'error' stops with "
                                       "its file:line; 'skip' drops it and counts it in metrics.jsonl.",
                              choices=ON_TOO_LONG)


@dataclass
class OutputSection:
    dir: str = option("runs/sft", "Run directory: receives the Hugging Face checkpoint (safetensors + "
                                  "tokenizer), config.yaml and metrics.jsonl.")
    overwrite: bool = option(False, "Replace an existing run in `dir`. Without it, a non-empty `dir` is an "
                                    "error, so a finished run is never clobbered by accident.")


@dataclass
class SFTConfig:
    """``proximal sft`` configuration."""
    model: SFTModel = section(SFTModel, "The causal LM to fine-tune.")
    data: SFTData = section(SFTData, "Prompt/response data.")
    train: TrainSection = section(TrainSection, "Optimisation.")
    output: OutputSection = section(OutputSection, "Where the run is written.")
    seed: int = option(0, "Seed for shuffling and any randomness in the model (dropout).")

    def validate(self) -> list[str]:
        return common_errors(self)


# ----------------------------------------------------------------------------------------------
# The loss
# ----------------------------------------------------------------------------------------------


def response_nll_sum(logits: Tensor, input_ids: Tensor, response_mask: Tensor) -> tuple[Tensor, int]:
    """Σ of −log π(x_{t+1} | x_{≤t}) over response tokens (and their EOS), and how many tokens that is.

    Args:
        logits: (B, L, V) causal-LM logits; position t predicts token t+1.
        input_ids: (B, L).
        response_mask: (B, L) bool, True = a response token.

    Prompt and padding positions are excluded by ``response_mask`` (bool, (B, L), True = a response
    token). Token t is predicted by the logits at t-1, hence the shift of the mask.

    Returns:
        (scalar sum, token count). The trainer divides by the token count of the whole optimizer
        batch, so accumulating micro-batches gives exactly the full-batch token-mean loss.
    """
    mask = response_mask[:, 1:]
    logp = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], mask=mask)  # (B, L-1), 0 where masked
    return -masked_sum(logp, mask), int(mask.sum())


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def train(cfg: SFTConfig) -> Path:
    """Fine-tune ``cfg.model.path`` on ``cfg.data.train_file``; return the run directory (the checkpoint)."""
    from tqdm.auto import tqdm
    from transformers import set_seed

    from proximal.logging import MetricsLogger
    from proximal.models.loading import load_causal_lm, load_tokenizer

    # 1. Output directory, seed, tokenizer and data (data errors surface before the model loads).
    out = prepare_output_dir(cfg.output.dir, cfg.output.overwrite)
    set_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.model.path, role="model.path", padding_side="right")
    d = cfg.data
    train_set, train_report = load_sft_examples(d.train_file, tokenizer, max_length=d.max_length,
                                                on_too_long=d.on_too_long)
    eval_set, eval_report = (load_sft_examples(d.eval_file, tokenizer, max_length=d.max_length,
                                               on_too_long=d.on_too_long) if d.eval_file else ([], None))
    t = cfg.train
    total_steps, steps_per_epoch = plan_steps(len(train_set), t, d.train_file)

    # 2. Model, optimizer, run files.
    device = resolve_device(t.device)
    model = load_causal_lm(cfg.model.path, role="model.path", dtype=cfg.model.dtype).to(device)
    check_fits(model, tokenizer, d.max_length, cfg.model.path)
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # so PPO's sampling stops at EOS
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    optimizer = build_optimizer(model, t.lr, t.weight_decay)
    save_config(cfg, out / "config.yaml")
    logger = MetricsLogger(out)
    pad = tokenizer.pad_token_id

    def evaluate() -> dict:
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(eval_set), t.micro_batch_size):
                batch = to_device(collate_sft(eval_set[i:i + t.micro_batch_size], pad), device)
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                s, n = response_nll_sum(logits, batch["input_ids"], batch["response_mask"])
                total, count = total + float(s), count + n
        model.train()
        return {"eval/loss": total / count, "eval/tokens": count}

    # 3. Step 0: data counts and the held-out loss before any update.
    first = {**data_metrics("train", train_report), **data_metrics("eval", eval_report),
             "train/total_steps": total_steps}
    if eval_set:
        first.update(evaluate())
    logger.log(0, first)

    # 4. The loop: each optimizer step accumulates batch_size / micro_batch_size micro-batches.
    model.train()
    batches = index_batches(len(train_set), t.batch_size, cfg.seed)
    bar = tqdm(range(1, total_steps + 1), desc="sft", unit="step", disable=None, dynamic_ncols=True)
    for step in bar:
        rows = [train_set[i] for i in next(batches)]
        micro = [to_device(collate_sft(rows[i:i + t.micro_batch_size], pad), device)
                 for i in range(0, len(rows), t.micro_batch_size)]
        n_tokens = sum(int(b["response_mask"][:, 1:].sum()) for b in micro)
        set_lr(optimizer, lr_at(step, t.lr, t.warmup_steps, total_steps))
        loss_sum = 0.0
        for b in micro:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            s, _ = response_nll_sum(logits, b["input_ids"], b["response_mask"])
            (s / n_tokens).backward()  # Σ over micro-batches of s / n_tokens = the batch's token mean
            loss_sum += float(s.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # 5. Log; evaluate every eval_every steps and after the last one.
        row = {"train/loss": loss_sum / n_tokens, "train/tokens": n_tokens, "train/grad_norm": float(grad_norm),
               "train/lr": optimizer.param_groups[0]["lr"], "train/epoch": step / steps_per_epoch}
        if eval_set and (step == total_steps or (t.eval_every and step % t.eval_every == 0)):
            row.update(evaluate())
        logger.log(step, row)
        bar.set_postfix({k.split("/")[1]: f"{v:.4f}" for k, v in row.items() if k in ("train/loss", "eval/loss")})
    bar.close()
    logger.close()

    # 6. Save the checkpoint (safetensors + tokenizer) next to config.yaml and metrics.jsonl.
    finalize_run(out, model, tokenizer)
    return out


def cli(argv: list[str]) -> int:
    from proximal.cli import config_command

    def run(cfg: SFTConfig) -> int:
        return run_and_report("sft", train, cfg, ("eval/loss", "held-out loss"))

    return config_command(argv, prog="sft", description="Supervised fine-tuning of a causal LM on "
                          "prompt/response pairs (loss on response tokens only).", config_cls=SFTConfig,
                          run=run, resumable=False)
