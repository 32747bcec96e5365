"""Where the names of TRL's and OpenRLHF's configs live here, command by command: one table.

A config written for TRL (``learning_rate: 1e-6``, ``num_generations: 8``, all at the top level) or
for OpenRLHF (``init_kl_coef``, ``n_samples_per_prompt``) meets unknown keys here. Each config class
takes its command's row as ``FOREIGN_NAMES`` and :func:`proximal.config.load_config` answers such a
key with the field it means in the command being run (``num_generations: a TRL/OpenRLHF name, not a
field here; it is rollout.group_size``), every one of them in the one message that lists all the
config's problems. tests/test_trl_names.py checks that every field a hint names is a field of that
command's config, so the table cannot drift from the configs.
"""

from __future__ import annotations

from proximal.commands import COMMANDS as ALL_COMMANDS
from proximal.commands import TRAINING

#: The commands that train on a fixed data set, and the two that sample online (proximal.commands).
FIXED = tuple(c for c in TRAINING if not ALL_COMMANDS[c].online)
ONLINE = tuple(c for c in TRAINING if ALL_COMMANDS[c].online)
COMMANDS = (*FIXED, *ONLINE)


def _shared(command: str) -> dict[str, str]:
    """The names of transformers' TrainingArguments (every TRL trainer's base) and OpenRLHF's common
    flags, for ``command``."""
    fixed = command in FIXED
    micro = {
        "ppo": "ppo.micro_batch_size",
        "grpo": "grpo.micro_batch_size",
        "distill": "distill.micro_batch_size",
    }.get(command, "train.micro_batch_size")
    step_batch = {
        "ppo": "ppo.mini_batch_size",
        "grpo": "grpo.mini_batch_size",
        "distill": "distill.mini_batch_size",
    }.get(command, "train.batch_size")
    unit = "rows (pairs)" if fixed else "responses"
    names = {
        "learning_rate": "it is optim.lr",
        "weight_decay": "it is optim.weight_decay",
        "adam_beta1": "it is optim.adam_beta1",
        "adam_beta2": "it is optim.adam_beta2",
        "adam_epsilon": "it is optim.adam_eps",
        "max_grad_norm": "it is optim.max_grad_norm (0 = off)",
        "warmup_steps": "it is optim.warmup_steps",
        "warmup_ratio": "warm-up is optim.warmup_steps, a number of steps (ratio × the run's steps)",
        "lr_warmup_ratio": "warm-up is optim.warmup_steps, a number of steps (ratio × the run's "
        "steps)",
        "lr_scheduler_type": "it is optim.schedule (constant, linear or cosine)",
        "lr_scheduler": "it is optim.schedule (constant, linear or cosine)",
        "max_steps": "it is train.steps",
        "seed": "it is train.seed",
        "bf16": "it is train.precision: 'bf16-mixed' (bfloat16 compute, float32 master weights)",
        "fp16": "there is no float16 training; train.precision: 'bf16-mixed' is the nearest",
        "gradient_checkpointing": "it is train.activation_checkpointing",
        "torch_compile": "it is train.compile",
        "output_dir": "it is output.dir",
        "save_path": "it is output.dir",
        "overwrite_output_dir": "it is output.overwrite",
        "save_steps": "it is train.save_every",
        "save_total_limit": "it is train.keep_checkpoints",
        "logging_steps": "every step is logged (output.dir/metrics.jsonl; output.tensorboard, "
        "output.wandb_project for the others): nothing to set",
        "report_to": "set output.tensorboard: true or output.wandb_project",
        "use_wandb": "it is output.wandb_project",
        "metric_for_best_model": "it is output.keep_best",
        "load_best_model_at_end": "the checkpoint of the best held-out metric is kept with "
        "output.keep_best",
        "greater_is_better": "it is output.keep_best_mode (max or min)",
        "model_name_or_path": "it is model.path",
        "pretrain": "it is model.path",
        "lora_r": "it is model.lora_r (0 = full fine-tuning)",
        "lora_rank": "it is model.lora_r (0 = full fine-tuning)",
        "lora_alpha": "it is model.lora_alpha",
        "lora_target_modules": "it is model.lora_target_modules",
        "target_modules": "it is model.lora_target_modules",
        "use_peft": "LoRA is on when model.lora_r > 0",
        "per_device_train_batch_size": f"it is {micro} ({unit} per forward/backward on one "
        f"process; {step_batch} is the whole batch of an optimiser step)",
        "micro_train_batch_size": f"it is {micro}",
        "train_batch_size": f"it is {step_batch} ({unit} per optimiser step, over all processes)",
        "gradient_accumulation_steps": f"there is no such count here: an optimiser step takes "
        f"{step_batch} {unit} over all processes, {micro} at a time on each, so it accumulates "
        f"{step_batch} / (processes × {micro}) passes",
    }
    if fixed:
        names |= {
            "num_train_epochs": "it is train.epochs (with train.steps: null)",
            "max_epochs": "it is train.epochs (with train.steps: null)",
            "eval_steps": "it is train.eval_every",
            "per_device_eval_batch_size": "the held-out batch is train.micro_batch_size",
            "micro_batch_size": "it is train.micro_batch_size",
            "dataset_name": "it is data.train_file (a file, a save_to_disk directory or a data "
            "set in the local Hugging Face cache)",
            "train_dataset": "it is data.train_file",
            "dataset": "it is data.train_file",
            "eval_dataset": "it is data.eval_file",
            "dataset_train_split": "it is data.split",
            "dataset_test_split": "the held-out split is data.eval_split",
            "max_length": "it is data.max_length",
            "max_len": "it is data.max_length",
            "max_seq_length": "it is data.max_length",
            "packing": "it is train.packing",
            "padding_free": "it is train.packing",
        }
    else:
        names |= {
            "num_train_epochs": "an online run counts optimiser steps: train.steps, each on "
            "rollout.batch_size prompts",
            "num_episodes": "an online run counts optimiser steps: train.steps, each on "
            "rollout.batch_size prompts",
            "eval_steps": "it is eval.every",
            "per_device_eval_batch_size": "it is eval.batch_size",
            "dataset_name": "it is data.prompts",
            "train_dataset": "it is data.prompts",
            "prompt_data": "it is data.prompts",
            "dataset": "it is data.prompts",
            "eval_dataset": "it is eval.prompts",
            "dataset_train_split": "it is data.split",
            "dataset_test_split": "it is eval.split",
            "max_prompt_length": "it is data.max_prompt_length",
            "prompt_max_len": "it is data.max_prompt_length",
            "max_completion_length": "it is rollout.max_new_tokens",
            "generate_max_len": "it is rollout.max_new_tokens",
            "response_length": "it is rollout.max_new_tokens",
            "temperature": "it is rollout.temperature",
            "top_p": "it is rollout.top_p",
            "top_k": "it is rollout.top_k",
            "stop_token_id": "it is rollout.stop_token_ids",
            "missing_eos_penalty": "it is rollout.missing_eos_penalty",
            "rollout_batch_size": "it is rollout.batch_size (prompts per step)",
            "reward_model_path": "it is model.reward_model",
            "reward_pretrain": "it is model.reward_model",
            "reward_funcs": "it is model.reward_functions ('module:function' each)",
            "reward_weights": "it is model.reward_function_weights",
            "use_vllm": "it is rollout.engine: vllm (colocated in this process, as TRL's "
            "vllm_mode colocate)",
            "vllm_mode": "rollout.engine: vllm runs colocated in this process (TRL's 'colocate'); "
            "there is no server mode",
            "vllm_gpu_memory_utilization": "it is rollout.kv_cache_gib (the engine's KV budget, GiB)",
            "vllm_importance_sampling_correction": "it is rollout.correction (tis, token_mask, "
            "seq_mask or bypass)",
        }
    return names


