"""The PPO run configuration: every field documented, validated and read by ``trainers/ppo.py``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from proximal.config import check_divides, option, section

LORA_HELP = "LoRA rank; 0 trains all weights. With LoRA the reference is the actor with adapters disabled."


@dataclass
class ModelConfig:
    policy: str = option("", "Actor π_θ: a local directory or hub id of an AutoModelForCausalLM (the SFT model). "
                             "The reference π_ref starts as a frozen copy of it.")
    reward_model: str | None = option(None, "Frozen reward model r_ψ: an AutoModelForSequenceClassification with "
                                            "one label. May use a different tokenizer from the policy.")
    reward_model_weight: float = option(1.0, "Weight of the reward model's score in the total score.")
    reward_functions: list[str] = option(help="Rule-based rewards 'module:function(prompts, completions) -> scores', "
                                              "added to the total score.", default_factory=list)
    reward_function_weights: list[float] = option(help="One weight per reward function (empty: 1.0 each). "
                                                       "Weight 0 logs a score without training on it.",
                                                  default_factory=list)
    critic: str = option("reward_model", "Critic V_φ initialisation: 'reward_model' (seed §2), 'policy' "
                                         "(fresh zero head), or a checkpoint path.")
    dtype: str = option("float32", "Weights' dtype.", choices=("float32", "bfloat16", "float16"))
    lora_r: int = option(0, LORA_HELP)
    lora_alpha: float = option(16.0, "LoRA scaling numerator (scale = alpha / r).")
    lora_target_modules: list[str] = option(help="Modules that get adapters; ['all-linear'] = every linear layer "
                                                 "except the output head.", default_factory=lambda: ["all-linear"])
    critic_lora: bool = option(False, "Train the critic with LoRA too (its scalar head stays fully trainable).")


@dataclass
class DataConfig:
    prompts: str = option("", "Prompts: JSONL with {'prompt': str} or {'messages': [...]}, or a `datasets` "
                              "directory saved with save_to_disk.")
    max_prompt_length: int = option(256, "Longest prompt in tokens.")
    on_long_prompt: str = option("truncate_left", "What to do with a longer prompt.",
                                 choices=("truncate_left", "skip"))
    shuffle: bool = option(True, "Shuffle prompts each pass (seeded).")
    ptx_file: str | None = option(None, "Pretraining texts for the PTX loss (JSONL {'text'} or plain text, one per "
                                        "line). Needed when ppo.ptx_coef > 0.")
    ptx_batch_size: int = option(4, "PTX texts per mini-batch.")
    ptx_max_length: int = option(256, "PTX texts are cut to this many tokens.")


@dataclass
class RolloutConfig:
    batch_size: int = option(16, "Prompts sampled per PPO step (per data-parallel rank).")
    max_new_tokens: int = option(32, "T: the episode ends after this many tokens if no stop came (seed §1).")
    temperature: float = option(1.0, "Sampling temperature; log-probabilities are computed at the same temperature.")
    top_p: float = option(1.0, "Nucleus sampling threshold (1.0 = off).")
    top_k: int = option(0, "Top-k sampling (0 = off).")
    stop_strings: list[str] = option(help="Strings that end a response (besides EOS).", default_factory=list)
    stop_token_ids: list[int] = option(help="Token ids that end a response (besides EOS).", default_factory=list)
    missing_eos_penalty: float | None = option(None, "Added to the score of a response that reached T without "
                                                     "stopping (e.g. -1.0); null = no penalty.")
    nonfinite_scores: str = option("skip", "A NaN or infinite score: 'skip' drops the sample from training and "
                                           "counts it; 'error' stops the run.", choices=("skip", "error"))


@dataclass
class PPOLossConfig:
    epochs: int = option(4, "PPO epochs over each rollout batch.")
    mini_batch_size: int = option(8, "Sequences per optimiser step.")
    micro_batch_size: int = option(4, "Sequences per forward/backward (gradient accumulation within a mini-batch).")
    clip_eps: float = option(0.2, "ε of the clipped surrogate (seed §5; typically 0.1–0.2).")
    value_clip_eps: float = option(0.2, "ε_v of the clipped value loss (seed §6).")
    gamma: float = option(1.0, "γ, the discount (seed §1: 1.0).")
    lam: float = option(0.95, "λ of GAE (seed §4: 0.95).")
    vf_coef: float = option(0.5, "c1, the value-loss coefficient (seed §6: 0.5–1.0).")
    entropy_coef: float = option(0.0, "c2, the entropy bonus coefficient (seed §6: often 0).")
    ptx_coef: float = option(0.0, "γ_PTX, the pretraining-loss coefficient (seed §6: 0–27).")
    whiten_advantages: bool = option(True, "Standardise advantages over all valid tokens of the batch (seed §4).")
    aggregation: str = option("token-mean", "How per-token losses are averaged.",
                              choices=("token-mean", "seq-mean-token-mean"))
    kl_estimator: str = option("k1", "Per-token KL estimator in the reward: k1 = log π − log π_ref (the seed's), k2, k3.",
                               choices=("k1", "k2", "k3"))
    target_kl: float | None = option(None, "Stop the epochs early when the approximate KL (k3) to the rollout "
                                           "policy passes this; null = never.")


@dataclass
class KLConfig:
    controller: str = option("fixed", "β schedule: fixed, adaptive (the seed's rule, §3) or proportional "
                                      "(Ziegler et al. 2019).", choices=("fixed", "adaptive", "proportional"))
    beta: float = option(0.05, "β, the KL penalty coefficient (the initial value for the controllers).")
    target: float = option(6.0, "d_targ: the target sequence KL (nats) of the adaptive and proportional controllers.")
    k_beta: float = option(0.1, "K_β of the adaptive controller (seed: 0.1).")
    horizon: int = option(10000, "Horizon of the proportional controller, in samples.")


@dataclass
class OptimConfig:
    actor_lr: float = option(1e-6, "AdamW learning rate of the actor.")
    critic_lr: float = option(1e-5, "AdamW learning rate of the critic.")
    weight_decay: float = option(0.0, "AdamW weight decay (both optimisers).")
    adam_beta1: float = option(0.9, "AdamW β1.")
    adam_beta2: float = option(0.999, "AdamW β2.")
    adam_eps: float = option(1e-8, "AdamW ε.")
    max_grad_norm: float = option(1.0, "Gradient-norm clip per optimiser step (0 = off).")
    warmup_steps: int = option(0, "Linear warm-up, in optimiser steps.")
    schedule: str = option("constant", "Learning-rate schedule after warm-up.", choices=("constant", "linear", "cosine"))


@dataclass
class TrainConfig:
    steps: int = option(100, "PPO steps (rollout batches) in the run.")
    seed: int = option(0, "Seed of every random choice (sampling, data order, mini-batches).")
    device: str = option("auto", "cpu, cuda, cuda:N, or auto (cuda when available).")
    save_every: int = option(50, "Write a checkpoint every N steps, and always after the last (0 = only then).")
    keep_checkpoints: int = option(2, "How many step checkpoints to keep (oldest are deleted).")


@dataclass
class OutputConfig:
    dir: str = option("runs/ppo", "Run directory: config.yaml, metrics.jsonl, samples.jsonl, checkpoints/.")
    samples_per_step: int = option(4, "Prompt/response/score rows written to samples.jsonl per step.")
    progress: bool = option(True, "Show a progress bar with ETA.")
    tensorboard: bool = option(False, "Also log to TensorBoard (needs the tensorboard extra).")
    wandb_project: str | None = option(None, "Also log to this Weights & Biases project (needs the wandb extra).")
    overwrite: bool = option(False, "Start afresh in an output.dir that already holds a run (its checkpoints and "
                                     "logs are deleted). Without it such a directory is refused; use --resume to continue.")


@dataclass
class PPOConfig:
    """Everything a PPO run needs; see docs/ppo.md for each field and what healthy values look like."""

    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    ppo: PPOLossConfig = section(PPOLossConfig)
    kl: KLConfig = section(KLConfig)
    optim: OptimConfig = section(OptimConfig)
    train: TrainConfig = section(TrainConfig)
    output: OutputConfig = section(OutputConfig)

    def validate(self) -> list[str]:
        e: list[str] = []
        m, d, r, p, k = self.model, self.data, self.rollout, self.ppo, self.kl
        if not m.policy:
            e.append("model.policy: required (a checkpoint directory or hub id)")
        if m.reward_model is None and not m.reward_functions:
            e.append("model.reward_model / model.reward_functions: give at least one source of reward")
        if m.reward_function_weights and len(m.reward_function_weights) != len(m.reward_functions):
            e.append(f"model.reward_function_weights has {len(m.reward_function_weights)} values for "
                     f"{len(m.reward_functions)} model.reward_functions")
        if m.critic == "reward_model" and m.reward_model is None:
            e.append("model.critic = 'reward_model' needs model.reward_model (or set model.critic: policy)")
        if m.lora_r < 0:
            e.append(f"model.lora_r = {m.lora_r} must be ≥ 0")
        if m.critic_lora and m.lora_r == 0:
            e.append("model.critic_lora = true needs model.lora_r > 0")
        if not d.prompts:
            e.append("data.prompts: required")
        elif not Path(d.prompts).exists():
            e.append(f"data.prompts: {d.prompts!r} does not exist")
        if p.ptx_coef > 0 and not d.ptx_file:
            e.append(f"ppo.ptx_coef = {p.ptx_coef} needs data.ptx_file")
        for i, spec in enumerate(m.reward_functions):
            if ":" not in spec:
                e.append(f"model.reward_functions[{i}] = {spec!r}: expected 'module:function'")
        if d.ptx_file and not Path(d.ptx_file).exists():
            e.append(f"data.ptx_file: {d.ptx_file!r} does not exist")
        for name, v in (("data.max_prompt_length", d.max_prompt_length), ("rollout.max_new_tokens", r.max_new_tokens),
                        ("ppo.epochs", p.epochs), ("train.steps", self.train.steps),
                        ("data.ptx_batch_size", d.ptx_batch_size), ("data.ptx_max_length", d.ptx_max_length)):
            if v <= 0:
                e.append(f"{name} = {v} must be positive")
        check_divides(e, "rollout.batch_size", r.batch_size, "ppo.mini_batch_size", p.mini_batch_size)
        check_divides(e, "ppo.mini_batch_size", p.mini_batch_size, "ppo.micro_batch_size", p.micro_batch_size)
        if r.temperature <= 0:
            e.append(f"rollout.temperature = {r.temperature} must be > 0")
        if not 0 < r.top_p <= 1:
            e.append(f"rollout.top_p = {r.top_p} must be in (0, 1]")
        if r.top_k < 0:
            e.append(f"rollout.top_k = {r.top_k} must be ≥ 0")
        if p.clip_eps <= 0 or p.value_clip_eps <= 0:
            e.append(f"ppo.clip_eps = {p.clip_eps} and ppo.value_clip_eps = {p.value_clip_eps} must be > 0")
        if not 0 <= p.gamma <= 1 or not 0 <= p.lam <= 1:
            e.append(f"ppo.gamma = {p.gamma} and ppo.lam = {p.lam} must lie in [0, 1]")
        if p.vf_coef < 0 or p.entropy_coef < 0 or p.ptx_coef < 0:
            e.append("ppo.vf_coef, ppo.entropy_coef and ppo.ptx_coef must be ≥ 0")
        if k.beta < 0:
            e.append(f"kl.beta = {k.beta} must be ≥ 0")
        if k.controller != "fixed" and k.target <= 0:
            e.append(f"kl.target = {k.target} must be > 0 for the {k.controller} controller")
        if k.controller != "fixed" and k.beta <= 0:
            e.append(f"kl.beta = {k.beta} must be > 0 for the {k.controller} controller (it scales β, so 0 stays 0)")
        if k.controller == "adaptive" and not 0 < k.k_beta < 1:
            e.append(f"kl.k_beta = {k.k_beta} must lie in (0, 1)")
        if k.controller == "proportional" and k.horizon <= 0:
            e.append(f"kl.horizon = {k.horizon} must be positive")
        if self.optim.actor_lr <= 0 or self.optim.critic_lr <= 0:
            e.append("optim.actor_lr and optim.critic_lr must be > 0")
        if self.train.save_every < 0 or self.train.keep_checkpoints < 1:
            e.append("train.save_every must be ≥ 0 and train.keep_checkpoints ≥ 1")
        return e
