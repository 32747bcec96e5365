"""``proximal compare``: PPO, DPO, SimPO, GRPO and RLOO from one SFT model, over several seeds, measured alike.

From one SFT checkpoint and one set of inputs, every listed method is trained with its own config
(``<configs>/<method>.yaml``; by default the demo's, tuned for the built-in task) on a matched budget
(:func:`proximal.methods.budget_steps`: online methods sample as many responses as each other,
offline ones train on as many preference pairs), once per seed. Each run's checkpoints — evenly
spaced along it — and its final policy are then evaluated the same way on held-out prompts
(:func:`proximal.evaluation.evaluate_policy`, one sampling seed for all: common random numbers),
and :mod:`proximal.compare_report` turns the run directories into ``compare.md``, ``compare.json``
and plots.

1. **inputs** — the config's ``data`` section; without ``data.sft_model``, the built-in digit-sorting
   task: its data, SFT model and reward model are trained first, as ``proximal demo`` trains them;
2. **runs** — method × reward source × seed, each in ``<out>/runs/<method>[@<source>]-seed<N>/``, a
   normal run directory of its command. A run that fails is recorded with its error and the others
   go on;
3. **evaluation** — ``eval.json`` in each run directory: every evaluated checkpoint's held-out means,
   and the final policy's responses;
4. **report** — ``compare.md``, ``compare.json``, ``plots/``.

Running the same command again continues a comparison that stopped: finished runs (those with an
``eval.json``) are kept, the others are run again from the start. Under torchrun every process runs
each training; evaluation and the report are rank 0's (the policy must fit one device).
"""

from __future__ import annotations

import ctypes
import gc
import json
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import yaml

from proximal import compare_report, dist
from proximal.commands import config_class, trainer
from proximal.config import ConfigError, load_config, option, section, to_dict
from proximal.data.sources import columns_problems, source_problem
from proximal.demo import (
    ARITHMETIC,
    ARITHMETIC_SCORES,
    ARITHMETIC_VERIFIER,
    CALCULATOR,
    CALCULATOR_SCORES,
    CALCULATOR_VERIFIER,
    DEFAULT_CONFIGS,
    EVAL_PROMPT_TOKENS,
    FULL,
    arithmetic_stage_configs,
    calculator_agent,
    calculator_stage_configs,
    gym_stage_configs,
    stage_configs,
)
from proximal.evaluation import evaluate_policy
from proximal.methods import (
    METHODS,
    PAIRS,
    REWARD_MODEL,
    TEACHER,
    VERIFIER,
    Method,
    budget_steps,
    checkpoint_policies,
    input_overrides,
    responses_per_step,
)
from proximal.models.tiny import SHAPE_KEYS, shape_problems, tiny_causal_lm_config
from proximal.rollout.reward_functions import DEFAULT_TIMEOUT_S
from proximal.rollout.vllm import config_problems, preflight_problems
from proximal.tasks import arithmetic, calculator, digits
from proximal.tasks import gym as gym_task
from proximal.tasks.digits import make_task_data
from proximal.train import signals
from proximal.train.command import config_command
from proximal.train.sections import ENGINES, pass_k_problems
from proximal.trainers import reward, sft

DEFAULT_METHODS = ["ppo", "dpo", "simpo", "grpo", "rloo"]
BUILTIN_GOLD = "proximal.tasks.digits:gold_score"
BUILTIN_VERIFIER = "proximal.tasks.digits:exact_sort"
#: The built-in tasks (data.sft_model unset) and the methods each compares by default: the
#: arithmetic and calculator tasks have reference answers and a verifier, but no preference pairs
#: or reward model. The calculator's methods run with its tool; its table also has the no-tool
#: baseline's row (:data:`NO_TOOL`).
TASKS = {
    "digits": DEFAULT_METHODS,
    ARITHMETIC: ["ppo@verifier", "grpo", "rloo"],
    CALCULATOR: ["ppo@verifier", "grpo", "rloo"],
    **{task: ["ppo@verifier", "grpo", "rloo"] for task in gym_task.TASKS},
}
#: Each built-in task's base model (``compare.model`` is merged over it).
TASK_MODELS = {
    "digits": digits.DEFAULT_MODEL,
    ARITHMETIC: arithmetic.DEFAULT_MODEL,
    CALCULATOR: calculator.DEFAULT_MODEL,
    **dict.fromkeys(gym_task.TASKS, gym_task.DEFAULT_MODEL),
}


#: The built-in tasks with reference answers and a verifier, no pairs and no reward model.
ANSWER_TASKS = (ARITHMETIC, CALCULATOR, *gym_task.TASKS)
#: Held-out columns of a reasoning-gym task (proximal.tasks.gym); its verifier is the generator's
#: own scorer.
GYM_VERIFIER = "proximal.rewards:reasoning_gym"
GYM_SCORES = {
    "exact_match": "proximal.tasks.gym:exact_match",
    "format_error": "proximal.tasks.gym:format_error",
}


def task_configs(task: str) -> Path:
    """The packaged configs of a built-in answer task: ``<configs>/arithmetic/``,
    ``<configs>/calculator/``, ``<configs>/reasoning_gym/`` (every reasoning-gym task)."""
    return DEFAULT_CONFIGS / ("reasoning_gym" if task in gym_task.TASKS else task)


#: The calculator task's no-tool baseline: GRPO from the SFT model that learned the teacher's
#: answers without the tool, trained without it (``<configs>/grpo_notool.yaml``), once per seed.
NO_TOOL = "notool"
#: A calculator turn's token limit at held-out evaluation (the configs' rollout.max_new_tokens).
CALCULATOR_TURN_TOKENS = 24


