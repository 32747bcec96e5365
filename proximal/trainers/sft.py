"""Supervised fine-tuning: the SFT model that the RLHF methods start from and stay near.

``proximal sft --config sft.yaml [--section.key value ...]`` trains a causal LM on prompt/response
pairs with the next-token loss on the **response tokens only** (the prompt is given, not learned),
logs the held-out loss, and writes a Hugging Face checkpoint into ``output.dir``;
``proximal sft --resume RUN_DIR`` continues an interrupted run exactly.

The file reads top to bottom: :func:`train` (the data, the model, the step's normaliser, metrics
and held-out loss), its per-micro-batch step. The config is :mod:`proximal.trainers.sft_config`; the
loss is :func:`proximal.core.sft_loss`'s mean NLL, from log-probabilities computed from the hidden
states on the default fused path (docs/logprobs.md); the loop and the run's life (checkpoints, resume, logs,
several processes) are the shared layer's (:func:`proximal.train.fixed.fit`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from proximal.config import check_valid
from proximal.core import nll_from_logprobs
from proximal.data.chat import set_chat_template
from proximal.data.packing import collate_packed_sft
from proximal.data.sft import collate_sft, load_sft_examples
from proximal.logging import read_metrics
from proximal.models.heads import check_packing
from proximal.models.loading import check_fits, load_causal_lm, load_tokenizer
from proximal.models.output import token_logprobs
from proximal.models.parallel import load_dtype, prepare_trained
from proximal.models.policy import with_lora
from proximal.train.batches import evaluate
from proximal.train.command import config_command
from proximal.train.fixed import fit, load_data
from proximal.train.optim import optimizer_and_scheduler
from proximal.train.run import open_run
from proximal.trainers.sft_config import SFTConfig

__all__ = ["SFTConfig", "train", "nll_step", "cli"]


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
        cpu_matmul=t.cpu_matmul,
        compile=t.compile,
        verbose=cfg.output.verbose,
    )
    tokenizer = load_tokenizer(cfg.model.path, role="model.path", padding_side="right")
    set_chat_template(tokenizer, cfg.model.chat_template)
    data = load_data(
        lambda path, split: load_sft_examples(
            path, tokenizer, **d.load_kwargs(), split=split, loss_on=d.loss_on
        ),
        d.train_file,
        d.eval_file,
        split=d.split,
        eval_split=d.eval_split,
        steps=t.steps,
        epochs=t.epochs,
        batch_size=t.batch_size,
        warmup_steps=cfg.optim.warmup_steps,
        run=run,
    )

    # 2. The model (all weights trained, or LoRA adapters), prepared for training (sharded, in its
    # precision) on this process's device, and its optimiser and schedule.
    # With LoRA only the adapters train; the export merges them unless output.merge_lora is false.
    model = load_causal_lm(
        cfg.model.path, role="model.path", dtype=load_dtype(t.precision, trained=True)
    )
    check_fits(model, tokenizer, d.max_length, cfg.model.path)
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # sampling from it stops at EOS
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model = with_lora(model, "CAUSAL_LM", cfg.model.lora())
    prepare_trained(
        model,
        device=run.device,
        precision=t.precision,
        world_size=run.world_size,
        activation_checkpointing=t.activation_checkpointing,
        merge_lora=cfg.output.merge_lora,
    )
    model.train()
    optimizer, scheduler = optimizer_and_scheduler(model, cfg.optim, total_steps=data.total)
    pad = tokenizer.pad_token_id
    if t.packing:  # after the optimiser: the check is a forward pass
        check_packing(model)

    # 3. The loss of a step is the mean NLL over the response tokens of the whole global batch.
    def tokens(batch: list[int]) -> int:
        return sum(data.train[i].n_targets for i in batch)

    def micro_step(idx: list[int], normalizer: float) -> dict:
        rows = [data.train[i] for i in idx]
        return nll_step(model, rows, pad, run.device, normalizer, packed=t.packing, path=t.logprobs)

    def metrics(s: dict, n_tokens: int, _seconds: float) -> dict:
        return {"train/loss": s["loss_sum"] / n_tokens, "train/tokens": n_tokens}

    def held_out() -> dict:
        model.eval()
        s = evaluate(
            len(data.eval),
            t.micro_batch_size,
            lambda idx: nll_step(
                model,
                [data.eval[i] for i in idx],
                pad,
                run.device,
                packed=t.packing,
                path=t.logprobs,
            ),
            run.device,
        )
        model.train()
        return {"eval/loss": s["loss_sum"] / s["tokens"], "eval/tokens": int(s["tokens"])}

    # 4. The loop (step 0's held-out loss, then accumulate → clip and step → log, evaluate, save),
    # and the fine-tuned model (safetensors + tokenizer; with LoRA merged, or the adapters when
    # output.merge_lora is false) next to config.yaml and metrics.jsonl.
    return fit(
        run,
        cfg,
        data,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        name="model",
        tokenizer=tokenizer,
        max_grad_norm=cfg.optim.max_grad_norm,
        train=t,
        output=cfg.output,
        micro_step=micro_step,
        units=tokens,
        lengths=lambda i: [len(data.train[i].input_ids)],
        scored=lambda i: data.train[i].n_targets,
        metrics=metrics,
        held_out=held_out,
        postfix={"loss": ("eval/loss", "train/loss")},
    )


def nll_step(
    model,
    rows,
    pad_id: int,
    device,
    normalizer: float | None = None,
    *,
    packed: bool = False,
    path: str = "fused",
) -> dict[str, torch.Tensor]:
    """One micro-batch's response-token NLL. With ``normalizer`` (the whole batch's token count ÷ the
    ranks) its share of the batch loss is back-propagated; without (evaluation) nothing is. Returns
    the NLL sum and the token count, for logging. ``packed``: the rows go through the model as one
    packed row (:func:`proximal.data.packing.collate_packed_sft`), the same tokens and loss.
    ``path``: ``train.logprobs`` (:func:`proximal.models.output.token_logprobs`)."""
    collate = collate_packed_sft if packed else collate_sft
    b = {k: v.to(device) for k, v in collate(rows, pad_id).items()}
    mask = b["response_mask"][:, 1:]
    norm = normalizer if normalizer is not None else float(mask.sum())
    logprobs = token_logprobs(
        model,
        b["input_ids"],
        b.get("attention_mask"),
        0,
        b["input_ids"].shape[1] - 1,
        b["input_ids"][:, 1:],
        mask=mask,
        position_ids=b.get("position_ids"),
        path=path,
    ).logprobs  # position i predicts token i + 1, for 1 … L−1
    # sft_loss's mean response-token NLL, from the log-probabilities (core.losses.nll_from_logprobs)
    loss = nll_from_logprobs(logprobs, mask, normalizer=norm)
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
