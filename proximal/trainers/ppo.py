"""PPO-based RLHF with the four models of the seed (§1–§6): actor, reference, reward model, critic.

One step reads top to bottom in :func:`train`.

Each step: (1) sample prompts, (2) roll out responses from π_θ, (3) score them with r_ψ and the reward
functions, (4) record log π_old, log π_ref and V_old, (5) shape per-token rewards with β·KL, run GAE and
whiten the advantages, (6) run ``ppo.epochs`` passes of clipped-surrogate / clipped-value updates over
shuffled mini-batches, (7) update β, (8) log and checkpoint. All math is in :mod:`proximal.core`;
set-up, checkpoints and logging live in helpers below the loop so the loop stays readable.

Tensor notation: B rollout batch, P padded prompt length, T padded response length, V vocabulary.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from proximal import distributed as dist
from proximal.checkpoint import atomic_dir, atomic_write_text
from proximal.config import ConfigError, save_config
from proximal.core import (AdaptiveKLController, FixedKLController, ProportionalKLController, entropy_from_logits,
                           explained_variance, gae, logprobs_from_logits, ppo_policy_loss, ptx_loss, shape_rewards,
                           value_loss, whiten)
from proximal.data.jsonl import DataError
from proximal.data.prompts import PromptSampler, load_prompts, load_texts
from proximal.logging import MetricsLogger, truncate_jsonl
from proximal.models.heads import token_values
from proximal.models.loading import ModelLoadError, freeze, load_sequence_scorer, load_tokenizer
from proximal.models.policy import Reference, build_actor, build_critic, trainable_parameters
from proximal.rollout.sampling import Rollout, pad_left, pad_right, response_logits, sample
from proximal.rollout.scoring import RewardFunctionError, Scorer, load_reward_function, same_tokenizer
from proximal.trainers.common import resolve_device
from proximal.trainers.ppo_config import PPOConfig

__all__ = ["PPOConfig", "train", "cli"]


def train(cfg: PPOConfig, resume_dir: str | Path | None = None) -> Path:
    """Run PPO as configured; return the run directory. ``resume_dir`` continues a saved run exactly."""
    problems = cfg.validate()
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    run_dir = Path(resume_dir or cfg.output.dir)
    device = resolve_device(cfg.train.device)
    ckpt = _latest_checkpoint(run_dir) if resume_dir else None
    if resume_dir and ckpt is None:
        raise FileNotFoundError(f"--resume {run_dir}: no checkpoint under {run_dir / 'checkpoints'}")
    earlier_run = [] if resume_dir else _earlier_run(run_dir, cfg.output.overwrite)
    functions = {spec: load_reward_function(spec) for spec in cfg.model.reward_functions}  # fail before loading models
    _seed_everything(cfg.train.seed)

    m = _build_models(cfg, device, ckpt, functions)
    prompts = load_prompts(cfg.data.prompts, m.tokenizer, max_length=cfg.data.max_prompt_length,
                           on_too_long=cfg.data.on_long_prompt)
    ptx_texts = load_texts(cfg.data.ptx_file) if cfg.ppo.ptx_coef > 0 else None
    sampler = PromptSampler(len(prompts), cfg.rollout.batch_size, seed=cfg.train.seed + 1000 * dist.rank(),
                            shuffle=cfg.data.shuffle)
    ptx_sampler = PromptSampler(len(ptx_texts), cfg.data.ptx_batch_size, seed=cfg.train.seed + 7) if ptx_texts else None
    opt_steps = cfg.train.steps * cfg.ppo.epochs * (cfg.rollout.batch_size // cfg.ppo.mini_batch_size)
    actor_opt, actor_sched = _optimizer(m.actor, cfg.optim.actor_lr, cfg, opt_steps)
    critic_opt, critic_sched = _optimizer(m.critic, cfg.optim.critic_lr, cfg, opt_steps)
    kl_ctl = _kl_controller(cfg)
    start, counters = 0, {"skipped_nonfinite": 0, "wall_s": 0.0}
    if ckpt is not None:
        start, counters = _load_trainer_state(ckpt, actor_opt, actor_sched, critic_opt, critic_sched, kl_ctl, sampler,
                                              ptx_sampler)
    for p in earlier_run:  # only now that everything loaded: a failed start never costs the old run
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    logger = MetricsLogger(run_dir, tensorboard=cfg.output.tensorboard, wandb_project=cfg.output.wandb_project)
    truncate_jsonl(run_dir / "metrics.jsonl", start)  # a fresh run starts empty; a resumed one drops
    truncate_jsonl(run_dir / "samples.jsonl", start)  # lines of steps after its checkpoint
    wall0 = time.perf_counter() - counters["wall_s"]
    bar = _progress(cfg, start)

    for step in range(start + 1, cfg.train.steps + 1):
        t0 = time.perf_counter()
        # 1. A batch of prompts x (seed §1: the initial state s_1 = x).
        idx = sampler.next_batch()
        prompt_ids, prompt_mask = pad_left([prompts.token_ids[i] for i in idx], m.tokenizer.pad_token_id, device)
        texts = [prompts.texts[i] for i in idx]
        messages = [prompts.messages[i] for i in idx]

        # 2. Roll out y ~ π_θ(·|x) until EOS / a stop, or T tokens; mask what follows the stop.
        rollout = sample(m.actor, m.tokenizer, prompt_ids, prompt_mask, max_new_tokens=cfg.rollout.max_new_tokens,
                         temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                         stop_token_ids=cfg.rollout.stop_token_ids, stop_strings=cfg.rollout.stop_strings)
        t_gen = time.perf_counter() - t0

        # 3. Scores r_ψ(x, y) (+ reward functions); an optional penalty for hitting T without a stop.
        scores, components = m.scorer(rollout, texts, messages)
        if cfg.rollout.missing_eos_penalty is not None:
            scores = torch.where(rollout.ended, scores, scores + cfg.rollout.missing_eos_penalty)
        finite = torch.isfinite(scores)
        if not finite.all():
            bad = (~finite).nonzero().flatten().tolist()
            if cfg.rollout.nonfinite_scores == "error":
                raise FloatingPointError(f"step {step}: non-finite scores {scores[bad].tolist()} for prompts "
                                         f"{[texts[i][:60] for i in bad]} (set rollout.nonfinite_scores: skip)")
            counters["skipped_nonfinite"] += len(bad)
            keep = finite.nonzero().flatten()
            if len(keep) == 0:
                raise FloatingPointError(f"step {step}: every score in the batch is non-finite")
            rollout, scores = rollout.select(keep), scores[keep]
            components = {k: v[keep] for k, v in components.items()}
            texts = [texts[i] for i in keep.tolist()]

        # 4. log π_old, log π_ref and V_old on the sampled tokens (no gradients).
        old_logprobs, ref_logprobs, old_values = _experience(m, rollout, cfg)

        # 5. Per-token rewards R_t = −β·KL_t (+ r_ψ at t = T), GAE(γ, λ), whitened advantages.
        mask = rollout.response_mask
        rewards, kl = shape_rewards(scores, old_logprobs, ref_logprobs, mask, kl_ctl.beta, cfg.ppo.kl_estimator)
        advantages, returns = gae(rewards, old_values, mask, cfg.ppo.gamma, cfg.ppo.lam)
        explained_var = float(explained_variance(old_values, returns, mask, all_reduce=dist.all_reduce_sum))
        if cfg.ppo.whiten_advantages:
            advantages = whiten(advantages, mask, all_reduce=dist.all_reduce_sum)

        # 6. PPO epochs: clipped surrogate for the actor, clipped value loss for the critic.
        t1 = time.perf_counter()
        batch = _Batch(rollout, old_logprobs, old_values, advantages, returns)
        update_stats, train_tokens = _ppo_epochs(m, batch, cfg, actor_opt, critic_opt, actor_sched, critic_sched,
                                                 ptx_texts, ptx_sampler)
        t_train = time.perf_counter() - t1

        # 7. The KL controller sees the batch's mean sequence KL (seed §3, d_t).
        seq_kl = dist.global_mean(kl.sum(dim=1))
        beta_used = kl_ctl.beta
        kl_ctl.update(seq_kl, n_steps=len(rollout) * dist.world_size())

        # 8. Log, sample rows, checkpoint.
        lengths = mask.sum(1).float()
        metrics = {
            "score/mean": dist.global_mean(scores),
            **{f"score/{k}": dist.global_mean(v) for k, v in components.items()},
            "reward/total_mean": dist.global_mean(rewards.sum(1)),
            "kl/seq_mean": seq_kl, "kl/beta": beta_used, "kl/beta_next": kl_ctl.beta,
            **update_stats, "value/explained_variance": explained_var,
            "response/length_mean": dist.global_mean(lengths), "response/eos_frac": dist.global_mean(rollout.ended.float()),
            "data/skipped_nonfinite": counters["skipped_nonfinite"], "data/epoch": sampler.epoch,
            "data/prompts_skipped_too_long": prompts.skipped_too_long, "data/prompts_truncated": prompts.truncated,
            "speed/gen_tokens_per_s": lengths.sum().item() / max(t_gen, 1e-9),
            "speed/train_tokens_per_s": train_tokens / max(t_train, 1e-9),
            "time/step_s": time.perf_counter() - t0, "time/wall_s": time.perf_counter() - wall0,
        }
        if dist.is_main():
            logger.log(step, metrics)
            _write_samples(run_dir, step, texts, m.scorer.completions(rollout), scores, components,
                           cfg.output.samples_per_step)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(score=f"{metrics['score/mean']:.3f}", kl=f"{seq_kl:.3f}", beta=f"{kl_ctl.beta:.3g}")
        if step == cfg.train.steps or (cfg.train.save_every and step % cfg.train.save_every == 0):
            counters["wall_s"] = time.perf_counter() - wall0
            _save_checkpoint(run_dir, step, m, cfg, actor_opt, actor_sched, critic_opt, critic_sched, kl_ctl,
                             sampler, ptx_sampler, counters)

    if bar is not None:
        bar.close()
    logger.close()
    return run_dir


# ----------------------------------------------------------------------------------------------
# The PPO update (seed §5–§6)
# ----------------------------------------------------------------------------------------------

@dataclass
class _Batch:
    rollout: Rollout
    old_logprobs: torch.Tensor   # (B, T)
    old_values: torch.Tensor     # (B, T)
    advantages: torch.Tensor     # (B, T)
    returns: torch.Tensor        # (B, T)

    def select(self, idx: torch.Tensor) -> "_Batch":
        r = self.rollout.select(idx)
        # Drop columns no row of this slice uses: left padding of the prompt, right padding of the response.
        p0 = int((r.prompt_mask.sum(0) > 0).long().argmax())
        t1 = int(r.response_mask.any(0).nonzero().max()) + 1
        r = Rollout(r.prompt_ids[:, p0:], r.prompt_mask[:, p0:], r.response_ids[:, :t1], r.response_mask[:, :t1],
                    r.ended)
        return _Batch(r, *(getattr(self, f)[idx][:, :t1] for f in ("old_logprobs", "old_values", "advantages", "returns")))


def _ppo_epochs(m, batch: _Batch, cfg: PPOConfig, actor_opt, critic_opt, actor_sched, critic_sched,
                ptx_texts, ptx_sampler) -> tuple[dict, int]:
    """``ppo.epochs`` passes over shuffled mini-batches, accumulating gradients over micro-batches.

    Per-micro-batch losses are weighted by their share of the mini-batch (tokens for token-mean,
    sequences for seq-mean-token-mean) so the accumulated gradient is that of the whole mini-batch.
    """
    p, T = cfg.ppo, cfg.rollout.temperature
    B = len(batch.rollout)
    mb = min(p.mini_batch_size, B)
    history: dict[str, list[float]] = {}
    tokens = 0
    stop = False
    for _epoch in range(p.epochs):
        order = torch.randperm(B)
        for start in range(0, B, mb):  # the last mini-batch is smaller only after skipped samples
            mini = order[start:start + mb]
            mini_mask = batch.rollout.response_mask[mini]
            weight_total = mini_mask.sum() if p.aggregation == "token-mean" else mini_mask.any(1).sum()
            actor_opt.zero_grad(set_to_none=True)
            critic_opt.zero_grad(set_to_none=True)
            acc: dict[str, float] = {}
            for mstart in range(0, len(mini), p.micro_batch_size):
                micro = batch.select(mini[mstart:mstart + p.micro_batch_size])
                r, mask = micro.rollout, micro.rollout.response_mask
                w = (mask.sum() if p.aggregation == "token-mean" else mask.any(1).sum()) / weight_total
                logits = response_logits(m.actor, r)                                    # (b, T, V)
                logprobs = logprobs_from_logits(logits, r.response_ids, T, mask=mask)
                pg_loss, pg_stats = ppo_policy_loss(logprobs, micro.old_logprobs, micro.advantages, mask,
                                                    p.clip_eps, p.aggregation)
                with torch.set_grad_enabled(p.entropy_coef > 0):  # logged always, differentiated only if used
                    entropy = entropy_from_logits(logits, mask, T, aggregation=p.aggregation)
                actor_loss = pg_loss - p.entropy_coef * entropy                         # −(L^CLIP + c2·S)
                (w * actor_loss).backward()
                values = _values(m.critic, r)
                vf_loss, vf_stats = value_loss(values, micro.old_values, micro.returns, mask, p.value_clip_eps,
                                               aggregation=p.aggregation)
                (w * p.vf_coef * vf_loss).backward()                                    # c1·L^VF
                tokens += int(r.attention_mask.sum())
                for k, v in {"loss/policy": pg_loss, "loss/value": vf_loss, "policy/entropy": entropy,
                             "policy/clipfrac": pg_stats["clipfrac"], "policy/approx_kl": pg_stats["approx_kl_k3"],
                             "policy/approx_kl_k1": pg_stats["approx_kl_k1"], "policy/ratio_max": pg_stats["ratio_max"],
                             "value/clipfrac": vf_stats["vf_clipfrac"]}.items():
                    v = float(v.detach())
                    acc[k] = max(acc.get(k, v), v) if k == "policy/ratio_max" else acc.get(k, 0.0) + float(w) * v
            if ptx_texts is not None:                                                   # γ_PTX·(−L^PTX)
                ptx = _ptx_loss(m, ptx_texts, ptx_sampler, cfg)
                (p.ptx_coef * ptx).backward()
                acc["loss/ptx"] = float(ptx.detach())
            acc["grad_norm/actor"] = _clip_and_step(m.actor, actor_opt, actor_sched, cfg.optim.max_grad_norm)
            acc["grad_norm/critic"] = _clip_and_step(m.critic, critic_opt, critic_sched, cfg.optim.max_grad_norm)
            for k, v in acc.items():
                history.setdefault(k, []).append(v)
            if p.target_kl is not None and acc["policy/approx_kl"] > p.target_kl:
                stop = True
                break
        if stop:
            break
    stats = {k: (max(v) if k == "policy/ratio_max" else sum(v) / len(v)) for k, v in history.items()}
    stats["policy/epochs_run"] = _epoch + 1
    stats["policy/early_stopped"] = float(stop)
    stats["lr/actor"] = actor_sched.get_last_lr()[0]
    stats["lr/critic"] = critic_sched.get_last_lr()[0]
    return stats, tokens


def _values(critic, r: Rollout) -> torch.Tensor:
    """V_φ(s_t) for each response position t: the head at the token before y_t. (B, T)."""
    P = r.prompt_ids.shape[1]
    return token_values(critic, r.input_ids, r.attention_mask)[:, P - 1:-1].float()


@torch.no_grad()
def _experience(m, rollout: Rollout, cfg: PPOConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log π_old, log π_ref and V_old, each (B, T), computed micro-batch by micro-batch."""
    T = cfg.rollout.temperature
    old, ref, val = [], [], []
    n = cfg.ppo.micro_batch_size
    for i in range(0, len(rollout), n):
        r = rollout.select(torch.arange(i, min(i + n, len(rollout))))
        mask = r.response_mask
        old.append(logprobs_from_logits(response_logits(m.actor, r), r.response_ids, T, mask=mask))
        with m.reference.active() as ref_model:
            ref.append(logprobs_from_logits(response_logits(ref_model, r), r.response_ids, T, mask=mask))
        val.append(torch.where(mask, _values(m.critic, r), 0.0))
    return torch.cat(old), torch.cat(ref), torch.cat(val)