@dataclass
class CompareSection:
    task: str = option(
        "digits",
        "The built-in task compared when data.sft_model is unset: digits (sorting digits: a "
        "reward model, preference pairs, a verifier and a gold score), arithmetic (multi-step "
        "arithmetic with reference answers: the answer verifier, exact match as gold, format "
        "errors; no pairs, no reward model) or calculator (the tool task: the same columns plus "
        "tool calls and tool errors per trajectory, every method with the calculator tool, and "
        "a no-tool baseline row — GRPO from an SFT model without the tool), or "
        "reasoning_gym:chain_sum, reasoning_gym:basic_arithmetic (a reasoning-gym generator's "
        "questions, SFT on a sloppy teacher's answers, the generator's own scorer as the "
        "verifier; docs/tasks.md). Their configs are <configs>/arithmetic/, "
        "<configs>/calculator/ and <configs>/reasoning_gym/.",
    )
    methods: list[str] = option(
        help="Methods to train: ppo, dpo, simpo, grpo, rloo, and (never by default) gspo, cispo, "
        "reinforce_pp, reinforce_pp_baseline, distill (on-policy distillation of data.teacher "
        "into the SFT model); 'name@source' sets an online method's reward source, reward_model "
        "or verifier (default: ppo the reward model; grpo, rloo and the other grpo-command "
        "methods the verifier when there is one; distill the teacher alone, distill@verifier "
        "the teacher plus the verifier's reward). A method may be listed with several sources. "
        "Empty: the task's, ppo, dpo, simpo, grpo, rloo (digits, or your data) or ppo@verifier, "
        "grpo, rloo (arithmetic, calculator).",
        default_factory=list,
    )
    seeds: int = option(3, "Runs per method, with train.seed = 0, 1, …")
    responses: int = option(
        7680,
        "Budget of each online method (ppo, grpo, rloo, distill): responses sampled; its step "
        "count is this over the responses one step samples.",
    )
    pairs: int = option(
        16000,
        "Budget of each offline method (dpo, simpo): preference pairs trained on (4 passes "
        "over the built-in task's 4000); its step count is this over train.batch_size.",
    )
    evaluations: int = option(
        4,
        "Checkpoints evaluated along each run (evenly spaced; the last is the final "
        "policy), for the stability columns.",
    )
    collapse_margin: float = option(
        0.05,
        "A run collapsed if its final held-out score is more than this below its "
        "best evaluated one (the SFT model counts as the first).",
    )
    eval_samples_per_prompt: int = option(
        2, "Responses sampled per held-out prompt at each evaluation."
    )
    eval_pass_k: list[int] | None = option(
        None,
        "pass@k columns of the held-out evaluation, one per k (each ≤ "
        "compare.eval_samples_per_prompt), by the unbiased estimator of Chen et al. 2021, with "
        "mean@n and maj@n; they read the main held-out score (gold, else the verifier, else the "
        "reward model's proxy). null = none.",
    )
    eval_pass_threshold: float = option(
        1.0,
        "A held-out response passes when that score is at or above this (1.0: exact match; a "
        "fractional scorer needs its own).",
    )
    max_new_tokens: int | None = option(
        None,
        "Response length of the held-out evaluation (the methods' configs set their own "
        "for training); null: the built-in task's, 12 (digits), 32 (arithmetic), 24 per turn "
        "(calculator), 64 (reasoning_gym:*). Required with your own data (data.sft_model): no task's length is "
        "taken for it.",
    )
    reward_timeout_s: float | None = option(
        DEFAULT_TIMEOUT_S,
        "Bound on one call of a reward function (the verifier, the gold score), in seconds: "
        "each online method's model.reward_timeout_s and every held-out evaluation's. A call "
        "that runs past it ends the comparison with one line naming the function and the "
        "limit. null = no limit.",
    )
    model: dict | None = option(
        None,
        "The built-in task's base model: these keys merged over the task's default (llama, "
        "hidden 64, 2 layers, 4 heads; keys: " + ", ".join(SHAPE_KEYS) + "), e.g. {heads: 2}: "
        "hidden 64 as 2 heads of dimension 32, which vLLM's CPU attention runs (the default's "
        "16 it does not). Only with data.sft_model unset. null = the default.",
    )
    engine: str | None = option(
        None,
        "What samples every run's responses: hf or vllm, set as rollout.engine of the online "
        "methods (ppo, grpo, rloo, …) and as eval.engine of dpo and simpo (their sampled "
        "evaluations during training, where their config has eval.prompts). null = each "
        "method's config decides (hf in the packaged ones). The held-out evaluation of every "
        "checkpoint samples with hf whatever this says: one sampler for every run. vllm is "
        "checked (installed, the model's architecture and heads) before anything trains.",
        choices=(None, *ENGINES),
    )
    configs: str | None = option(
        None,
        "Directory holding <method>.yaml for each method (default: the packaged demo "
        "configs, tuned for the built-in task). Its data paths, seed, steps and "
        "output are set by compare.",
    )

    def response_limit(self) -> int:
        """``max_new_tokens`` of the held-out evaluation: the option, or the built-in task's (your
        own data has none: :meth:`CompareConfig.validate` requires the option)."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.task == CALCULATOR:
            return CALCULATOR_TURN_TOKENS
        if self.task in gym_task.TASKS:
            return gym_task.MAX_RESPONSE_TOKENS
        if self.task == ARITHMETIC:
            return arithmetic.MAX_RESPONSE_TOKENS
        return digits.MAX_RESPONSE_TOKENS

    def base_model(self) -> dict:
        """The built-in task's base model: ``model`` merged over the task's default."""
        return {**TASK_MODELS.get(self.task, digits.DEFAULT_MODEL), **(self.model or {})}

    def method_specs(self) -> list[str]:
        """The methods compared: ``methods``, or the task's when it is empty."""
        return list(self.methods) or list(TASKS.get(self.task, DEFAULT_METHODS))

    def problems(self) -> list[str]:
        e = []
        if self.task not in TASKS:
            e.append(
                f"compare.task: {self.task!r} is not a built-in task (known: {', '.join(TASKS)})"
            )
        for spec in self.methods:
            name, _, source = spec.partition("@")
            if name not in METHODS:
                e.append(f"compare.methods: {spec!r}: unknown method (known: {', '.join(METHODS)})")
            elif source and source not in METHODS[name].sources:
                allowed = (
                    ", ".join(METHODS[name].sources)
                    if METHODS[name].online
                    else "none (it trains on pairs)"
                )
                e.append(
                    f"compare.methods: {spec!r}: {METHODS[name].label} cannot use reward source {source!r} "
                    f"(it can use: {allowed})"
                )
        if len(set(self.methods)) != len(self.methods):
            e.append("compare.methods lists a method twice")
        for name in (
            "seeds",
            "responses",
            "pairs",
            "evaluations",
            "eval_samples_per_prompt",
            "max_new_tokens",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                e.append(f"compare.{name} = {getattr(self, name)} must be ≥ 1")
        e += pass_k_problems(
            self.eval_pass_k,
            self.eval_samples_per_prompt,
            self.eval_pass_threshold,
            k="compare.eval_pass_k",
            n="compare.eval_samples_per_prompt",
            threshold="compare.eval_pass_threshold",
        )
        if self.reward_timeout_s is not None and not self.reward_timeout_s > 0:
            e.append(
                f"compare.reward_timeout_s = {self.reward_timeout_s} must be > 0 seconds, or null "
                "for no limit"
            )
        if not self.collapse_margin >= 0:
            e.append(f"compare.collapse_margin = {self.collapse_margin} must be ≥ 0")
        if self.configs is not None and not Path(self.configs).is_dir():
            e.append(f"compare.configs: {self.configs!r} is not a directory")
        if self.model is not None:
            e += shape_problems(self.base_model(), "compare.model")
        return e


@dataclass
class CompareData:
    sft_model: str | None = option(
        None,
        "The SFT checkpoint every method starts from (and the reference of KL). "
        "Unset: the built-in digit-sorting task, trained first.",
    )
    reward_model: str | None = option(
        None,
        "The learned reward model r_ψ (the proxy score of every evaluation, and "
        "the reward of methods with source reward_model).",
    )
    prompts: str | None = option(
        None,
        "Training prompts of the online methods: a file (JSONL, JSON, Parquet, CSV, Arrow), a "
        "save_to_disk directory or a data set name in the local Hugging Face cache (docs/data.md).",
    )
    pairs: str | None = option(
        None,
        "Preference pairs of the offline methods, read as data.prompts is: the pairs the "
        "reward model was trained on.",
    )
    eval_pairs: str | None = option(
        None, "Held-out preference pairs: DPO's and SimPO's eval/accuracy (optional)."
    )
    teacher: str | None = option(
        None,
        "The teacher of compare.methods' distill runs (model.teacher of proximal distill): a "
        "checkpoint sharing the SFT model's tokenizer, usually an RL-trained stage output. "
        "Unset with the arithmetic task: GRPO from its SFT model, <configs>/teacher.yaml, "
        "trained into base/teacher first. Only read when distill is compared.",
    )
    eval_prompts: str | None = option(
        None,
        "Held-out prompts every policy is evaluated on, read as data.prompts is (but as they "
        "are: data.split and data.columns do not apply to them).",
    )
    verifier: str | None = option(
        None,
        "A rule verifier 'module:function(prompts, completions) -> scores': the "
        "reward of methods with source verifier, and a held-out column.",
    )
    gold: str | None = option(
        None,
        "The score we actually want, 'module:function' (where the task has one): "
        "logged during online training with weight 0, never trained on; the main "
        "held-out column and the one stability is measured on.",
    )
    # The shared SPLIT_HELP / COLUMNS_HELP say "this section"; here they cover the methods' data only.
    split: str | None = option(
        None,
        "The split to read where data.prompts, data.pairs or data.eval_pairs is a DatasetDict (a "
        "save_to_disk directory or a data set name in the local Hugging Face cache): null = "
        "'train'; a single file is one split. Handed to every method as its data.split. See "
        "docs/data.md.",
    )
    columns: dict[str, str] | None = option(
        None,
        "Column names of data.prompts, data.pairs and data.eval_pairs mapped to the names the "
        "methods read, canonical: column (e.g. {prompt: question, chosen: good, rejected: bad}). "
        "Handed to every method as its data.columns: to an online method every entry but the "
        "pairs' own (chosen, rejected), so a reference-answer column ({answer: solution}) reaches "
        "its reward functions. null = the columns as they are. See docs/data.md.",
    )

    def problems(self) -> list[str]:
        if self.sft_model is None:
            return []
        e = [] if self.eval_prompts else ["data.eval_prompts is required (the held-out prompts)"]
        for name in ("sft_model", "reward_model"):
            value = getattr(self, name)
            if value and not Path(value).exists():
                e.append(f"data.{name}: {value!r} does not exist")
        # a data set may also be a name in the local Hugging Face cache, as in every command
        for name in ("prompts", "pairs", "eval_pairs", "eval_prompts"):
            value = getattr(self, name)
            if value and (problem := source_problem(value, f"data.{name}")):
                e.append(problem)
        return e + columns_problems(self.columns, "data.columns")


@dataclass
class CompareOutput:
    dir: str = option(
        "compare_out",
        "Where compare.md, compare.json, plots/ and every run's directory (runs/) go.",
    )
    overwrite: bool = option(
        False,
        "Start afresh in an output.dir that holds a comparison with another config "
        "(the same config continues it).",
    )
    progress: bool = option(True, "Each run's progress bar.")


@dataclass
class CompareConfig:
    compare: CompareSection = section(
        CompareSection, "What is compared, on which budget, and how it is judged."
    )
    data: CompareData = section(CompareData, "The shared inputs.")
    output: CompareOutput = section(CompareOutput, "The output directory.")

    def validate(self) -> list[str]:
        e = self.compare.problems() + self.data.problems()
        if self.data.sft_model is not None and self.compare.model is not None:
            e.append(
                f"compare.model = {self.compare.model} shapes the built-in task's model, which "
                "data.sft_model replaces; leave compare.model unset with your own model"
            )
        if self.data.sft_model is not None and self.compare.task != "digits":
            e.append(
                f"compare.task = {self.compare.task} runs a built-in task, which needs "
                "data.sft_model unset; with your own data leave compare.task at digits"
            )
        if self.data.sft_model is None and self.compare.task in ANSWER_TASKS:
            task = self.compare.task
            for spec in self.compare.methods:
                name, _, source = spec.partition("@")
                if name not in METHODS or (source and source not in METHODS[name].sources):
                    continue  # already reported
                method, source = resolve(spec, have_verifier=True, have_reward_model=False)
                if source not in (VERIFIER, TEACHER):
                    e.append(
                        f"compare.methods: {spec!r}: the {task} task has a verifier only (no "
                        "preference pairs, no reward model); compare ppo@verifier, grpo, rloo, gspo, cispo, "
                        "reinforce_pp, reinforce_pp_baseline or distill"
                    )
        d = self.data
        distills = [s for s in self.compare.methods if s.partition("@")[0] == "distill"]
        if (
            distills
            and not d.teacher
            and not (d.sft_model is None and self.compare.task == ARITHMETIC)
        ):
            e.append(
                f"compare.methods: {distills[0]!r} distils a teacher into the SFT model: set "
                "data.teacher (a checkpoint sharing the SFT model's tokenizer; only the "
                "arithmetic task trains its own)"
            )
        if d.teacher and not Path(d.teacher).exists():
            e.append(f"data.teacher: {d.teacher!r} does not exist")
        if d.sft_model is not None and self.compare.max_new_tokens is None:
            e.append(
                "compare.max_new_tokens is required with your own data (data.sft_model): the "
                "held-out responses' token limit (only the built-in tasks have one of their own)"
            )
        if (
            self.compare.eval_pass_k
            and d.sft_model
            and not (d.gold or d.verifier or d.reward_model)
        ):
            e.append(
                f"compare.eval_pass_k = {self.compare.eval_pass_k} needs a held-out score to pass: "
                "set data.gold, data.verifier or data.reward_model"
            )
        if self.data.sft_model is not None:
            for spec in self.compare.method_specs():
                name, _, source = spec.partition("@")
                if name not in METHODS or (source and source not in METHODS[name].sources):
                    continue  # already reported
                method, source = resolve(spec, have_verifier=bool(self.data.verifier))
                if source == REWARD_MODEL and not self.data.reward_model:
                    e.append(
                        f"compare.methods: {spec!r} learns from the reward model: set data.reward_model"
                    )
                if source == VERIFIER and not self.data.verifier:
                    e.append(
                        f"compare.methods: {spec!r} learns from the verifier: set data.verifier"
                    )
                if method.online and not self.data.prompts:
                    e.append(f"compare.methods: {spec!r} samples responses: set data.prompts")
                if not method.online and not self.data.pairs:
                    e.append(
                        f"compare.methods: {spec!r} trains on preference pairs: set data.pairs"
                    )
        return sorted(set(e), key=e.index)


def resolve(
    spec: str, *, have_verifier: bool, have_reward_model: bool = True
) -> tuple[Method, str]:
    """``"grpo@reward_model"`` → (GRPO, "reward_model"); a bare name gets the method's default source
    (the verifier, where there is no reward model and the method can use one)."""
    name, _, source = spec.partition("@")
    method = METHODS[name]
    if not source and not have_reward_model and method.sources[0] == REWARD_MODEL:
        source = VERIFIER
    return method, source or method.default_source(have_verifier)


@dataclass(frozen=True)
class RunSpec:
    method: Method
    source: str
    seed: int
    variant: str = ""  # NO_TOOL: the calculator task's no-tool baseline

    @property
    def group(self) -> str:
        """The table row: the method, and its reward source when it has a choice (and the variant)."""
        name = self.method.name if self.source == PAIRS else f"{self.method.name}@{self.source}"
        return f"{name}-{self.variant}" if self.variant else name

    @property
    def name(self) -> str:
        return f"{self.group}-seed{self.seed}"

    @property
    def record(self) -> dict:
        return {
            "name": self.name,
            "group": self.group,
            "method": self.method.name,
            "source": self.source,
            "seed": self.seed,
        }


@dataclass
class Inputs:
    """The resolved shared inputs (paths as strings)."""

    sft: str
    reward_model: str | None
    prompts: str | None
    pairs: str | None
    eval_pairs: str | None
    eval_prompts: str
    verifier: str | None
    gold: str | None
    split: str | None = None  # of prompts, pairs and eval_pairs
    columns: dict[str, str] | None = None
    scores: dict = field(default_factory=dict)  # held-out score functions by column name
    sft_notool: str | None = None  # the calculator task's no-tool SFT model
    teacher: str | None = None  # the distill runs' teacher (data.teacher, or base/teacher)
    agent: dict = field(default_factory=dict)  # a run's env/tools for evaluate_policy (run_inputs)
    # held-out prompts longer than this keep their end: a built-in task's limit; your data: None,
    # every prompt whole, as long as the data makes it
    prompt_limit: int | None = None


def run_inputs(inputs: Inputs, r: RunSpec, run_cfg=None) -> Inputs:
    """The inputs of run ``r``: the no-tool baseline starts from (and is measured against) the
    no-tool SFT model; a run with env/tools (``run_cfg``'s, or for the calculator task its
    packaged GRPO stage's) is evaluated as trajectories with them."""
    if r.variant == NO_TOOL:
        return replace(inputs, sft=inputs.sft_notool, agent={})
    if inputs.sft_notool is not None:  # the calculator task: every other run has the tool
        agent = calculator_agent(run_cfg) if run_cfg is not None else inputs.agent
        return replace(inputs, agent=agent)
    return inputs


def plan(cfg: CompareConfig) -> list[RunSpec]:
    """Every run, seed-major (seed 0 of every method first: an interrupted comparison has a full row)."""
    have = bool(cfg.data.verifier) or cfg.data.sft_model is None
    builtin = cfg.data.sft_model is None
    no_rm = builtin and cfg.compare.task in ANSWER_TASKS
    specs = [
        (*resolve(s, have_verifier=have, have_reward_model=not no_rm), "")
        for s in cfg.compare.method_specs()
    ]
    if builtin and cfg.compare.task == CALCULATOR:
        specs.append((METHODS["grpo"], VERIFIER, NO_TOOL))
    return [RunSpec(m, src, seed, v) for seed in range(cfg.compare.seeds) for m, src, v in specs]


# ----------------------------------------------------------------------------------------------
# The comparison
# ----------------------------------------------------------------------------------------------


def run_compare(cfg: CompareConfig, *, echo: Callable[[str], None] = print) -> dict:
    """Prepare the inputs, train and evaluate every run, write the report; return ``compare.json``'s contents."""
    out = Path(cfg.output.dir)
    main = dist.launched_rank() == 0
    problems = engine_problems(cfg)  # before the output directory is touched, and any training
    if problems:
        raise ConfigError(problems[0])
    _take_output_dir(out, cfg, main)
    configs = Path(cfg.compare.configs) if cfg.compare.configs else DEFAULT_CONFIGS
    builtin = cfg.data.sft_model is None and cfg.compare.task in ANSWER_TASKS
    if builtin and not cfg.compare.configs:
        configs = task_configs(cfg.compare.task)
    runs = plan(cfg)
    if main:  # what the report reads: every planned run, started or not, in order
        (out / "plan.json").write_text(json.dumps([r.record for r in runs], indent=1) + "\n")
    t_start = time.perf_counter()

    echo(
        f"proximal compare: {len(runs)} runs ({', '.join(dict.fromkeys(r.group for r in runs))} × "
        f"{cfg.compare.seeds} seeds) into {out}"
    )
    inputs = prepare_inputs(cfg, out, configs, echo=echo)
    # Every run's config is built (and validated) before the first trains: a mistake in any is found now.
    run_cfgs = {r.name: run_config(r, cfg, inputs, configs, out / "runs" / r.name) for r in runs}

    for i, r in enumerate(runs, 1):
        run_dir = out / "runs" / r.name
        status_file = run_dir / "compare_run.json"
        if _finished(run_dir):
            echo(f"[{i}/{len(runs)}] {r.name}: finished earlier, kept")
            continue
        run_cfg, steps, budget = run_cfgs[r.name]
        # an unfinished or failed attempt: start the run again from nothing
        if main and run_dir.exists():
            shutil.rmtree(run_dir)
        dist.barrier()
        echo(
            f"[{i}/{len(runs)}] {r.name}: {r.method.label} ({r.source.replace('_', ' ')}), {steps} steps = {budget}"
        )
        t0 = time.perf_counter()
        status = {
            **r.record,
            "steps": steps,
            "budget": budget,
            "responses_per_step": responses_per_step(r.method, run_cfg),
            "status": "ok",
            "error": None,
        }
        try:
            trainer(r.method.command)(run_cfg)
            status["run_s"] = time.perf_counter() - t0
            if main:
                variant = run_inputs(inputs, r, run_cfg)
                evaluate_run(
                    run_dir,
                    variant,
                    cfg.compare,
                    sft_eval=_sft_evaluation(out, variant, cfg.compare, r.variant),
                )
            dist.barrier()
            status["eval_s"] = time.perf_counter() - t0 - status["run_s"]
            echo(f"      trained in {status['run_s']:.0f} s, evaluated in {status['eval_s']:.0f} s")
        except signals.Stopped as e:  # pre-empted: the run's own line would say --resume, which
            # compare has not; the same command line continues the comparison instead
            raise signals.Stopped(
                f"{signals.name(e.signum)} received during run {r.name} ({i} of {len(runs)}): "
                "stopped; the same proximal compare command line continues the comparison (the "
                f"runs finished before it are kept; {r.name} starts again from its first step)",
                e.signum,
                everywhere=e.everywhere,
            ) from e
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - a failed run is a row of the table, never a lost comparison
            status.update(status="failed", error=_one_line(e), run_s=time.perf_counter() - t0)
            if main:
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "error.txt").write_text("".join(traceback.format_exception(e)))
            echo(f"      FAILED: {status['error']}")
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            status_file.write_text(json.dumps(status, indent=1) + "\n")
        _release_memory()

    result = {}
    if main:
        echo("report: reading every run directory")
        result = compare_report.write_report(out, total_s=time.perf_counter() - t_start)
        echo("\n" + compare_report.terminal_summary(result))
    dist.barrier()
    return result


