"""Offline preference optimisation on the pairs ``proximal rm`` reads: DPO and SimPO.

``proximal dpo --config dpo.yaml`` fits the policy to preference pairs (x, y_w, y_l) directly, with no
reward model and no sampling (Rafailov et al. 2023): the log-ratio of the policy to a frozen reference
π_ref — the starting policy, or with LoRA the same weights with the adapters off — is the implicit
reward, trained with the Bradley–Terry loss. ``train.precompute_ref_logprobs`` computes every pair's
log π_ref once, from the initial weights, before the first update, and then holds no reference model.
``proximal simpo --config simpo.yaml`` (Meng et al. 2024) needs no reference at all: the reward is the
policy's per-token average log-likelihood, with a target margin γ. ``--resume RUN_DIR`` continues a
run of either exactly.

The file reads top to bottom: what differs between the two methods (:class:`Objective`), :func:`train`
shared by both (the data, the models, the reference log-probabilities, the step's metrics and
held-out metrics), its per-micro-batch step. The configs are :mod:`proximal.trainers.dpo_config`;
the losses are :func:`proximal.core.dpo_loss` and :func:`proximal.core.simpo_loss` over sequence
log-probabilities (:func:`side_logprobs`, from the hidden states on the default fused path:
docs/logprobs.md); the loop and the run's life (checkpoints, resume, logs,
several processes, precision) are the shared layer's (:func:`proximal.train.fixed.fit`, as for
``proximal sft`` and ``rm``).

Notation: B pairs per micro-batch, L the padded length of the 2B sequences (chosen rows first).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from proximal.config import ConfigError, check_valid
from proximal.core import dpo_loss, masked_mean, masked_sum, simpo_loss
from proximal.data.chat import set_chat_template
from proximal.data.packing import collate_packed_pairs, per_sequence
from proximal.data.preferences import collate_pairs, load_preference_pairs
from proximal.evaluation import training_eval
from proximal.logging import read_metrics
from proximal.models.heads import check_packing
from proximal.models.loading import check_fits, load_tokenizer
from proximal.models.output import TokenScores, token_kl, token_logprobs
from proximal.models.policy import build_policy, load_reference
from proximal.rollout.engine import build_engine
from proximal.rollout.scoring import build_scorer
from proximal.rollout.vllm import preflight_problems
from proximal.train.batches import evaluate, evaluate_rows
from proximal.train.command import config_command
from proximal.train.fixed import fit, load_data
from proximal.train.optim import optimizer_and_scheduler
from proximal.train.run import open_run
from proximal.trainers.dpo_config import DPOConfig, SimPOConfig

__all__ = ["DPOConfig", "SimPOConfig", "train", "pair_step", "dpo_cli", "simpo_cli"]


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
        cpu_matmul=t.cpu_matmul,
        compile=t.compile,
        verbose=cfg.output.verbose,
    )
    tokenizer = load_tokenizer(m.path, role="model.path", padding_side="right")
    set_chat_template(tokenizer, m.chat_template)
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

    # 2. The policy, and DPO's reference when it is to be resident: a frozen copy, or the LoRA policy with
    # its adapters off. SimPO, and DPO with precomputed log-probabilities of a full fine-tune, hold one model.
    resident = obj.needs_reference and (not precompute or m.lora_r > 0)
    if cfg.eval.engine == "vllm" and cfg.eval.prompts is not None:  # before any model loads
        if isinstance(m.path, str) and (
            problems := preflight_problems(m.path, device=run.device.type, field="eval.engine")
        ):
            raise ConfigError(problems[0])
    _, policy, reference = build_policy(
        m.path,
        lora=m.lora(),
        precision=t.precision,
        device=run.device,
        world_size=run.world_size,
        activation_checkpointing=t.activation_checkpointing,
        reference=resident,
        frozen_sharding=m.frozen_sharding,
        merge_lora=cfg.output.merge_lora,
    )
    check_fits(policy, tokenizer, d.max_length, m.path)
    # Before the policy's first forward pass (the precomputation below): under FSDP2 the root module does
    # not reshard after a forward, and an optimiser built then would hold its gathered parameters.
    optimizer, scheduler = optimizer_and_scheduler(policy, cfg.optim, total_steps=data.total)
    pad, W, dev = tokenizer.pad_token_id, run.world_size, run.device
    if t.packing:  # after the optimiser: the check is a forward pass
        check_packing(policy)

    def ref_model():
        """The model whose log-probabilities are log π_ref: the resident reference, or — only before the
        first update, to precompute — the policy itself, which then holds the initial weights."""
        return reference.active() if reference is not None else contextlib.nullcontext(policy)

    # 3. Precomputed log π_ref of every pair (chosen, rejected), before the checkpoint's weights load
    # (fit restores them).
    ref_table = {}
    if precompute:
        with ref_model() as r:
            for split, pairs in (("train", data.train), ("eval", data.eval)):
                if pairs:
                    ref_table[split] = evaluate_rows(
                        len(pairs),
                        t.micro_batch_size,
                        lambda idx: reference_logprobs(
                            r,
                            [pairs[i] for i in idx],
                            pad,
                            dev,
                            average=obj.average,
                            packed=t.packing,
                            path=t.logprobs,
                        ),
                        2,
                        dev,
                    )

    # 4. The loss of a step is the mean over the pairs of the global batch; log π_ref from the table
    # when precomputed, else from the resident reference.
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
            packed=t.packing,
            path=t.logprobs,
        )

    def metrics(s: dict, n: int, seconds: float) -> dict:
        return {
            **{f"train/{k}": s[f"{k}_sum"] / n for k in PAIR_MEANS},
            "speed/tokens_per_s": s["tokens"] / max(seconds, 1e-9),
            "time/step_s": seconds,
        }

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
                len(data.eval),
                t.micro_batch_size,
                lambda idx: step_fn(data.eval, idx, "eval", kl_model=start_model),
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

    # The sampled held-out evaluation (eval.prompts): responses from the policy scored by eval.scores
    # and eval.reward_model, with the exact KL to the starting model (resident, or loaded for it).
    evaluation = training_eval(
        cfg.eval,
        tokenizer,
        max_new_tokens=64,
        seed=t.seed,
        max_prompt_length=d.max_length,
    )
    scorer = None
    if evaluation is not None and cfg.eval.reward_model is not None:
        scorer = build_scorer(
            tokenizer,
            reward_model=cfg.eval.reward_model,
            reward_model_weight=1.0,
            functions={},
            function_weights={},
            precision=t.precision,
            device=dev,
            world_size=W,
            frozen_sharding=m.frozen_sharding,
            micro_batch_size=t.micro_batch_size,
        )

    # eval.engine vllm: one engine for the evaluations alone, given the policy's weights before each.
    eval_engine = None
    if evaluation is not None and cfg.eval.engine == "vllm":
        eval_engine = build_engine(
            "vllm",
            policy,
            tokenizer.pad_token_id,
            kv_cache_bytes=int(cfg.eval.kv_cache_gib * 2**30),
            max_model_len=d.max_length + (cfg.eval.max_new_tokens or 64),
            seed=t.seed + run.rank,
            kv_field="eval.kv_cache_gib",
        )

    def sampled(step: int) -> dict:
        if evaluation is None or not evaluation.due(step, data.total):
            return {}
        if eval_engine is not None:
            eval_engine.after_update()
        with starting_model(
            reference,
            m.path,
            enabled=True,
            precision=t.precision,
            device=dev,
            world_size=W,
            frozen_sharding=m.frozen_sharding,
        ) as start_model:
            return evaluation(
                policy,
                reference=start_model,
                tokenizer=tokenizer,
                reward_model=scorer.reward_model if scorer is not None else None,
                reward_tokenizer=scorer.reward_tokenizer if scorer is not None else None,
                engine=eval_engine,
                step=step,
            )

    # 5. The loop (step 0's held-out metrics, then accumulate → clip and step → log, evaluate, save),
    # and the trained policy (safetensors + tokenizer; with LoRA merged, or its adapters when
    # output.merge_lora is false) next to config.yaml.
    first = {
        "data/train_truncated": data.train_report.truncated,
        "model/reference_resident": int(resident),
        **({"data/eval_truncated": data.eval_report.truncated} if data.eval_report else {}),
    }
    try:
        return fit(
            run,
            cfg,
            data,
            model=policy,
            optimizer=optimizer,
            scheduler=scheduler,
            name="policy",
            tokenizer=tokenizer,
            max_grad_norm=cfg.optim.max_grad_norm,
            train=t,
            output=cfg.output,
            micro_step=lambda idx, norm: step_fn(data.train, idx, "train", normalizer=norm),
            lengths=lambda i: [len(data.train[i].chosen_ids), len(data.train[i].rejected_ids)],
            metrics=metrics,
            held_out=held_out,
            postfix={"loss": ("train/loss",), "acc": ("eval/accuracy", "train/accuracy")},
            first=first,
            models={
                "policy": policy,
                "reference": reference.model if reference is not None else None,
            },
            forward_only=("reference",) if reference is not None and not precompute else (),
            scored=lambda i: response_tokens(data.train[i]),
            sampled=sampled,
        )
    finally:
        if eval_engine is not None:
            eval_engine.close()


def token_scores(model, batch: dict, *, keep: bool = False, path: str = "fused") -> TokenScores:
    """log π of tokens 1..L−1 of a right-padded batch, (2B, L−1), or of packed rows (R, L−1):
    ``[:, t]`` is that of ``input_ids[:, t + 1]``, 0 outside the responses; ``keep``: with what the
    held-out KL needs (:func:`proximal.models.output.token_logprobs`; ``path``: ``train.logprobs``)."""
    ids = batch["input_ids"]
    return token_logprobs(
        model,
        ids,
        batch.get("attention_mask"),
        0,
        ids.shape[1] - 1,
        ids[:, 1:],
        mask=batch["response_mask"][:, 1:],
        position_ids=batch.get("position_ids"),
        keep=keep,
        path=path,
    )


def response_tokens(pair) -> int:
    """The tokens of both responses of a pair, each with its EOS: the positions a step scores."""
    return len(pair.chosen_ids) + len(pair.rejected_ids) - 2 * pair.prompt_len


def collate(pairs, pad_id: int, device, packed: bool) -> dict[str, torch.Tensor]:
    """The pairs' batch on ``device``: padded (:func:`proximal.data.preferences.collate_pairs`) or
    packed into one row (:func:`proximal.data.packing.collate_packed_pairs`)."""
    b = (collate_packed_pairs if packed else collate_pairs)(pairs, pad_id)
    return {k: v.to(device) for k, v in b.items()}


def side_logprobs(logprobs: torch.Tensor, b: dict, average: bool) -> torch.Tensor:
    """(2B,) log π(y | x) of every side, chosen first, from the per-token ``logprobs`` of
    :func:`token_scores`, summed or averaged over its response tokens (DPO's sum, SimPO's mean:
    :func:`proximal.core.sequence_logprobs`): per row of a padded batch, per sequence of a packed
    one (summed by segment)."""
    mask = b["response_mask"][:, 1:]
    if "segment_ids" not in b:
        return masked_mean(logprobs, mask, dim=1) if average else masked_sum(logprobs, mask, dim=1)
    seg, n = b["segment_ids"][:, 1:], b["last"].numel()  # the segment of the predicted token
    total = per_sequence(logprobs, seg, n)
    return total / per_sequence(mask.to(total.dtype), seg, n) if average else total


@torch.no_grad()
def reference_logprobs(
    model,
    pairs,
    pad_id: int,
    device,
    *,
    average: bool,
    packed: bool = False,
    path: str = "fused",
) -> torch.Tensor:
    """(B, 2): log π(y_w | x) and log π(y_l | x) of each pair under ``model``, summed or averaged."""
    b = collate(pairs, pad_id, device, packed)
    logps = side_logprobs(token_scores(model, b, path=path).logprobs, b, average)
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
    packed: bool = False,
    path: str = "fused",
) -> dict[str, torch.Tensor]:
    """One micro-batch of pairs, chosen and rejected sides in one forward pass of the policy.

    log π_ref comes from ``ref_logps`` (B, 2) when precomputed, else from a no-grad forward of
    ``reference`` (a :class:`~proximal.models.policy.Reference`) when the objective needs it. With
    ``normalizer`` (the global batch's pairs ÷ the ranks) this micro-batch's share of the batch loss is
    back-propagated; without (evaluation) nothing is. ``kl_reference`` (a ``Reference`` to the starting
    policy, evaluation only) adds the exact KL(π_θ ‖ π_start) over each response's tokens. Every
    reference is entered only after the policy's forward pass: with LoRA it is the policy itself with its
    adapters off. ``packed``: every side goes through the model in one packed row, its log-likelihood
    summed over its own tokens (:func:`side_logprobs`). ``path``: ``train.logprobs``, for every
    log-probability and the KL (:func:`proximal.models.output.token_logprobs`). Returns sums for
    logging.
    """
    b = collate(pairs, pad_id, device, packed)
    mask, B = b["response_mask"][:, 1:], len(pairs)
    scores = token_scores(policy, b, keep=kl_reference is not None, path=path)
    logps = side_logprobs(scores.logprobs, b, objective.average)  # (2B,): chosen, then rejected
    ref = None
    if ref_logps is not None:
        ref = ref_logps.to(device=device, dtype=logps.dtype).T.reshape(-1)  # (2B,), same order
    elif objective.needs_reference:
        with torch.no_grad(), reference.active() as r:
            ref_lp = token_scores(r, b, path=path).logprobs
            ref = side_logprobs(ref_lp, b, objective.average).to(logps.dtype)
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
        "tokens": b["attention_mask"].sum() if not packed else (b["segment_ids"] >= 0).sum(),
    }
    if kl_reference is not None:
        with torch.no_grad(), kl_reference.active() as r:
            ids = b["input_ids"]
            kl = token_kl(  # (2B, L−1), π_θ's side kept from its pass above
                scores.kept,
                r,
                ids,
                b.get("attention_mask"),
                0,
                ids.shape[1] - 1,
                mask=mask,
                position_ids=b.get("position_ids"),
                path=path,
            )
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