def _ptx_loss(m, texts: list[str], sampler: PromptSampler, cfg: PPOConfig) -> torch.Tensor:
    tok = m.tokenizer
    rows = [tok(texts[i], add_special_tokens=True).input_ids[: cfg.data.ptx_max_length] for i in sampler.next_batch()]
    ids, att = pad_right(rows, tok.pad_token_id, next(m.actor.parameters()).device)
    logits = m.actor(input_ids=ids, attention_mask=att, use_cache=False).logits
    return ptx_loss(logits[:, :-1], ids[:, 1:], att[:, 1:].bool())


def _clip_and_step(model, opt, sched, max_norm: float) -> float:
    params = trainable_parameters(model)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    opt.step()
    sched.step()
    return float(norm)


# ----------------------------------------------------------------------------------------------
# Set-up: models, optimisers, controllers
# ----------------------------------------------------------------------------------------------

@dataclass
class _Models:
    tokenizer: object
    actor: object
    reference: Reference
    critic: object
    scorer: Scorer
    extra: dict = field(default_factory=dict)


def _build_models(cfg: PPOConfig, device, ckpt: Path | None, functions: dict) -> _Models:
    mc = cfg.model
    tokenizer = load_tokenizer(mc.policy, role="policy tokenizer")
    lora = (dict(r=mc.lora_r, alpha=mc.lora_alpha, target_modules=mc.lora_target_modules)
            if mc.lora_r > 0 else None)
    actor_path = str(ckpt / "policy") if ckpt is not None else None
    if lora:
        actor = build_actor(mc.policy, dtype=mc.dtype, lora=lora, adapter_path=actor_path)
    else:
        actor = build_actor(actor_path or mc.policy, dtype=mc.dtype)
    reference = Reference(actor, path=mc.policy, dtype=mc.dtype, shares_actor=lora is not None)

    reward_model = reward_tokenizer = None
    if mc.reward_model is not None:
        reward_tokenizer = load_tokenizer(mc.reward_model, role="reward-model tokenizer", padding_side="right")
        reward_model = load_sequence_scorer(mc.reward_model, role="reward model", dtype=mc.dtype,
                                            pad_token_id=reward_tokenizer.pad_token_id)
        freeze(reward_model)
    weights = dict(zip(mc.reward_functions, mc.reward_function_weights or [1.0] * len(functions)))

    critic_source = mc.critic
    if critic_source == "reward_model":
        if not same_tokenizer(tokenizer, reward_tokenizer):
            raise ModelLoadError(f"model.critic = reward_model, but the reward model's tokenizer ({mc.reward_model}) "
                                 f"differs from the policy's ({mc.policy}); the critic reads the policy's tokens. "
                                 "Set model.critic: policy, or a critic checkpoint with the policy's tokenizer.")
    elif critic_source != "policy":
        critic_tok = load_tokenizer(critic_source, role="critic tokenizer")
        if not same_tokenizer(tokenizer, critic_tok):
            raise ModelLoadError(f"model.critic {critic_source!r}: its tokenizer differs from the policy's "
                                 f"({mc.policy}); the critic must read the policy's tokens")
    critic_lora = lora if (lora and mc.critic_lora) else None
    critic = build_critic(critic_source, policy_path=mc.policy, reward_model_path=mc.reward_model, dtype=mc.dtype,
                          pad_token_id=tokenizer.pad_token_id, lora=critic_lora,
                          path=str(ckpt / "critic") if ckpt is not None and not critic_lora else None)
    if critic_lora and ckpt is not None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file
        set_peft_model_state_dict(critic, load_file(str(ckpt / "critic" / "adapter_model.safetensors")))
    for model in (actor, critic, reference.model, reward_model):
        if model is not None:
            model.to(device)
    scorer = Scorer(tokenizer, reward_model=reward_model, reward_tokenizer=reward_tokenizer,
                    reward_model_weight=mc.reward_model_weight, functions=functions, function_weights=weights,
                    micro_batch_size=cfg.ppo.micro_batch_size)
    return _Models(tokenizer, actor, reference, critic, scorer)