def _answer_task_inputs(
    base: Path, verifier: str, scores: dict, *, prompt_limit: int = EVAL_PROMPT_TOKENS, **extra
) -> Inputs:
    """The inputs of a built-in task with reference answers trained into ``base`` (arithmetic,
    calculator): its SFT model, prompts and held-out prompts, no reward model and no pairs; the
    held-out columns exact match (gold) and format errors — the verifier's own column would repeat
    the gold one, since on this data its reference is the expression's value."""
    task = base / "task"
    return Inputs(
        sft=str(base / "sft"),
        reward_model=None,
        prompts=str(task / "prompts_train.jsonl"),
        pairs=None,
        eval_pairs=None,
        eval_prompts=str(task / "prompts_eval.jsonl"),
        verifier=verifier,
        gold=scores["exact_match"],
        scores={"gold": scores["exact_match"], "format_error": scores["format_error"]},
        prompt_limit=prompt_limit,
        **extra,
    )


def prepare_inputs(
    cfg: CompareConfig, out: Path, configs: Path, *, echo: Callable[[str], None]
) -> Inputs:
    """The shared inputs: the config's, or the built-in task trained into ``<out>/base``; with
    distill compared, its teacher (``data.teacher``, or on the arithmetic task one trained into
    ``<out>/base/teacher``)."""
    inputs = _prepare_inputs(cfg, out, configs, echo=echo)
    if not any(s.partition("@")[0] == "distill" for s in cfg.compare.method_specs()):
        return inputs
    teacher = cfg.data.teacher
    if teacher is None:  # validate() allows it on the arithmetic task only
        teacher = str(
            train_teacher(
                out / "base", configs, inputs, cfg.compare, echo=echo, progress=cfg.output.progress
            )
        )
    return replace(inputs, teacher=teacher)


