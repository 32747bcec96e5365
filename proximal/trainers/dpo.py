"""Offline preference optimisation on the pairs ``proximal rm`` reads: DPO and SimPO.

``proximal dpo --config dpo.yaml`` fits the policy to preference pairs (x, y_w, y_l) directly, with no
reward model and no sampling (Rafailov et al. 2023): the log-ratio of the policy to a frozen reference
π_ref — the starting policy, or with LoRA the same weights with the adapters off — is the implicit
reward, trained with the Bradley–Terry loss. ``train.precompute_ref_logprobs`` computes every pair's
log π_ref once, from the initial weights, before the first update, and then holds no reference model.
``proximal simpo --config simpo.yaml`` (Meng et al. 2024) needs no reference at all: the reward is the
policy's per-token average log-likelihood, with a target margin γ. ``--resume RUN_DIR`` continues a
run of either exactly.

The file reads top to bottom: the configs (the ``model``, ``data``, ``optim``, ``train`` and ``output``
sections of every command, plus ``dpo`` or ``simpo``), the loop in :func:`train` shared by both
methods, its per-micro-batch step. The losses are :func:`proximal.core.dpo_loss` and
:func:`proximal.core.simpo_loss` over :func:`proximal.core.sequence_logprobs`; the run's life
(checkpoints, resume, logs, several processes, precision) is the shared layer's.

Notation: B pairs per micro-batch, L the padded length of the 2B sequences (chosen rows first).
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from proximal.config import check_valid, option, section
from proximal.core import DPO_LOSS_TYPES, dpo_loss, sequence_logprobs, simpo_loss, token_kl
from proximal.core.ranges import problem
from proximal.data.preferences import ON_TOO_LONG_PAIRS, collate_pairs, load_preference_pairs
from proximal.data.sampler import Sampler
from proximal.logging import read_metrics
from proximal.models.heads import lm_logits
from proximal.models.loading import check_fits, load_tokenizer
from proximal.models.policy import build_policy, load_reference
from proximal.train.batches import accumulate, evaluate, evaluate_rows, plan_steps
from proximal.train.checkpoint import export_final
from proximal.train.command import config_command
from proximal.train.optim import at_step, clip_and_step, optimizer_and_scheduler
from proximal.train.run import check_per_rank, due, open_run
from proximal.train.sections import (
    FROZEN_SHARDING,
    BatchTrainSection,
    OptimSection,
    OutputSection,
    PolicyModelSection,
    PreferenceDataSection,
)

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclass
class PreferencePolicyModel(PolicyModelSection):
    path: str = option(
        "",
        "The policy as it starts, usually the SFT model: a local Hugging Face checkpoint directory "
        "or a hub id. It is also the starting model the held-out KL is measured against, and "
        "DPO's reference π_ref (frozen; with LoRA the same weights with the adapters off). Its "
        "tokenizer is loaded from the same place. Required.",
    )
    frozen_sharding: str = option(
        "shard",
        "With several processes, how a frozen copy of the starting model (DPO's "
        "reference; the model of eval/kl) is held: 'shard' splits it with FSDP2 "
        "like the policy (least memory; an all-gather per layer per forward), "
        "'replicate' keeps a full copy on every rank (no communication).",
        choices=FROZEN_SHARDING,
    )


@dataclass
class PairData(PreferenceDataSection):
    on_too_long: str = option(
        "error",
        "A pair where either side is longer than max_length: 'error' stops with its "
        "file:line; 'skip' drops the pair (counted in metrics.jsonl); 'truncate' keeps "
        "each side's first max_length tokens — the whole prompt and the start of the "
        "response (counted) — and a prompt that leaves no room for a response is an "
        "error naming its row.",
        choices=ON_TOO_LONG_PAIRS,
    )


@dataclass
class PreferenceTrainSection(BatchTrainSection):
    eval_kl: bool = option(
        True,
        "Log eval/kl, the exact KL of the policy to the starting model on the held-out "
        "responses. Where no reference is resident (SimPO, or DPO with "
        "train.precompute_ref_logprobs and no LoRA) the starting model is loaded for each "
        "evaluation and released after it; false never loads it.",
    )


@dataclass
class DPOTrainSection(PreferenceTrainSection):
    precompute_ref_logprobs: bool = option(
        False,
        "Compute log π_ref of every pair once, from the initial policy, "
        "before the first update, and hold no reference model while "
        "training (a full fine-tune saves one model's weights; with LoRA "
        "it saves a forward pass per step).",
    )


@dataclass
class DPOSection:
    beta: float = option(
        0.1,
        "β: how far the policy may move from the reference (the implicit KL constraint's "
        "weight). 0.1 is the usual value; 0.01–0.5 is the sensible range.",
    )
    loss_type: str = option(
        "sigmoid",
        "sigmoid: DPO's −log σ(h) (Rafailov et al. 2023); robust: the label-noise "
        "unbiased loss (Chowdhury et al. 2024); ipo: (h − 1/(2β))² on per-token mean "
        "log-ratios (Azar et al. 2023).",
        choices=DPO_LOSS_TYPES,
    )
    label_smoothing: float = option(
        0.0,
        "ε ∈ [0, 0.5): the assumed share of flipped labels. sigmoid: conservative "
        "DPO; robust: the unbiased estimator; must be 0 for ipo.",
    )

    def problems(self, name: str = "dpo") -> list[str]:
        e = [
            m
            for m in (
                problem("dpo_beta", self.beta, f"{name}.beta"),
                problem("label_smoothing", self.label_smoothing, f"{name}.label_smoothing"),
            )
            if m
        ]
        if self.loss_type == "ipo" and self.label_smoothing != 0:
            e.append(
                f"{name}.label_smoothing = {self.label_smoothing}: the ipo loss has no label-noise variant; use 0"
            )
        return e


@dataclass
class SimPOSection:
    beta: float = option(
        2.0,
        "β: the scale of the length-normalised reward β·avg log π(y|x). The paper uses 2–10 "
        "(2.0–2.5 for base models, up to 10 for instruct ones).",
    )
    gamma_beta_ratio: float = option(
        0.5,
        "γ/β: the target reward margin γ as a multiple of β (γ = ratio·β), as the "
        "official code parameterises it. 0.3–0.8 works; 0 = no margin.",
    )

    def problems(self, name: str = "simpo") -> list[str]:
        return [
            m
            for m in (
                problem("simpo_beta", self.beta, f"{name}.beta"),
                problem("gamma_beta_ratio", self.gamma_beta_ratio, f"{name}.gamma_beta_ratio"),
            )
            if m
        ]


def _problems(cfg, method_section) -> list[str]:
    e = cfg.model.problems() + cfg.data.problems() + cfg.optim.problems() + cfg.train.problems()
    e += cfg.output.problems() + method_section.problems()
    if cfg.train.batch_size >= 1 and cfg.train.micro_batch_size >= 1:
        check_per_rank(
            e,
            "train.batch_size",
            cfg.train.batch_size,
            "train.micro_batch_size",
            cfg.train.micro_batch_size,
        )
    return e


@dataclass
class DPOConfig:
    """``proximal dpo`` configuration."""

    model: PreferencePolicyModel = section(
        PreferencePolicyModel, "The policy π_θ and, frozen, its reference π_ref."
    )
    data: PairData = section(PairData, "Preference pairs (the files proximal rm reads).")
    optim: OptimSection = section(OptimSection, "Optimisation.", lr=5e-7, schedule="linear")
    train: DPOTrainSection = section(
        DPOTrainSection, "Steps, batches (counting pairs), devices, checkpoints.", save_every=500
    )
    output: OutputSection = section(OutputSection, "Where the run is written.", dir="runs/dpo")
    dpo: DPOSection = section(DPOSection, "The DPO loss.")

    def validate(self) -> list[str]:
        return _problems(self, self.dpo)


@dataclass
class SimPOConfig:
    """``proximal simpo`` configuration."""

    model: PreferencePolicyModel = section(
        PreferencePolicyModel, "The policy π_θ (SimPO has no reference)."
    )
    data: PairData = section(PairData, "Preference pairs (the files proximal rm reads).")
    optim: OptimSection = section(OptimSection, "Optimisation.", lr=5e-7, schedule="linear")
    train: PreferenceTrainSection = section(
        PreferenceTrainSection,
        "Steps, batches (counting pairs), devices, checkpoints.",
        save_every=500,
    )
    output: OutputSection = section(OutputSection, "Where the run is written.", dir="runs/simpo")
    simpo: SimPOSection = section(SimPOSection, "The SimPO loss.")

    def validate(self) -> list[str]:
        return _problems(self, self.simpo)


# ----------------------------------------------------------------------------------------------
# What differs between the two methods
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Objective:
    """A method as the loop sees it: its command, whether a response is scored by its summed or its
    per-token mean log-likelihood, whether it needs log π_ref, and its loss over a slice of pairs."""

    command: str
    average: bool
    needs_reference: bool
    loss: Callable  # (policy_w, policy_l, ref_w, ref_l, normalizer) -> (loss, stats)


def objective(cfg: DPOConfig | SimPOConfig) -> Objective:
    if isinstance(cfg, SimPOConfig):
        s = cfg.simpo
        return Objective(
            "simpo",
            average=True,
            needs_reference=False,
            loss=lambda pw, pl, _rw, _rl, n: simpo_loss(
                pw, pl, s.beta, s.gamma_beta_ratio, normalizer=n
            ),
        )
    d = cfg.dpo
    return Objective(
        "dpo",
        average=d.loss_type == "ipo",
        needs_reference=True,
        loss=lambda pw, pl, rw, rl, n: dpo_loss(
            pw, pl, rw, rl, d.beta, d.loss_type, d.label_smoothing, normalizer=n
        ),
    )


#: The sums every step returns, logged as ``<split>/<name>`` means over pairs (loss_sum → loss, ...).
PAIR_MEANS = (
    "loss",
    "accuracy",
    "reward_chosen",
    "reward_rejected",
    "reward_margin",
    "logp_chosen",
    "logp_rejected",
)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def train(cfg: DPOConfig | SimPOConfig, resume_dir: str | Path | None = None) -> Path:
    """Train ``cfg.model.path`` on ``cfg.data.train_file`` with DPO or SimPO (by the config's type); return
    the run directory, which holds the trained policy."""
    check_valid(cfg)
    t, d, m, obj = cfg.train, cfg.data, cfg.model, objective(cfg)
    precompute = obj.needs_reference and t.precompute_ref_logprobs

    # 1. The run, the tokenizer and the data (data errors surface before the model loads).
    run = open_run(
        obj.command,
        output_dir=cfg.output.dir,
        overwrite=cfg.output.overwrite,
        seed=t.seed,
        device=t.device,
        dist_timeout_s=t.dist_timeout_s,
        resume_dir=resume_dir,
    )
    tokenizer = load_tokenizer(m.path, role="model.path", padding_side="right")
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

    # 2. The policy, and DPO's reference when it is to be resident: a frozen copy, or the LoRA policy with
    # its adapters off. SimPO, and DPO with precomputed log-probabilities of a full fine-tune, hold one model.
    resident = obj.needs_reference and (not precompute or m.lora_r > 0)
    _, policy, reference = build_policy(
        m.path,
        lora=m.lora(),
        precision=t.precision,
        device=run.device,
        world_size=run.world_size,
        activation_checkpointing=t.activation_checkpointing,
        reference=resident,
        frozen_sharding=m.frozen_sharding,
    )
    check_fits(policy, tokenizer, d.max_length, m.path)
    optimizer, scheduler = optimizer_and_scheduler(policy, cfg.optim, total_steps=total)
    sampler = Sampler(
        len(train_set),
        t.batch_size,
        seed=t.seed,
        drop_last=True,
        rank=run.rank,
        world_size=run.world_size,
    )
    pad, W, dev = tokenizer.pad_token_id, run.world_size, run.device

    def ref_model():
        """The model whose log-probabilities are log π_ref: the resident reference, or — only before the
        first update, to precompute — the policy itself, which then holds the initial weights."""
        return reference.active() if reference is not None else contextlib.nullcontext(policy)

    # 3. Precomputed log π_ref of every pair (chosen, rejected), before the checkpoint's weights load.
    ref_table = {}
    if precompute:
        with ref_model() as r:
            for split, pairs in (("train", train_set), ("eval", eval_set)):
                if pairs:
                    ref_table[split] = evaluate_rows(
                        len(pairs),
                        t.micro_batch_size,
                        lambda idx: reference_logprobs(
                            r, [pairs[i] for i in idx], pad, dev, average=obj.average
                        ),
                        2,
                        dev,
                    )
    trained, stateful = (
        {"policy": (policy, optimizer)},
        {"scheduler": scheduler, "sampler": sampler},
    )
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
    run.record_models(policy=policy, reference=reference.model if reference is not None else None)

    def step_fn(pairs, idx, split: str, *, normalizer=None, kl_model=None):
        table = ref_table.get(split)
        return pair_step(
            policy,
            [pairs[i] for i in idx],
            pad,
            dev,
            objective=obj,
            normalizer=normalizer,
            ref_logps=table[idx] if table is not None else None,
            reference=None if table is not None else reference,
            kl_reference=kl_model,
        )

    def held_out() -> dict:
        with starting_model(
            reference,
            m.path,
            enabled=t.eval_kl,
            precision=t.precision,
            device=dev,
            world_size=W,
            frozen_sharding=m.frozen_sharding,
        ) as start_model:
            s = evaluate(
                len(eval_set),
                t.micro_batch_size,
                lambda idx: step_fn(eval_set, idx, "eval", kl_model=start_model),
                dev,
            )
        row = {f"eval/{k}": s[f"{k}_sum"] / s["pairs"] for k in PAIR_MEANS}
        if "kl_sum" in s:
            row.update(
                {
                    "eval/kl": s["kl_sum"] / s["responses"],
                    "eval/kl_per_token": s["kl_sum"] / s["kl_tokens"],
                }
            )
        return row

    # 4. Step 0: data counts and the held-out metrics before any update.
    if start == 0:
        first = {
            **train_report.metrics("train"),
            "data/train_truncated": train_report.truncated,
            "train/total_steps": total,
            "model/reference_resident": int(resident),
        }
        if eval_report:
            first.update(
                {**eval_report.metrics("eval"), "data/eval_truncated": eval_report.truncated}
            )
        run.log(0, {**first, **(held_out() if eval_set else {})})

    # 5. The loop: each optimiser step accumulates this rank's micro-batches of the global batch of pairs;
    # every loss is normalised by the global batch's pairs ÷ the ranks, so the gradient is the batch mean's.
    for step in range(start + 1, total + 1):
        t0 = time.perf_counter()
        batch = sampler.next_global_batch()
        s = accumulate(
            sampler.local_part(batch),
            t.micro_batch_size,
            lambda idx: step_fn(train_set, idx, "train", normalizer=len(batch) / W),
            dev,
        )
        if not math.isfinite(s["loss_sum"]):
            optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"step {step}: the {obj.command.upper()} loss is {s['loss_sum'] / len(batch)}; "
                "the step was not applied (lower optim.lr, or check the data)"
            )
        lr = scheduler.get_last_lr()[0]  # the rate this step runs at
        with at_step(step):
            grad_norm = clip_and_step(
                policy, optimizer, scheduler, cfg.optim.max_grad_norm, what="policy"
            )
        step_s = time.perf_counter() - t0

        # 6. Log; evaluate every eval_every steps and after the last one; checkpoint.
        row = {
            **{f"train/{k}": s[f"{k}_sum"] / len(batch) for k in PAIR_MEANS},
            "train/grad_norm": grad_norm,
            "train/lr": lr,
            "train/epoch": step / sampler.steps_per_epoch,
            "speed/tokens_per_s": s["tokens"] / max(step_s, 1e-9),
            "time/step_s": step_s,
            "time/wall_s": run.wall_s(),
        }
        if eval_set and due(step, total, t.eval_every):
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
                exports={"policy": (policy, tokenizer)},
                keep=t.keep_checkpoints,
            )

    # 7. The trained policy (safetensors + tokenizer; with LoRA its adapters) next to config.yaml and metrics.
    export_final(run.dir, policy, tokenizer)
    run.finish()
    return run.dir


def response_logits(model, batch: dict) -> torch.Tensor:
    """Logits predicting tokens 1..L−1 of a right-padded batch, (2B, L−1, V): ``[:, t]`` scores
    ``input_ids[:, t + 1]``."""
    ids = batch["input_ids"]
    return lm_logits(model, ids, batch["attention_mask"], 0, ids.shape[1] - 1)


@torch.no_grad()
def reference_logprobs(model, pairs, pad_id: int, device, *, average: bool) -> torch.Tensor:
    """(B, 2): log π(y_w | x) and log π(y_l | x) of each pair under ``model``, summed or averaged."""
    b = {k: v.to(device) for k, v in collate_pairs(pairs, pad_id).items()}
    logps = sequence_logprobs(
        response_logits(model, b), b["input_ids"][:, 1:], b["response_mask"][:, 1:], average
    )
    return logps.view(2, len(pairs)).T


def pair_step(
    policy,
    pairs,
    pad_id: int,
    device,
    *,
    objective: Objective,
    normalizer: float | None = None,
    ref_logps: torch.Tensor | None = None,
    reference=None,
    kl_reference=None,
) -> dict[str, torch.Tensor]:
    """One micro-batch of pairs, chosen and rejected sides in one forward pass of the policy.

    log π_ref comes from ``ref_logps`` (B, 2) when precomputed, else from a no-grad forward of
    ``reference`` (a :class:`~proximal.models.policy.Reference`) when the objective needs it. With
    ``normalizer`` (the global batch's pairs ÷ the ranks) this micro-batch's share of the batch loss is
    back-propagated; without (evaluation) nothing is. ``kl_reference`` (a ``Reference`` to the starting
    policy, evaluation only) adds the exact KL(π_θ ‖ π_start) over each response's tokens. Every
    reference is entered only after the policy's forward pass: with LoRA it is the policy itself with its
    adapters off. Returns sums for logging.
    """
    b = {k: v.to(device) for k, v in collate_pairs(pairs, pad_id).items()}
    labels, mask, B = b["input_ids"][:, 1:], b["response_mask"][:, 1:], len(pairs)
    logits = response_logits(policy, b)
    logps = sequence_logprobs(
        logits, labels, mask, objective.average
    )  # (2B,): chosen rows, then rejected
    ref = None
    if ref_logps is not None:
        ref = ref_logps.to(device=device, dtype=logps.dtype).T.reshape(
            -1
        )  # (2B,) in the same order
    elif objective.needs_reference:
        with torch.no_grad(), reference.active() as r:
            ref = sequence_logprobs(response_logits(r, b), labels, mask, objective.average).to(
                logps.dtype
            )
    norm = normalizer if normalizer is not None else float(B)
    loss, stats = objective.loss(
        logps[:B], logps[B:], *((ref[:B], ref[B:]) if ref is not None else (None, None)), norm
    )
    if normalizer is not None:
        loss.backward()
    out = {
        "loss_sum": loss.detach() * norm,
        **{f"{k}_sum": v * B for k, v in stats.items()},
        "pairs": torch.tensor(B),
        "tokens": b["attention_mask"].sum(),
    }
    if kl_reference is not None:
        with torch.no_grad(), kl_reference.active() as r:
            kl = token_kl(logits.detach(), response_logits(r, b), mask=mask)  # (2B, L−1)
        out.update({"kl_sum": kl.sum(), "kl_tokens": mask.sum(), "responses": torch.tensor(2 * B)})
    return out


@contextlib.contextmanager
def starting_model(
    reference,
    path: str,
    *,
    enabled: bool,
    precision: str,
    device,
    world_size: int,
    frozen_sharding: str,
):
    """The starting policy π_start for the held-out KL as a :class:`~proximal.models.policy.Reference` (enter
    its ``active()`` after the policy's forward: with LoRA it *is* the policy, adapters off), or None when
    ``enabled`` is false: the resident reference if there is one; otherwise loaded from ``path`` for the
    duration and released after it (the gradients are freed between steps, so this does not raise the
    run's peak memory above a step's)."""
    if not enabled:
        yield None
        return
    loaded = None
    if reference is None:
        # The policy's gradients were freed by the last step; the copy lives only for this evaluation.
        loaded = load_reference(
            None,
            path,
            lora=False,
            precision=precision,
            device=device,
            world_size=world_size,
            frozen_sharding=frozen_sharding,
        )
    try:
        yield reference or loaded
    finally:
        if loaded is not None:
            loaded = None  # the last reference to the copy
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def _summary(run_dir: Path) -> str:
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/accuracy" in r]
    change = (
        (
            f"held-out preference accuracy {rows[0]['eval/accuracy']:.4f} -> {rows[-1]['eval/accuracy']:.4f}, "
            f"reward margin {rows[0]['eval/reward_margin']:.4f} -> {rows[-1]['eval/reward_margin']:.4f}; "
        )
        if rows
        else ""
    )
    return f"{change}policy saved to {run_dir}"


def dpo_cli(argv: list[str]) -> int:
    return config_command(
        argv,
        prog="dpo",
        description="Direct Preference Optimization on preference pairs: the "
        "policy against a frozen reference, no reward model.",
        config_cls=DPOConfig,
        train=train,
        summary=_summary,
    )


def simpo_cli(argv: list[str]) -> int:
    return config_command(
        argv,
        prog="simpo",
        description="SimPO on preference pairs: a length-normalised, "
        "reference-free implicit reward with a target margin.",
        config_cls=SimPOConfig,
        train=train,
        summary=_summary,
    )