def _optimizer(model, lr: float, cfg: PPOConfig, total_steps: int):
    o = cfg.optim
    opt = torch.optim.AdamW(trainable_parameters(model), lr=lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay)

    def factor(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "constant":
            return 1.0
        frac = min(1.0, (step - o.warmup_steps) / max(1, total_steps - o.warmup_steps))
        return 1.0 - frac if o.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _kl_controller(cfg: PPOConfig):
    k = cfg.kl
    if k.controller == "adaptive":
        return AdaptiveKLController(k.beta, k.target, k.k_beta)
    if k.controller == "proportional":
        return ProportionalKLController(k.beta, k.target, k.horizon)
    return FixedKLController(k.beta)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _progress(cfg: PPOConfig, start: int):
    if not cfg.output.progress or not dist.is_main():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.train.steps, initial=start, desc="ppo", unit="step", dynamic_ncols=True)


# ----------------------------------------------------------------------------------------------
# Checkpoints: policy and critic in Hugging Face format + the trainer state, written atomically
# ----------------------------------------------------------------------------------------------

def _save_checkpoint(run_dir: Path, step: int, m: _Models, cfg: PPOConfig, actor_opt, actor_sched, critic_opt,
                     critic_sched, kl_ctl, sampler, ptx_sampler, counters: dict) -> None:
    if not dist.is_main():
        return
    root = run_dir / "checkpoints"
    with atomic_dir(root / f"step_{step:06d}") as tmp:
        m.actor.save_pretrained(tmp / "policy", safe_serialization=True)
        m.tokenizer.save_pretrained(tmp / "policy")
        m.critic.save_pretrained(tmp / "critic", safe_serialization=True)
        m.tokenizer.save_pretrained(tmp / "critic")
        torch.save({
            "step": step,
            "actor_optimizer": actor_opt.state_dict(), "actor_scheduler": actor_sched.state_dict(),
            "critic_optimizer": critic_opt.state_dict(), "critic_scheduler": critic_sched.state_dict(),
            "kl_controller": kl_ctl.state_dict(), "counters": dict(counters),
            "sampler": sampler.state_dict(), "ptx_sampler": ptx_sampler.state_dict() if ptx_sampler else None,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        }, tmp / "trainer_state.pt")
    atomic_write_text(root / "latest", f"step_{step:06d}\n")
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in done[:-cfg.train.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)