def train_teacher(
    base: Path,
    configs: Path,
    inputs: Inputs,
    c: CompareSection,
    *,
    echo: Callable[[str], None],
    progress: bool = True,
) -> Path:
    """The built-in task's distillation teacher: ``<configs>/teacher.yaml`` (a ``proximal grpo``
    config: GRPO on the verifier from the SFT model, trained longer than the compared runs), seed 0,
    into ``base/teacher`` (its final policy is exported there); kept from an earlier comparison when
    complete. Its held-out evaluation goes to ``base/teacher_eval.json`` (the report's teacher line)."""
    run_dir, done = base / "teacher", base / "teacher.json"
    if done.is_file():
        echo(f"inputs: the distillation teacher from {run_dir} (trained earlier)")
        return run_dir
    path = configs / "teacher.yaml"
    if not path.is_file():
        path = task_configs(c.task) / "teacher.yaml"
    grpo = METHODS["grpo"]
    overrides = {
        **input_overrides(
            grpo,
            VERIFIER,
            sft=inputs.sft,
            prompts=inputs.prompts,
            verifier=inputs.verifier,
            gold=inputs.gold,
        ),
        "model.reward_timeout_s": c.reward_timeout_s,
        "train.seed": 0,
        "output.dir": str(run_dir),
        "output.overwrite": True,
        "output.progress": progress,
    }
    teacher_cfg = load_config(config_class("grpo"), path, overrides)
    echo(
        f"inputs: training the distillation teacher ({path}, {teacher_cfg.train.steps} steps) into {run_dir}"
    )
    t0 = time.perf_counter()
    trainer("grpo")(teacher_cfg)
    train_s = time.perf_counter() - t0
    if dist.launched_rank() == 0:
        ev = evaluate_policy(
            run_dir,
            reference=inputs.sft,
            prompts_file=inputs.eval_prompts,
            scores=inputs.scores,
            samples_per_prompt=c.eval_samples_per_prompt,
            max_new_tokens=c.response_limit(),
            max_prompt_length=inputs.prompt_limit,
            seed=0,
            timeout_s=c.reward_timeout_s,
            **_pass_kwargs(inputs, c),
        )
        (base / "teacher_eval.json").write_text(json.dumps(ev) + "\n")
        done.write_text(
            json.dumps({"seed": 0, "steps": teacher_cfg.train.steps, "s": train_s}) + "\n"
        )
    dist.barrier()
    return run_dir