def _own(command: str) -> dict[str, str]:
    """The names of each method's own TRL config (DPOConfig, CPOConfig, PPOConfig, GRPOConfig) and
    OpenRLHF script, for ``command``."""
    if command == "sft":
        return {
            "completion_only_loss": "it is data.loss_on (completion_only)",
            "assistant_only_loss": "it is data.loss_on (all_assistant, the default)",
            "dataset_text_field": "map a column to 'text' with data.columns",
        }
    if command == "rm":
        return {"center_rewards_coefficient": "there is no reward centring term here"}
    if command == "dpo":
        return {
            "beta": "it is dpo.beta",
            "loss_type": "it is dpo.loss_type (sigmoid, ipo or robust)",
            "label_smoothing": "it is dpo.label_smoothing",
            "max_prompt_length": "data.max_length bounds prompt + response; there is no separate "
            "prompt limit",
            "precompute_ref_log_probs": "it is train.precompute_ref_logprobs",
            "ref_model": "the reference is model.path's starting weights",
        }
    if command == "simpo":
        return {
            "beta": "it is simpo.beta",
            "simpo_gamma": "the margin is simpo.gamma_beta_ratio, γ/β (γ = ratio × simpo.beta)",
            "gamma_beta_ratio": "it is simpo.gamma_beta_ratio",
            "loss_type": "this command is SimPO's loss (DPO's variants are proximal dpo's "
            "loss_type)",
            "cpo_alpha": "there is no behaviour-cloning (CPO) term here",
            "max_prompt_length": "data.max_length bounds prompt + response; there is no separate "
            "prompt limit",
        }
    if command == "ppo":
        return {
            "beta": "it is kl.beta",
            "kl_coef": "it is kl.beta",
            "init_kl_coef": "it is kl.beta (kl.controller: adaptive for OpenRLHF's kl_target)",
            "kl_target": "it is kl.target (with kl.controller: adaptive)",
            "kl_estimator": "it is ppo.kl_estimator",
            "epsilon": "it is ppo.clip_eps",
            "cliprange": "it is ppo.clip_eps",
            "eps_clip": "it is ppo.clip_eps",
            "cliprange_value": "it is ppo.value_clip_eps",
            "value_clip": "it is ppo.value_clip_eps",
            "vf_coef": "it is ppo.vf_coef",
            "gamma": "it is ppo.gamma",
            "lam": "it is ppo.lam",
            "lambd": "it is ppo.lam",
            "num_ppo_epochs": "it is ppo.epochs",
            "max_epochs": "it is ppo.epochs",
            "num_mini_batches": "give ppo.mini_batch_size, the sequences per optimiser step",
            "whiten_rewards": "advantages are whitened with ppo.whiten_advantages",
            "entropy_coef": "it is ppo.entropy_coef",
            "entropy_loss_coef": "it is ppo.entropy_coef",
            "ptx_coef": "it is ppo.ptx_coef",
            "critic_learning_rate": "it is optim.critic_lr",
            "critic_pretrain": "it is model.critic",
            "value_model_path": "it is model.critic",
            "sft_model_path": "it is model.path (the reference is its starting weights)",
            "num_generations": "PPO samples one response per prompt, rollout.batch_size prompts "
            "per step (a group per prompt is proximal grpo's group_size)",
        }
    if command == "distill":  # TRL's GKDConfig (and its successors' on-policy distillation)
        return {
            "teacher_model_name_or_path": "it is model.teacher",
            "teacher_model": "it is model.teacher",
            "lmbda": "distill.lam is the other share: 1 − lmbda, the probability that a response "
            "is the data's teacher-written completion (distill.completion_column; with "
            "distill.loss jsd)",
            "seq_kd": "sequence-level KD on the teacher's samples is not on-policy distillation "
            "(train on such samples with proximal sft); here model.teacher grades the student's",
            "beta": "it is distill.beta, with distill.loss: jsd (the same convention); the default "
            "distill.loss reverse_kl is the sampled reverse KL, TRL's beta 1.0, as a per-token reward",
            "num_generations": "it is rollout.group_size",
        }
    return {  # grpo
        "num_generations": "it is rollout.group_size",
        "n_samples_per_prompt": "it is rollout.group_size",
        "beta": "it is grpo.beta",
        "kl_coef": "it is grpo.beta",
        "init_kl_coef": "it is grpo.beta",
        "epsilon": "it is grpo.clip_eps",
        "eps_clip": "it is grpo.clip_eps",
        "epsilon_high": "it is grpo.clip_eps_high",
        "num_iterations": "it is grpo.iterations",
        "loss_type": "it is grpo.loss (grpo, dr_grpo or dapo; TRL's 'bnpo' is dapo on one process)",
        "scale_rewards": "it is grpo.advantage: group divides by the group's std (true), "
        "unscaled does not (false), batch by the batch's",
        "mask_truncated_completions": "it is grpo.mask_truncated",
        "importance_sampling_level": "it is grpo.objective (token: clip, sequence: gspo)",
        "entropy_coef": "it is grpo.entropy_coef",
        "advantage_estimator": "it is grpo.advantage (group, rloo, reinforce_pp, ...)",
    }


#: command → {TRL or OpenRLHF name → where it lives in that command}: each config's ``FOREIGN_NAMES``.
TRL_NAMES: dict[str, dict[str, str]] = {c: _shared(c) | _own(c) for c in COMMANDS}