def _earlier_run(run_dir: Path, overwrite: bool) -> list[Path]:
    """The files of an earlier run in ``run_dir``, to delete before starting afresh; refused without
    ``overwrite`` (its checkpoints would be mixed with ours)."""
    names = ("checkpoints", "metrics.jsonl", "samples.jsonl", "tensorboard")
    earlier = [run_dir / n for n in names if (run_dir / n).exists()]
    if earlier and not overwrite:
        raise FileExistsError(f"output.dir {run_dir} already holds a run ({', '.join(p.name for p in earlier)}); "
                              f"continue it with --resume {run_dir}, or start afresh with --output.overwrite true")
    return earlier


def _latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if pointer.is_file():
        path = run_dir / "checkpoints" / pointer.read_text().strip()
        if path.is_dir():
            return path
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())
    return done[-1] if done else None


def _load_trainer_state(ckpt: Path, actor_opt, actor_sched, critic_opt, critic_sched, kl_ctl, sampler,
                        ptx_sampler) -> tuple[int, dict]:
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    actor_opt.load_state_dict(state["actor_optimizer"])
    actor_sched.load_state_dict(state["actor_scheduler"])
    critic_opt.load_state_dict(state["critic_optimizer"])
    critic_sched.load_state_dict(state["critic_scheduler"])
    kl_ctl.load_state_dict(state["kl_controller"])
    sampler.load_state_dict(state["sampler"])
    if ptx_sampler is not None and state["ptx_sampler"] is not None:
        ptx_sampler.load_state_dict(state["ptx_sampler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return int(state["step"]), dict(state.get("counters", {"skipped_nonfinite": 0, "wall_s": 0.0}))


def _write_samples(run_dir: Path, step: int, prompts: list[str], completions: list[str], scores, components,
                   n: int) -> None:
    if n <= 0:
        return
    with (run_dir / "samples.jsonl").open("a", encoding="utf-8") as fh:
        for i in range(min(n, len(prompts))):
            row = {"step": step, "prompt": prompts[i], "response": completions[i], "score": float(scores[i]),
                   **{f"score/{k}": float(v[i]) for k, v in components.items()}}
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

def cli(argv: list[str]) -> int:
    from proximal.cli import config_command

    def run(cfg: PPOConfig, resume_dir=None) -> int:
        try:
            run_dir = train(cfg, resume_dir=resume_dir)
        except (ConfigError, DataError, ModelLoadError, RewardFunctionError, FileNotFoundError, FileExistsError,
                ImportError) as e:
            print(f"proximal ppo: {e}", file=sys.stderr)  # bad input: one line, no traceback
            return 2
        except FloatingPointError as e:
            print(f"proximal ppo: {e}", file=sys.stderr)
            return 1
        print(f"proximal ppo: done; run directory {run_dir}")
        return 0

    return config_command(argv, prog="ppo", description=__doc__.splitlines()[0], config_cls=PPOConfig, run=run)