def _prepare_inputs(
    cfg: CompareConfig, out: Path, configs: Path, *, echo: Callable[[str], None]
) -> Inputs:
    d = cfg.data
    if d.sft_model is None and cfg.compare.task == CALCULATOR:
        base = train_builtin_calculator(
            out / "base", configs, echo=echo, model=cfg.compare.base_model()
        )
        # With the tool, each trajectory's tool calls and tool errors too: the tool runs are
        # evaluated as trajectories with their own tool settings (run_inputs); the no-tool
        # baseline against its own SFT model.
        return _answer_task_inputs(
            base, CALCULATOR_VERIFIER, CALCULATOR_SCORES, sft_notool=str(base / "sft_notool")
        )
    if d.sft_model is None and cfg.compare.task == ARITHMETIC:
        base = train_builtin_arithmetic(
            out / "base", configs, echo=echo, model=cfg.compare.base_model()
        )
        return _answer_task_inputs(base, ARITHMETIC_VERIFIER, ARITHMETIC_SCORES)
    builtin = d.sft_model is None
    if builtin and cfg.compare.task in gym_task.TASKS:
        base = train_builtin_gym(
            out / "base", cfg.compare.task, configs, echo=echo, model=cfg.compare.base_model()
        )
        return _answer_task_inputs(
            base, GYM_VERIFIER, GYM_SCORES, prompt_limit=gym_task.MAX_PROMPT_TOKENS
        )
    if builtin:
        base = train_builtin(out / "base", configs, echo=echo, model=cfg.compare.base_model())
        task = base / "task"
        d = CompareData(
            sft_model=str(base / "sft"),
            reward_model=str(base / "rm"),
            prompts=str(task / "prompts_train.jsonl"),
            pairs=str(task / "prefs_train.jsonl"),
            eval_pairs=str(task / "prefs_eval.jsonl"),
            eval_prompts=str(task / "prompts_eval.jsonl"),
            verifier=BUILTIN_VERIFIER,
            gold=BUILTIN_GOLD,
        )
    scores = {
        **({"gold": d.gold} if d.gold else {}),
        **({"verifier": d.verifier} if d.verifier else {}),
    }
    return Inputs(
        sft=d.sft_model,
        reward_model=d.reward_model,
        prompts=d.prompts,
        pairs=d.pairs,
        eval_pairs=d.eval_pairs,
        eval_prompts=d.eval_prompts,
        verifier=d.verifier,
        gold=d.gold,
        split=d.split,
        columns=d.columns,
        scores=scores,
        prompt_limit=EVAL_PROMPT_TOKENS if builtin else None,
    )


