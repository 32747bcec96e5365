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

The file reads top to bottom: :func:`train` (the data, the model, the step's metrics and held-out
metrics), its per-micro-batch step. The config is :mod:`proximal.trainers.reward_config`; the loss
is :func:`proximal.core.bradley_terry_loss`; the loop, optimiser, schedule, batching and checkpoints
are the shared layer's (:func:`proximal.train.fixed.fit`), as in ``proximal sft``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from proximal.config import check_valid
from proximal.core import bradley_terry_loss
from proximal.data.chat import set_chat_template
from proximal.data.packing import collate_packed_pairs
from proximal.data.preferences import collate_pairs, load_preference_pairs
from proximal.logging import read_metrics
from proximal.models.heads import check_packing, packed_scores
from proximal.models.loading import check_fits, load_tokenizer
from proximal.models.parallel import load_dtype, prepare_trained
from proximal.models.reward import load_reward_model, pair_scores
from proximal.train.batches import evaluate
from proximal.train.command import config_command
from proximal.train.fixed import fit, load_data
from proximal.train.optim import optimizer_and_scheduler
from proximal.train.run import open_run
from proximal.trainers.reward_config import RMConfig

__all__ = ["RMConfig", "train", "pair_step", "cli"]


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
        cpu_matmul=t.cpu_matmul,
        compile=t.compile,
        verbose=cfg.output.verbose,
    )
    tokenizer = load_tokenizer(cfg.model.path, role="model.path", padding_side="right")
    set_chat_template(tokenizer, cfg.model.chat_template)
    data = load_data(
        lambda path, split: load_preference_pairs(path, tokenizer, **d.load_kwargs(), split=split),
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

    # 2. The model (a fresh zero head on a causal LM, or an existing classifier; with LoRA, adapters on
    # the backbone and the head trained in full), its optimiser and schedule.
    model, new_head = load_reward_model(
        cfg.model.path, load_dtype(t.precision, trained=True), tokenizer, lora=cfg.model.lora()
    )
    check_fits(model, tokenizer, d.max_length, cfg.model.path)
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

    # 3. The loss of a step is the mean Bradley–Terry loss over the pairs of the global batch.
    def micro_step(idx: list[int], normalizer: float) -> dict:
        pairs = [data.train[i] for i in idx]
        return pair_step(model, pairs, pad, run.device, normalizer, packed=t.packing)

    def metrics(s: dict, n: int, _seconds: float) -> dict:
        return {
            "train/loss": s["loss_sum"] / n,
            "train/accuracy": s["correct"] / n,
            "train/reward_gap": s["gap_sum"] / n,
        }

    def held_out() -> dict:
        model.eval()
        s = evaluate(
            len(data.eval),
            t.micro_batch_size,
            lambda idx: pair_step(
                model, [data.eval[i] for i in idx], pad, run.device, packed=t.packing
            ),
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

    # 4. The loop (step 0's held-out metrics, then accumulate → clip and step → log, evaluate, save),
    # and the one-label classifier (safetensors + tokenizer; with LoRA merged, or the adapters and the
    # head when output.merge_lora is false) next to config.yaml and metrics.jsonl.
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
        lengths=lambda i: [len(data.train[i].chosen_ids), len(data.train[i].rejected_ids)],
        metrics=metrics,
        held_out=held_out,
        postfix={"loss": ("train/loss",), "acc": ("eval/accuracy", "train/accuracy")},
        first={"model/new_head": int(new_head)},
    )


def pair_step(
    model, pairs, pad_id: int, device, normalizer: float | None = None, *, packed: bool = False
) -> dict[str, torch.Tensor]:
    """One micro-batch of pairs: the Bradley–Terry loss, back-propagated as this micro-batch's share of
    the batch's mean when ``normalizer`` (the batch's pairs ÷ the ranks) is given. Returns sums for
    logging. ``packed``: both sides of every pair go through the model as one packed row
    (:func:`proximal.data.packing.collate_packed_pairs`), each scored at its own last token."""
    if packed:
        batch = {k: v.to(device) for k, v in collate_packed_pairs(pairs, pad_id).items()}
        scores = packed_scores(model, batch["input_ids"], batch["position_ids"], batch["last"])
        r_w, r_l = scores.float().split(len(pairs))
    else:
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
