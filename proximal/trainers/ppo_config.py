"""The PPO run configuration: every field documented, validated and read by ``trainers/ppo.py``.

The ``model``, ``data``, ``rollout``, ``optim``, ``train`` and ``output`` sections are the shared
ones of :mod:`proximal.train.sections`; ``ppo`` and ``kl`` are PPO's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from proximal.config import check_divides, option, section, section_problems
from proximal.core import AGGREGATIONS, ESTIMATORS, KL_CONTROLLERS
from proximal.core.ranges import problem
from proximal.train.run import check_per_rank
from proximal.train.sections import (
    EnvSection,
    EvalSection,
    OnlineModelSection,
    OptimSection,
    PromptDataSection,
    RLOutputSection,
    RLTrainSection,
    RolloutSection,
    ToolsSection,
    agent_problems,
    keep_best_problems,
)
from proximal.train.trl_names import TRL_NAMES


@dataclass
class PPOModel(OnlineModelSection):
    critic: str = option(
        "reward_model",
        "Critic V_φ initialisation: 'reward_model' (InstructGPT's choice), "
        "'policy' (the policy with a fresh zero head), or a checkpoint path.",
        python="model",
    )
    critic_lora: bool = option(
        False, "Train the critic with LoRA too (its scalar head stays fully trainable)."
    )

    def problems(self, name: str = "model") -> list[str]:
        e = super().problems(name)
        if self.critic == "reward_model" and self.reward_model is None:
            e.append(
                f"{name}.critic = 'reward_model' needs {name}.reward_model (or set {name}.critic: policy)"
            )
        if self.critic_lora and self.lora_r == 0:
            e.append(f"{name}.critic_lora = true needs {name}.lora_r > 0")
        return e


@dataclass
class PPOData(PromptDataSection):
    ptx_file: str | None = option(
        None,
        "Pretraining texts for the PTX loss: {'text'} rows, {'messages'} conversations (the "
        "chat template's whole text, every token trained) or plain text, one per line. Needed "
        "when ppo.ptx_coef > 0.",
        python="data",
    )
    ptx_batch_size: int = option(4, "PTX texts per mini-batch, over all processes together.")
    ptx_max_length: int = option(256, "PTX texts are cut to this many tokens.")


@dataclass
class PPOLossConfig:
    epochs: int = option(4, "PPO epochs over each rollout batch.")
    mini_batch_size: int = option(8, "Sequences per optimiser step, over all processes together.")
    micro_batch_size: int = option(
        4,
        "Sequences per forward/backward on one process (gradient accumulation within "
        "a mini-batch); also the batch of the experience and reward-model forwards.",
    )
    clip_eps: float = option(0.2, "ε of the clipped surrogate (typically 0.1–0.2).")
    dual_clip: float | None = option(
        None,
        "c > 1: dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c, 3): a token with Â < 0 "
        "loses at most c·|Â| however far its ratio grows; null = off (Schulman et al.'s L^CLIP).",
    )
    value_clip_eps: float = option(0.2, "ε_v of the clipped value loss.")
    gamma: float = option(
        1.0, "γ, the discount (1.0 for language: every token of the horizon counts alike)."
    )
    lam: float = option(0.95, "λ of GAE (0.95 in DeepSpeed-Chat, TRL and most RLHF code).")
    vf_coef: float = option(0.5, "c1, the value-loss coefficient (0.5–1.0).")
    entropy_coef: float = option(
        0.0, "c2, the entropy bonus coefficient (often 0 for large models)."
    )
    ptx_coef: float = option(0.0, "γ_PTX, the pretraining-loss coefficient (InstructGPT: 0–27).")
    whiten_advantages: bool = option(
        True, "Standardise advantages over all valid tokens of the batch."
    )
    aggregation: str = option(
        "token-mean",
        "How per-token losses are averaged: token-mean (PPO's Ê_t), "
        "seq-mean-token-mean, or seq-mean-token-sum-norm (÷ rollout.max_new_tokens).",
        choices=AGGREGATIONS,
    )
    kl_estimator: str = option(
        "k1",
        "Per-token KL estimator in the reward: k1 = log π − log π_ref (the usual one), k2, k3.",
        choices=ESTIMATORS,
    )
    target_kl: float | None = option(
        None,
        "Stop the epochs early when the approximate KL (k3) to the rollout "
        "policy passes this; null = never.",
    )
    reuse_first_pass: bool = option(
        True,
        "When the whole batch is one mini-batch and one micro-batch on one "
        "process, take log π_old from the first epoch's own actor forward "
        "(detached) instead of a separate pass: the same numbers, one actor "
        "forward fewer a step. false: a separate pass.",
    )


@dataclass
class KLConfig:
    controller: str = option(
        "fixed",
        "β schedule: fixed; adaptive, the piecewise rule β ← β·(1 ± K_β) when the "
        "KL leaves [d_targ/1.5, 1.5·d_targ] (after Schulman et al. 2017, §4; "
        "docs/formulas.md); or proportional (Ziegler et al. 2019).",
        choices=KL_CONTROLLERS,
    )
    beta: float = option(
        0.05, "β, the KL penalty coefficient (the initial value for the controllers)."
    )
    target: float = option(
        6.0, "d_targ: the target sequence KL (nats) of the adaptive and proportional controllers."
    )
    k_beta: float = option(0.1, "K_β of the adaptive controller (0.1 is usual).")
    horizon: int = option(10000, "Horizon of the proportional controller, in samples.")


@dataclass
class PPOOptim(OptimSection):
    critic_lr: float = option(1e-5, "AdamW learning rate of the critic (optim.lr is the policy's).")

    def problems(self, name: str = "optim") -> list[str]:
        e = super().problems(name)
        if not self.critic_lr > 0:
            e.append(f"{name}.critic_lr = {self.critic_lr} must be > 0")
        return e


@dataclass
class PPOConfig:
    """Everything a PPO run needs; see docs/ppo.md for each field and what healthy values look like."""

    FOREIGN_NAMES: ClassVar[dict[str, str]] = TRL_NAMES["ppo"]

    model: PPOModel = section(PPOModel)
    data: PPOData = section(PPOData)
    rollout: RolloutSection = section(RolloutSection)
    ppo: PPOLossConfig = section(PPOLossConfig)
    kl: KLConfig = section(KLConfig)
    optim: PPOOptim = section(PPOOptim, lr=1e-6)
    train: RLTrainSection = section(RLTrainSection)
    output: RLOutputSection = section(RLOutputSection, dir="runs/ppo")
    eval: EvalSection = section(
        EvalSection, "Held-out prompts sampled while the policy trains (eval/* metrics)."
    )
    env: EnvSection = section(
        EnvSection, "A multi-turn environment (docs/agents.md); null factory = none."
    )
    tools: ToolsSection = section(
        ToolsSection, "Tool functions the policy calls (docs/agents.md); empty = none."
    )

    RENAMED: ClassVar[dict[str, str]] = {
        "model.policy": "the policy's checkpoint is model.path (the same field in every command)",
        "model.dtype": "use train.precision ('32-true'; 'bf16-mixed' for bfloat16 compute with float32 master "
        "weights; 'bf16-true' for what model.dtype: bfloat16 did)",
        "optim.actor_lr": "the policy's learning rate is optim.lr (the same field in every command)",
    }

    def validate(self) -> list[str]:
        e = section_problems(self)
        e += keep_best_problems(self.output, self.eval.prompts is not None, "eval.prompts")
        e += self.rollout.precision_problems(self.train.precision)
        e = agent_problems(e, self.env, self.tools, self.rollout)
        d, r, p, k = self.data, self.rollout, self.ppo, self.kl
        if p.ptx_coef > 0 and not d.ptx_file:
            e.append(f"ppo.ptx_coef = {p.ptx_coef} needs data.ptx_file")
        if isinstance(d.ptx_file, str) and d.ptx_file and not Path(d.ptx_file).exists():
            e.append(f"data.ptx_file: {d.ptx_file!r} does not exist")
        for name, v in (
            ("ppo.epochs", p.epochs),
            ("data.ptx_batch_size", d.ptx_batch_size),
            ("data.ptx_max_length", d.ptx_max_length),
        ):
            if v <= 0:
                e.append(f"{name} = {v} must be positive")
        check_divides(
            e, "rollout.batch_size", r.batch_size, "ppo.mini_batch_size", p.mini_batch_size
        )
        check_divides(
            e, "ppo.mini_batch_size", p.mini_batch_size, "ppo.micro_batch_size", p.micro_batch_size
        )
        if p.mini_batch_size > 0 and p.micro_batch_size > 0:
            check_per_rank(
                e,
                "ppo.mini_batch_size",
                p.mini_batch_size,
                "ppo.micro_batch_size",
                p.micro_batch_size,
            )
        if p.ptx_coef > 0:
            check_per_rank(e, "data.ptx_batch_size", d.ptx_batch_size)
        for key, field in (
            ("clip_eps", "ppo.clip_eps"),
            ("value_clip_eps", "ppo.value_clip_eps"),
            ("gamma", "ppo.gamma"),
            ("lam", "ppo.lam"),
            ("beta", "kl.beta"),
        ):
            msg = problem(key, getattr(p, key) if key != "beta" else k.beta, field)
            if msg:
                e.append(msg)
        if p.dual_clip is not None and (msg := problem("dual_clip", p.dual_clip, "ppo.dual_clip")):
            e.append(msg)
        if p.vf_coef < 0 or p.entropy_coef < 0 or p.ptx_coef < 0:
            e.append("ppo.vf_coef, ppo.entropy_coef and ppo.ptx_coef must be ≥ 0")
        if p.target_kl is not None and not p.target_kl > 0:
            e.append(f"ppo.target_kl = {p.target_kl} must be > 0 (or null)")
        if k.controller != "fixed":
            for msg in (
                problem("kl_target", k.target, "kl.target"),
                problem("horizon", k.horizon, "kl.horizon")
                if k.controller == "proportional"
                else None,
                problem("k_beta", k.k_beta, "kl.k_beta") if k.controller == "adaptive" else None,
            ):
                if msg:
                    e.append(msg)
            if not k.beta > 0:
                e.append(
                    f"kl.beta = {k.beta} must be > 0 for the {k.controller} controller (it scales β, so 0 stays 0)"
                )
        return e