def train_builtin(
    base: Path, configs: Path, *, echo: Callable[[str], None], model: dict | None = None
) -> Path:
    """The built-in task's data, SFT model and reward model, as ``proximal demo`` makes them (seed 0;
    ``model``: the base model's shape, ``compare.model`` merged over the task's default); kept from
    an earlier comparison when complete."""
    done = base / "base.json"
    if done.is_file():
        echo(f"inputs: the built-in task, SFT and reward model from {base} (trained earlier)")
        return base
    echo(f"inputs: the built-in digit-sorting task; training its SFT and reward models into {base}")
    t0 = time.perf_counter()
    if dist.launched_rank() == 0:
        make_task_data(base / "task", 0, model=model)
    dist.barrier()
    demo_configs = (
        configs
        if all((configs / f"{n}.yaml").is_file() for n in ("sft", "rm"))
        else DEFAULT_CONFIGS
    )
    stages = stage_configs(demo_configs, base, 0, FULL, only=("sft", "rm"))
    for name, fn in (("sft", sft.train), ("rm", reward.train)):
        stage_cfg, line = stages[name]
        echo(f"      {name}: {line}")
        fn(stage_cfg)
    if dist.launched_rank() == 0:
        done.write_text(json.dumps({"seed": 0, "s": time.perf_counter() - t0}) + "\n")
    return base


def train_builtin_calculator(
    base: Path, configs: Path, *, echo: Callable[[str], None], model: dict | None = None
) -> Path:
    """The calculator task's data and its two SFT models (with the tool; the no-tool baseline's), as
    ``proximal demo`` makes them (seed 0; ``model``: the base model's shape); kept from an earlier
    comparison when complete.
    ``configs`` holds sft.yaml and sft_notool.yaml (else the packaged ones)."""
    done = base / "base.json"
    if done.is_file():
        echo(f"inputs: the calculator task and its SFT models from {base} (trained earlier)")
        return base
    echo(f"inputs: the built-in calculator task; training its two SFT models into {base}")
    t0 = time.perf_counter()
    if dist.launched_rank() == 0:
        calculator.make_task_data(base / "task", 0, model=model)
    dist.barrier()
    names = ("sft", "sft_notool", "ppo", "grpo", "rloo", "grpo_notool")
    demo_configs = (
        configs
        if all((configs / f"{n}.yaml").is_file() for n in names)
        else DEFAULT_CONFIGS / CALCULATOR
    )
    stages = calculator_stage_configs(demo_configs, base, 0, FULL)
    for name in ("sft", "sft_notool"):
        stage_cfg, line = stages[name]
        echo(f"      {name}: {line}")
        sft.train(stage_cfg)
    if dist.launched_rank() == 0:
        done.write_text(json.dumps({"seed": 0, "s": time.perf_counter() - t0}) + "\n")
    return base


def train_builtin_arithmetic(
    base: Path, configs: Path, *, echo: Callable[[str], None], model: dict | None = None
) -> Path:
    """The arithmetic task's data and SFT model, as ``proximal demo`` makes them (seed 0; ``model``:
    the base model's shape); kept from an earlier comparison when complete. ``configs`` holds its
    sft.yaml (else the packaged one's)."""
    done = base / "base.json"
    if done.is_file():
        echo(f"inputs: the arithmetic task and its SFT model from {base} (trained earlier)")
        return base
    echo(f"inputs: the built-in arithmetic task; training its SFT model into {base}")
    t0 = time.perf_counter()
    if dist.launched_rank() == 0:
        arithmetic.make_task_data(base / "task", 0, model=model)
    dist.barrier()
    demo_configs = (
        configs
        if all((configs / f"{n}.yaml").is_file() for n in ("sft", "ppo", "grpo", "rloo"))
        else DEFAULT_CONFIGS / ARITHMETIC
    )
    stage_cfg, line = arithmetic_stage_configs(demo_configs, base, 0, FULL)["sft"]
    echo(f"      sft: {line}")
    sft.train(stage_cfg)
    if dist.launched_rank() == 0:
        done.write_text(json.dumps({"seed": 0, "s": time.perf_counter() - t0}) + "\n")
    return base


def engine_overrides(method: Method, engine: str | None) -> dict[str, str]:
    """``compare.engine`` in a run's config: an online method's ``rollout.engine`` (its rollouts and,
    through eval.engine null, its sampled evaluations), an offline method's ``eval.engine`` (it
    samples only there); none where it is null."""
    if engine is None:
        return {}
    return {"rollout.engine" if method.online else "eval.engine": engine}


def engine_problems(cfg: CompareConfig) -> list[str]:
    """With ``compare.engine: vllm``, why vLLM cannot run the runs' policy (one line each: not
    installed, an architecture it lacks, heads its CPU attention does not run), read from the
    configs alone, before anything trains: the SFT checkpoint given, or the built-in task's base
    model as ``compare.model`` shapes it. On the CPU unless a GPU is here (the packaged configs'
    train.device is cpu; a run on a GPU is checked again when it starts)."""
    if cfg.compare.engine != "vllm":
        return []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.data.sft_model is not None:
        return preflight_problems(cfg.data.sft_model, device=device, field="compare.engine")
    shape = cfg.compare.base_model()
    # the vocabulary plays no part in the check: the architecture and the heads do
    config = tiny_causal_lm_config(
        shape["arch"], 16, **{k: v for k, v in shape.items() if k != "arch"}
    )
    wider = shape["hidden"] // 32  # heads of dimension 32, where the hidden size allows
    return [
        f"{p}; or give the task's model heads it runs: --compare.model '{{heads: {wider}}}'"
        if "attention heads" in p and wider >= 1 and shape["hidden"] % 32 == 0
        else p
        for p in config_problems(config, device=device, field="compare.engine")
    ]


def train_builtin_gym(
    base: Path, task: str, configs: Path, *, echo: Callable[[str], None], model: dict | None = None
) -> Path:
    """A reasoning-gym task's data and SFT model (:mod:`proximal.tasks.gym`, seed 0); kept from an
    earlier comparison when complete. ``configs`` holds its sft.yaml (else the packaged one's)."""
    done = base / "base.json"
    if done.is_file():
        echo(f"inputs: the {task} task and its SFT model from {base} (trained earlier)")
        return base
    name = gym_task.generator(task)
    echo(f"inputs: the {task} task (reasoning-gym's {name}); training its SFT model into {base}")
    t0 = time.perf_counter()
    if dist.launched_rank() == 0:
        gym_task.make_task_data(base / "task", name, 0, model=model)
    dist.barrier()
    demo_configs = (
        configs
        if all((configs / f"{n}.yaml").is_file() for n in ("sft", "ppo", "grpo", "rloo"))
        else task_configs(task)
    )
    stage_cfg, line = gym_stage_configs(demo_configs, base, 0)["sft"]
    echo(f"      sft: {line}")
    sft.train(stage_cfg)
    if dist.launched_rank() == 0:
        done.write_text(json.dumps({"seed": 0, "s": time.perf_counter() - t0}) + "\n")
    return base


def run_config(r: RunSpec, cfg: CompareConfig, inputs: Inputs, configs: Path, run_dir: Path):
    """``(config, steps, budget in words)`` of one run: ``<configs>/<method>.yaml`` with the shared
    inputs, the seed, the budget's step count and a checkpoint every steps/evaluations steps."""

    path = configs / f"{r.method.name}{'_' + r.variant if r.variant else ''}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"compare.configs: {path} not found (one <method>.yaml per method compared)"
        )
    cls = config_class(r.method.command)
    overrides = {
        **input_overrides(
            r.method,
            r.source,
            sft=run_inputs(inputs, r).sft,
            reward_model=inputs.reward_model,
            prompts=inputs.prompts,
            pairs=inputs.pairs,
            eval_pairs=inputs.eval_pairs,
            verifier=inputs.verifier,
            gold=inputs.gold,
            split=inputs.split,
            columns=inputs.columns,
            teacher=inputs.teacher,
        ),
        **({"model.reward_timeout_s": cfg.compare.reward_timeout_s} if r.method.online else {}),
        **engine_overrides(r.method, cfg.compare.engine),
        "train.seed": r.seed,
        "output.dir": str(run_dir),
        "output.overwrite": True,
        "output.progress": cfg.output.progress,
    }
    try:
        first = load_config(cls, path, overrides)
        steps, budget = budget_steps(
            r.method, first, responses=cfg.compare.responses, pairs=cfg.compare.pairs
        )
        # ceil: at most `evaluations` checkpoints, the last at `steps`
        every = -(-steps // cfg.compare.evaluations)
        run_cfg = load_config(
            cls,
            path,
            {
                **overrides,
                "train.steps": steps,
                "train.save_every": every,
                "train.keep_checkpoints": steps // every + 1,
            },
        )
        warmup = getattr(getattr(run_cfg, "optim", None), "warmup_steps", 0)
        if warmup >= steps:  # the trainer would find it only when its turn comes
            raise ConfigError(
                f"optim.warmup_steps = {warmup} must be less than the {steps} steps of the budget "
                f"({budget}); raise the budget or lower the warm-up in {path}"
            )
        return run_cfg, steps, budget
    except ConfigError as e:
        raise ConfigError(f"{r.name} ({path}): {e}") from None


# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------


def _sft_evaluation(out: Path, inputs: Inputs, c: CompareSection, variant: str = "") -> dict:
    """The SFT model's held-out evaluation (every curve's first point), computed once; the no-tool
    baseline's SFT model's in ``sft_notool_eval.json``."""
    path = out / f"sft{'_' + variant if variant else ''}_eval.json"
    if path.is_file():
        return json.loads(path.read_text())
    ev = evaluate_policy(
        inputs.sft,
        reference=inputs.sft,
        prompts_file=inputs.eval_prompts,
        reward_model=inputs.reward_model,
        scores=inputs.scores,
        samples_per_prompt=c.eval_samples_per_prompt,
        max_new_tokens=c.response_limit(),
        max_prompt_length=inputs.prompt_limit,
        seed=0,
        timeout_s=c.reward_timeout_s,
        **_agent_kwargs(inputs),
        **_pass_kwargs(inputs, c),
    )
    path.write_text(json.dumps(ev) + "\n")
    return ev


def evaluate_run(run_dir: Path, inputs: Inputs, c: CompareSection, *, sft_eval: dict) -> dict:
    """Evaluate every checkpoint of a finished run on the held-out prompts; write ``run_dir/eval.json``:
    ``curve`` (step 0 = the SFT model, then each checkpoint: held-out means) and ``final`` (the last
    checkpoint's evaluation with every response)."""
    curve = [{"step": 0, "policy": inputs.sft, "mean": sft_eval["mean"]}]
    final = None
    for step, policy in checkpoint_policies(run_dir):
        ev = evaluate_policy(
            policy,
            reference=inputs.sft,
            prompts_file=inputs.eval_prompts,
            reward_model=inputs.reward_model,
            scores=inputs.scores,
            samples_per_prompt=c.eval_samples_per_prompt,
            max_new_tokens=c.response_limit(),
            max_prompt_length=inputs.prompt_limit,
            seed=0,
            timeout_s=c.reward_timeout_s,
            **_agent_kwargs(inputs),
            **_pass_kwargs(inputs, c),
        )
        curve.append({"step": step, "policy": str(policy), "mean": ev["mean"]})
        final = ev
    if final is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint to evaluate")
    result = {"curve": curve, "final": final}
    tmp = run_dir / "eval.json.tmp"
    tmp.write_text(json.dumps(result) + "\n")
    tmp.replace(run_dir / "eval.json")  # a run counts as finished only once this file is whole
    return result


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _pass_kwargs(inputs: Inputs, c: CompareSection) -> dict:
    """``evaluate_policy``'s pass@k arguments (none without ``compare.eval_pass_k``): the main
    held-out score — gold, else the verifier, else the reward model's proxy, as the report's
    stability column chooses."""
    if not c.eval_pass_k:
        return {}
    score = next((k for k in ("gold", "verifier") if k in inputs.scores), "proxy")
    return dict(pass_k=c.eval_pass_k, pass_threshold=c.eval_pass_threshold, pass_score=score)


def _agent_kwargs(inputs: Inputs) -> dict:
    """``evaluate_policy``'s ``env`` and ``tools`` for a run with them (trajectories), else none."""
    return dict(inputs.agent) if inputs.agent else {}


def _finished(run_dir: Path) -> bool:
    status = run_dir / "compare_run.json"
    return (
        (run_dir / "eval.json").is_file()
        and status.is_file()
        and json.loads(status.read_text())["status"] == "ok"
    )


def _take_output_dir(out: Path, cfg: CompareConfig, main: bool) -> None:
    """Write ``compare_config.yaml``; an ``output.dir`` holding a comparison with another config is
    refused (or, with ``output.overwrite``, emptied); with the same config it is continued."""
    saved = out / "compare_config.yaml"
    mine = to_dict(cfg)

    def same(d):
        return {k: v for k, v in d.items() if k != "output"} == {
            k: v for k, v in mine.items() if k != "output"
        }

    if saved.is_file() and not same(yaml.safe_load(saved.read_text()) or {}):
        if not cfg.output.overwrite:
            raise FileExistsError(
                f"output.dir {out} holds a comparison with another config ({saved}); use another "
                "output.dir, or --output.overwrite true to replace it"
            )
        if main:
            for p in (
                "runs",
                "base",
                "plots",
                "compare.md",
                "compare.json",
                "sft_eval.json",
                "plan.json",
            ):
                target = out / p
                shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    elif out.is_dir() and not saved.is_file() and any(out.iterdir()):
        raise ConfigError(
            f"output.dir = {out} is not empty and holds no comparison (no compare_config.yaml); "
            "refusing to write into it"
        )
    if main:
        out.mkdir(parents=True, exist_ok=True)
        saved.write_text(yaml.safe_dump(mine, sort_keys=False))
    dist.barrier()


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(e).__name__}: {first}"[:300]


def _release_memory() -> None:
    """Between runs: drop the last run's objects and hand glibc's kept heap back to the system, so the
    next run's resident-set peak is its own."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def compare(cfg: CompareConfig) -> tuple[Path, dict]:
    """:func:`run_compare`, with rank 0 speaking for the comparison under torchrun; ``(output.dir,
    compare.json's contents)``."""
    echo = print if dist.launched_rank() == 0 else (lambda line: None)
    return Path(cfg.output.dir), run_compare(cfg, echo=echo)


def failed_runs(finished: tuple[Path, dict]) -> str | None:
    """The line that says some runs of a finished comparison failed (exit status 1), or None."""
    out, result = finished
    failed = [f["name"] for row in result.get("table", []) for f in row["failed"]]
    if not failed:
        return None
    return (
        f"{len(failed)} of {len(result['runs'])} runs failed ({', '.join(failed)}); their errors are "
        f"in the table of {out / 'compare.md'} and in each run's error.txt"
    )


def cli(argv: list[str]) -> int:
    return config_command(
        argv,
        prog="compare",
        description="PPO, DPO, SimPO, GRPO and RLOO from one SFT model on matched budgets, over several "
        "seeds, evaluated alike on held-out prompts; writes compare.md, compare.json and plots. "
        "Without data.sft_model: the built-in digit-sorting task.",
        config_cls=CompareConfig,
        train=compare,
        resume=False,
        config_help="YAML file with the compare, data and output sections",
        summary=lambda finished: None,  # run_compare has printed the tables
        failed=failed_runs,
        reported_once=(ConfigError, FileExistsError),
    )
