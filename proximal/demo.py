"""``proximal demo``: the whole of RLHF offline on a CPU — SFT → reward model → PPO, and DPO, SimPO,
GRPO and RLOO from the same SFT model — with a report.

The task is the built-in digit-sorting task (:mod:`proximal.tasks.digits`), whose gold score is known
exactly, so the report can show what RLHF's own numbers cannot: whether the policy got *better*, or
only better at pleasing the reward model. Five stages, each printed as it runs:

1. **task** — write the data, the character tokenizer and a random tiny llama (``<out>/task``);
2. **sft** — fine-tune it on a sloppy teacher's demonstrations (``proximal sft``, ``configs/demo/sft.yaml``);
3. **rm** — fit a Bradley–Terry reward model to noisy preference labels, starting from the SFT model
   (``proximal rm``, ``configs/demo/rm.yaml``);
4. **ppo** — PPO with a sane β, critic initialised from the reward model (``configs/demo/ppo.yaml``),
   and the same run with a tiny β (``configs/demo/ppo_overopt.yaml``) to show over-optimisation;
5. **dpo**, **simpo** — offline, on the very preference pairs the reward model was fitted to;
   **grpo**, **rloo** — online and critic-free, rewarded by the task's exact-sort verifier;
6. **arithmetic** — the built-in reasoning task (:mod:`proximal.tasks.arithmetic`): its data with
   reference answers, SFT on a sloppy teacher's worked solutions, then PPO, GRPO and RLOO from that
   SFT model, each rewarded by the answer verifier (``configs/demo/arithmetic/``, run directories
   under ``<out>/arithmetic/``);
7. **calculator** — the built-in tool task (:mod:`proximal.tasks.calculator`): SFT on a sloppy
   teacher's conversations that call a ``calculator`` tool, then PPO (critic across turns), GRPO
   and RLOO from that SFT model with the tool, each rewarded by the verifier over the whole
   trajectory; and the no-tool baseline — SFT on the same teacher's answers alone, then GRPO
   without the tool (``configs/demo/calculator/``, runs under ``<out>/calculator/``);
8. **eval + report** — sample every policy on held-out prompts (the tool policies as multi-turn
   trajectories), score them with the gold score, the reward model (digits), exact match and
   format errors (arithmetic, calculator), tool calls and tool errors (calculator) and the KL to
   the SFT model, and write ``<out>/report.md`` with plots.

Every trainer is the one its command (``sft``, ``rm``, ``ppo``, ``dpo``, ``simpo``, ``grpo``) runs,
loaded from the YAML files
with the paths filled in as ``--section.key value`` overrides; the demo prints each stage's
equivalent command line. ``--quick`` shrinks data and steps for CI (about a minute or two).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from proximal import report
from proximal.commands import config_class
from proximal.config import ConfigError, load_config
from proximal.evaluation import evaluate_policy, reward_model_gold_agreement  # noqa: F401 (the demo's API)
from proximal.logging import read_metrics
from proximal.methods import METHODS, final_policy, input_overrides
from proximal.tasks import arithmetic, calculator, digits
from proximal.tasks.digits import make_task_data
from proximal.train.command import run_reporting
from proximal.trainers import dpo, grpo, ppo, reward, sft

#: The demo's YAML configs, shipped inside the package (so a plain ``pip install`` runs the demo).
DEFAULT_CONFIGS = Path(__file__).resolve().parent / "configs" / "demo"
GOLD_FN = "proximal.tasks.digits:gold_score"
#: The held-out evaluations' prompt limit in tokens, every task's (the demo's and the comparison's):
#: longer than any built-in task's prompt; a longer prompt of the user's data keeps its end.
EVAL_PROMPT_TOKENS = 64
VERIFIER_FN = "proximal.tasks.digits:exact_sort"
RUNS = ("ppo", "ppo_overopt")
#: The other methods, each from the same SFT model (:mod:`proximal.methods`).
ALTERNATIVES = ("dpo", "simpo", "grpo", "rloo")
STAGES = ("sft", "rm", *RUNS, *ALTERNATIVES)
#: The arithmetic reasoning task's stages, configs in ``<configs>/arithmetic/``, runs in ``<out>/arithmetic/``:
#: SFT, then PPO, GRPO and RLOO from it, each rewarded by the answer verifier.
ARITHMETIC = "arithmetic"
ARITHMETIC_RUNS = ("ppo", "grpo", "rloo")
ARITHMETIC_STAGES = ("sft", *ARITHMETIC_RUNS)
ARITHMETIC_VERIFIER = "proximal.tasks.arithmetic:verify"
#: Held-out columns of the arithmetic task: the gold exact match (the expression's own value) and
#: the share of responses with no readable answer.
ARITHMETIC_SCORES = {
    "exact_match": "proximal.tasks.arithmetic:exact_match",
    "format_error": "proximal.tasks.arithmetic:format_error",
}
#: The calculator tool task's stages, configs in ``<configs>/calculator/``, runs in
#: ``<out>/calculator/``: SFT on the teacher's tool-using conversations, then PPO (critic across
#: turns), GRPO and RLOO from it with the calculator tool; and the no-tool baseline — SFT on the
#: teacher's answers alone, then GRPO without the tool. Every run is rewarded by the verifier.
CALCULATOR = "calculator"
CALCULATOR_RUNS = ("ppo", "grpo", "rloo")
CALCULATOR_NOTOOL = ("sft_notool", "grpo_notool")
CALCULATOR_STAGES = ("sft", *CALCULATOR_RUNS, *CALCULATOR_NOTOOL)
CALCULATOR_VERIFIER = "proximal.tasks.calculator:verify"
#: Held-out columns of the calculator task besides the trajectories' own (tool calls, errors, turns).
CALCULATOR_SCORES = {
    "exact_match": "proximal.tasks.calculator:exact_match",
    "format_error": "proximal.tasks.calculator:format_error",
}
#: Every stage the demo prints, the three tasks' data and the final evaluation included.
N_STAGES = 1 + len(STAGES) + len(ARITHMETIC_STAGES) + len(CALCULATOR_STAGES) + 1


@dataclass(frozen=True)
class Plan:
    """Sizes of one demo: the task's data and the overrides applied on top of the YAML configs."""

    task: dict
    sft: dict
    rm: dict
    ppo: dict
    ppo_overopt: dict
    dpo: dict
    simpo: dict
    grpo: dict
    rloo: dict
    eval_samples_per_prompt: int
    #: The arithmetic task: ``task`` (make_task_data's sizes) and each stage's overrides.
    arithmetic: dict
    #: The calculator tool task: ``task`` (make_task_data's sizes) and each stage's overrides.
    calculator: dict


FULL = Plan(
    task={},
    sft={},
    rm={},
    ppo={},
    ppo_overopt={},
    dpo={},
    simpo={},
    grpo={},
    rloo={},
    eval_samples_per_prompt=4,
    arithmetic={"task": {}, **{name: {} for name in ARITHMETIC_STAGES}},
    calculator={"task": {}, **{name: {} for name in CALCULATOR_STAGES}},
)

#: The CI-sized demo: every stage and artifact, a fraction of the data and steps. Its numbers show the
#: plumbing works, not that RLHF does (for that, run the full demo).
QUICK = Plan(
    task=dict(
        n_sft_train=1024,
        n_sft_eval=64,
        n_prefs_train=1024,
        n_prefs_eval=128,
        n_prompts_train=256,
        n_prompts_eval=64,
    ),
    sft={"train.steps": 150, "optim.warmup_steps": 10, "train.eval_every": 50},
    rm={"train.steps": 100, "optim.warmup_steps": 10, "train.eval_every": 50},
    ppo={"train.steps": 12},
    ppo_overopt={"train.steps": 12},
    dpo={"train.steps": 30, "optim.warmup_steps": 5},
    simpo={"train.steps": 30, "optim.warmup_steps": 5},
    grpo={"train.steps": 12},
    rloo={"train.steps": 12},
    eval_samples_per_prompt=1,
    arithmetic={
        "task": dict(n_sft_train=1024, n_sft_eval=64, n_prompts_train=256, n_prompts_eval=64),
        "sft": {"train.steps": 150, "optim.warmup_steps": 10, "train.eval_every": 50},
        "ppo": {"train.steps": 6},
        "grpo": {"train.steps": 6},
        "rloo": {"train.steps": 6},
    },
    # The calculator's quick stages are a few seconds each: the plumbing (tools, trajectories,
    # the evaluation's columns), not learning.
    calculator={
        "task": dict(n_sft_train=128, n_sft_eval=16, n_prompts_train=64, n_prompts_eval=16),
        "sft": {"train.steps": 20, "optim.warmup_steps": 2, "train.eval_every": 10},
        "sft_notool": {"train.steps": 20, "optim.warmup_steps": 2, "train.eval_every": 10},
        "ppo": {
            "train.steps": 2,
            "rollout.batch_size": 8,
            "ppo.mini_batch_size": 8,
            "ppo.micro_batch_size": 8,
        },
        **{
            name: {
                "train.steps": 2,
                "rollout.batch_size": 2,
                "rollout.group_size": 4,
                "grpo.mini_batch_size": 8,
                "grpo.micro_batch_size": 8,
            }
            for name in ("grpo", "rloo", "grpo_notool")
        },
    },
)


# ----------------------------------------------------------------------------------------------
# The pipeline
# ----------------------------------------------------------------------------------------------


def run_demo(
    out_dir: str | Path = "demo_out",
    quick: bool = False,
    seed: int = 0,
    *,
    configs: str | Path | None = None,
    echo: Callable[[str], None] = print,
) -> dict:
    """Run every stage into ``out_dir`` and write the report; return the report's numbers.

    The returned dict is ``report.json`` (:func:`proximal.report.collect`): held-out means per policy
    (``heldout``), the reward model's held-out accuracy (``rm``), the per-step PPO curves (``runs``),
    the over-optimisation summary (``overopt``), timings and the paths of the report and its plots.
    Raises ConfigError for a bad config file, DataError / ModelLoadError for bad inputs.
    """
    out = Path(out_dir)
    configs = Path(configs) if configs is not None else DEFAULT_CONFIGS
    missing = [f"{n}.yaml" for n in STAGES if not (configs / f"{n}.yaml").is_file()] + [
        f"{task}/{n}.yaml"
        for task, stages in ((ARITHMETIC, ARITHMETIC_STAGES), (CALCULATOR, CALCULATOR_STAGES))
        for n in stages
        if not (configs / task / f"{n}.yaml").is_file()
    ]
    if missing:
        raise FileNotFoundError(
            f"demo configs: {', '.join(missing)} not found in {configs}; pass --configs DIR "
            f"(a copy of {DEFAULT_CONFIGS})"
        )
    plan = QUICK if quick else FULL
    out.mkdir(parents=True, exist_ok=True)
    task = out / "task"
    timings: dict[str, float] = {}
    t_start = time.perf_counter()

    def stage(n: int, name: str, what: str) -> float:
        echo(f"\n[{n}/{N_STAGES}] {name}: {what}")
        return time.perf_counter()

    def done(name: str, t0: float, summary: str) -> None:
        timings[name] = time.perf_counter() - t0
        echo(f"      {summary}  ({timings[name]:.0f} s)")

    # 1. Task data, tokenizer, random base model.
    arith, calc = out / ARITHMETIC, out / CALCULATOR
    t0 = stage(
        1,
        "task",
        f"the three tasks' data, tokenizers and random tiny llamas -> {task}, {arith}, {calc}",
    )
    info = make_task_data(task, seed, **plan.task)
    a_info = arithmetic.make_task_data(arith / "task", seed, **plan.arithmetic["task"])
    c_info = calculator.make_task_data(calc / "task", seed, **plan.calculator["task"])
    done(
        "task",
        t0,
        f"teacher gold {info['teacher_gold_eval']:.3f}; labeller agrees with gold on "
        f"{info['label_gold_agreement_train']:.1%} of training pairs; arithmetic ({arith / 'task'}): "
        f"the teacher's exact match {a_info['teacher_exact_match_eval']:.3f}, format errors "
        f"{a_info['teacher_format_errors_train']:.3f}; calculator ({calc / 'task'}): the teacher's "
        f"exact match {c_info['teacher_exact_match_eval']:.3f}, tool use "
        f"{c_info['teacher_tool_use_eval']:.3f}",
    )
    # Every config is loaded and validated now, so a mistake in any YAML stops the demo before training.
    cfgs = stage_configs(configs, out, seed, plan)
    arith_cfgs = arithmetic_stage_configs(configs / ARITHMETIC, arith, seed, plan)
    calc_cfgs = calculator_stage_configs(configs / CALCULATOR, calc, seed, plan)

    def run_stage(n: int, name: str, what: str, train) -> None:
        cfg, command = cfgs[name]
        t0 = stage(n, name, what)
        echo(f"      same as: {command}")
        train(cfg)
        rows = _metrics(out / name)
        if name.startswith(f"{ARITHMETIC}/"):
            summary = _task_summary(name.partition("/")[2], rows, ARITHMETIC_SUMMARY)
        elif name.startswith(f"{CALCULATOR}/"):
            summary = _task_summary(name.partition("/")[2], rows, CALCULATOR_SUMMARY)
        elif name == "sft":
            loss = [r["eval/loss"] for r in rows if "eval/loss" in r]
            summary = f"held-out loss {loss[0]:.3f} -> {loss[-1]:.3f}"
        elif name == "rm":
            acc = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
            summary = (
                f"held-out accuracy {acc[-1]:.3f} (the labels agree with gold on "
                f"{info['label_gold_agreement_eval']:.1%} of these pairs)"
            )
        elif name in ("dpo", "simpo"):
            acc = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
            summary = f"held-out preference accuracy {acc[-1]:.3f}, KL to the SFT model {rows[-1]['eval/kl']:.3f}"
        elif name in ("grpo", "rloo"):
            last = rows[-1]
            summary = (
                f"last step: exact sorts {last['score/' + VERIFIER_FN]:.3f}, gold {last['score/' + GOLD_FN]:.3f}, "
                f"k3 KL {last.get('kl/ref_k3', 0.0):.3f}"
            )
        else:
            last = rows[-1]
            summary = (
                f"last step: proxy {last['score/reward_model']:.3f}, gold {last['score/' + GOLD_FN]:.3f}, "
                f"KL {last['kl/seq_mean']:.3f}"
            )
        done(name, t0, summary)

    # 2. SFT on the teacher's demonstrations.
    run_stage(2, "sft", "supervised fine-tuning on the sloppy teacher's demonstrations", sft.train)
    # 3. Reward model from the SFT model, on the noisy preference pairs.
    run_stage(
        3, "rm", "Bradley-Terry reward model on the noisy labeller's preference pairs", reward.train
    )
    # 4-5. PPO twice: a sane beta, and a tiny one. The gold score rides along with weight 0.
    run_stage(
        4, "ppo", "PPO with a sane beta (critic initialised from the reward model)", ppo.train
    )
    run_stage(5, "ppo_overopt", "PPO with a tiny beta: over-optimising the proxy", ppo.train)
    # 6-9. The alternatives from the same SFT model: offline on the RM's pairs, online on the verifier.
    run_stage(
        6, "dpo", "DPO on the reward model's preference pairs (reference: the SFT model)", dpo.train
    )
    run_stage(7, "simpo", "SimPO on the same pairs (no reference model)", dpo.train)
    run_stage(
        8,
        "grpo",
        "GRPO rewarded by the exact-sort verifier (no critic, no reward model)",
        grpo.train,
    )
    run_stage(9, "rloo", "RLOO: leave-one-out baseline, the same verifier", grpo.train)

    # 10-13. The arithmetic reasoning task (its data written in stage 1): SFT, then PPO, GRPO and RLOO
    # from that SFT model, each rewarded by the answer verifier.
    cfgs.update({f"{ARITHMETIC}/{k}": v for k, v in arith_cfgs.items()})
    for n, (name, what, train) in enumerate(
        (
            ("sft", "supervised fine-tuning on the teacher's worked solutions", sft.train),
            ("ppo", "PPO rewarded by the answer verifier (critic from the policy)", ppo.train),
            ("grpo", "GRPO rewarded by the answer verifier", grpo.train),
            ("rloo", "RLOO rewarded by the answer verifier", grpo.train),
        ),
        start=10,
    ):
        run_stage(n, f"{ARITHMETIC}/{name}", what, train)

    # 14-19. The calculator tool task (its data written in stage 1): SFT on tool-using conversations,
    # then PPO (critic across turns), GRPO and RLOO from it with the tool; the no-tool baseline: SFT
    # on the answers alone, GRPO without the tool. Every run rewarded by the verifier.
    cfgs.update({f"{CALCULATOR}/{k}": v for k, v in calc_cfgs.items()})
    for n, (name, what, train) in enumerate(
        (
            ("sft", "supervised fine-tuning on the teacher's tool-using conversations", sft.train),
            ("ppo", "PPO with the calculator tool (critic across turns)", ppo.train),
            ("grpo", "GRPO with the calculator tool", grpo.train),
            ("rloo", "RLOO with the calculator tool", grpo.train),
            ("sft_notool", "the no-tool baseline: SFT on the teacher's answers alone", sft.train),
            ("grpo_notool", "the no-tool baseline: GRPO without the tool", grpo.train),
        ),
        start=2 + len(STAGES) + len(ARITHMETIC_STAGES),
    ):
        run_stage(n, f"{CALCULATOR}/{name}", what, train)

    # 20. Held-out evaluation of every policy, with one shared sampling seed; the report.
    t0 = stage(
        N_STAGES,
        "eval + report",
        f"sampling {plan.eval_samples_per_prompt} response(s) per "
        "held-out prompt from each policy; writing the report",
    )
    max_new = cfgs["ppo"][0].rollout.max_new_tokens
    policies = {
        "sft": out / "sft",
        **{name: final_policy(out / name) for name in (*RUNS, *ALTERNATIVES)},
    }
    evaluation = {
        name: evaluate_policy(
            path,
            reference=out / "sft",
            reward_model=out / "rm",
            prompts_file=task / "prompts_eval.jsonl",
            scores=digits.EVAL_SCORES,
            samples_per_prompt=plan.eval_samples_per_prompt,
            max_new_tokens=max_new,
            max_prompt_length=EVAL_PROMPT_TOKENS,
            seed=seed,
        )
        for name, path in policies.items()
    }
    evaluation["rm_gold_agreement"] = reward_model_gold_agreement(
        out / "rm", task / "prefs_eval.jsonl", digits.gold
    )
    (out / "eval.json").write_text(json.dumps(evaluation, indent=1) + "\n")
    arith_policies = {
        "sft": arith / "sft",
        **{name: final_policy(arith / name) for name in ARITHMETIC_RUNS},
    }
    arith_eval = {
        name: evaluate_policy(
            path,
            reference=arith / "sft",
            prompts_file=arith / "task" / "prompts_eval.jsonl",
            scores=ARITHMETIC_SCORES,
            samples_per_prompt=plan.eval_samples_per_prompt,
            max_new_tokens=arith_cfgs["ppo"][0].rollout.max_new_tokens,
            max_prompt_length=EVAL_PROMPT_TOKENS,
            seed=seed,
        )
        for name, path in arith_policies.items()
    }
    (arith / "eval.json").write_text(json.dumps(arith_eval, indent=1) + "\n")
    calc_eval = evaluate_calculator(calc, calc_cfgs, plan.eval_samples_per_prompt, seed)
    (calc / "eval.json").write_text(json.dumps(calc_eval, indent=1) + "\n")
    timings["eval"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_start
    (out / "demo.json").write_text(
        json.dumps(
            {"seed": seed, "quick": quick, "configs": str(configs), "timings_s": timings}, indent=1
        )
        + "\n"
    )
    results = report.write_report(out)
    echo(f"      done  ({time.perf_counter() - t0:.0f} s)")
    echo("\n" + report.terminal_summary(results))
    return results


def stage_configs(
    configs: Path, out: Path, seed: int, plan: Plan, only: tuple[str, ...] = STAGES
) -> dict:
    """``{stage: (config, equivalent command line)}``: each YAML file (of the stages in ``only``) with
    paths, seed and ``plan`` filled in.

    All are loaded (and validated) together; ConfigError lists what is wrong.
    """
    task = out / "task"
    shared = dict(
        sft=out / "sft",
        reward_model=out / "rm",
        prompts=task / "prompts_train.jsonl",
        pairs=task / "prefs_train.jsonl",
        eval_pairs=task / "prefs_eval.jsonl",
        verifier=VERIFIER_FN,
        gold=GOLD_FN,
    )
    stages = {
        "sft": (
            "sft",
            sft.SFTConfig,
            {
                "model.path": task / "base_model",
                "data.train_file": task / "sft_train.jsonl",
                "data.eval_file": task / "sft_eval.jsonl",
            },
        ),
        "rm": (
            "rm",
            reward.RMConfig,
            {
                "model.path": out / "sft",
                "data.train_file": task / "prefs_train.jsonl",
                "data.eval_file": task / "prefs_eval.jsonl",
            },
        ),
        # PPO's stages keep their YAML's reward settings (the check below says which).
        **{
            name: (
                "ppo",
                config_class("ppo"),
                {
                    "model.path": out / "sft",
                    "model.reward_model": out / "rm",
                    "data.prompts": task / "prompts_train.jsonl",
                },
            )
            for name in RUNS
        },
        **{
            name: (
                METHODS[name].command,
                config_class(METHODS[name].command),
                input_overrides(METHODS[name], METHODS[name].default_source(True), **shared),
            )
            for name in ALTERNATIVES
        },
    }
    result, errors = {}, []
    for name, (command, cls, overrides) in stages.items():
        if name not in only:
            continue
        path = configs / f"{name}.yaml"
        values = {**overrides, "output.dir": out / name, "train.seed": seed, **getattr(plan, name)}
        cfg, line = _stage_config(path, command, cls, values, errors)
        if cfg is None:
            continue
        if name in RUNS and (
            cfg.model.reward_functions != [GOLD_FN] or cfg.model.reward_function_weights != [0.0]
        ):
            errors.append(
                f"{path}: the demo logs the gold score without training on it; keep "
                f"model.reward_functions: [{GOLD_FN}] and model.reward_function_weights: [0.0]"
            )
        result[name] = (cfg, line)
    if errors:
        raise ConfigError("demo configs:\n" + "\n".join(errors))
    return result


def _answer_task_stages(out: Path) -> tuple[dict, dict]:
    """The stages of a task with reference answers whose files are in ``out/task`` (arithmetic, a
    reasoning-gym task): ``({stage: its input paths}, {stage: its command})`` — SFT from the base
    model on the task's SFT data, then each of ``ARITHMETIC_RUNS`` from ``out/sft`` on its prompts."""
    task = out / "task"
    inputs = {
        "sft": {
            "model.path": task / "base_model",
            "data.train_file": task / "sft_train.jsonl",
            "data.eval_file": task / "sft_eval.jsonl",
        },
        **{
            name: {"model.path": out / "sft", "data.prompts": task / "prompts_train.jsonl"}
            for name in ARITHMETIC_RUNS
        },
    }
    commands = {name: METHODS[name].command if name in METHODS else name for name in inputs}
    return inputs, commands


def arithmetic_stage_configs(configs: Path, out: Path, seed: int, plan: Plan) -> dict:
    """``{stage: (config, equivalent command line)}`` of the arithmetic task's stages: each YAML of
    ``configs`` (``<configs>/arithmetic/``) with the paths under ``out`` (``<out>/arithmetic``), the
    seed and ``plan``'s overrides filled in; the reward settings stay the YAML's. ConfigError lists
    what is wrong in any of them."""
    inputs, commands = _answer_task_stages(out)
    return _task_stage_configs(
        configs,
        out,
        seed,
        inputs,
        commands,
        plan.arithmetic,
        verifier=ARITHMETIC_VERIFIER,
        task="arithmetic",
    )


def gym_stage_configs(configs: Path, out: Path, seed: int) -> dict:
    """``{stage: (config, equivalent command line)}`` of a reasoning-gym task's stages
    (:mod:`proximal.tasks.gym`; compare's ``reasoning_gym:NAME``): each YAML of ``configs``
    (``<configs>/reasoning_gym/``) with the paths under ``out``, where ``out/task`` holds the
    task's files, and the seed filled in. ConfigError lists what is wrong in any of them."""
    inputs, commands = _answer_task_stages(out)
    return _task_stage_configs(
        configs,
        out,
        seed,
        inputs,
        commands,
        {},
        verifier="proximal.rewards:reasoning_gym",
        task="reasoning-gym",
    )


def _stage_config(path: Path, command: str, cls: type, values: dict, errors: list[str]):
    """One stage: ``path`` loaded as ``cls`` with ``values`` (paths as strings) over it, and the
    equivalent command line; ``(None, line)`` with the problem appended to ``errors`` when it does
    not load."""
    values = {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}
    line = f"proximal {command} --config {path} " + " ".join(
        f"--{k} {command_arg(v)}" for k, v in values.items()
    )
    try:
        # the paths a stage reads (out/sft, out/rm) are written by the stages before it
        return load_config(cls, path, values, paths=False), line
    except ConfigError as e:
        errors.append(f"{path}: {e}")
        return None, line


def _task_stage_configs(
    configs: Path,
    out: Path,
    seed: int,
    inputs: dict[str, dict],
    commands: dict[str, str],
    overrides: dict[str, dict],
    *,
    verifier: str,
    task: str,
    check=None,
) -> dict:
    """``{stage: (config, equivalent command line)}`` for a built-in task's stages, in ``inputs``'
    order: ``<configs>/<stage>.yaml`` loaded as ``commands[stage]``'s config with the stage's
    ``inputs``, ``output.dir`` under ``out``, the seed and ``overrides[stage]`` (the plan's) filled
    in. ConfigError lists every problem: a config that does not load, an RL stage that does not
    learn from ``verifier`` (first in model.reward_functions, weight 1), and what ``check(stage,
    config, path)`` returns (a list of problems)."""
    classes = {"sft": sft.SFTConfig, "ppo": ppo.PPOConfig, "grpo": grpo.GRPOConfig}
    result, errors = {}, []
    for name, stage_inputs in inputs.items():
        command, path = commands[name], configs / f"{name}.yaml"
        values = {
            **stage_inputs,
            "output.dir": out / name,
            "train.seed": seed,
            **overrides.get(name, {}),
        }
        cfg, line = _stage_config(path, command, classes[command], values, errors)
        if cfg is None:
            continue
        if command != "sft" and (
            cfg.model.reward_functions[:1] != [verifier]
            or cfg.model.reward_function_weights[:1] != [1.0]
        ):
            errors.append(
                f"{path}: the {task} runs learn from the verifier; keep {verifier} first in "
                "model.reward_functions, with weight 1.0"
            )
        errors += check(name, cfg, path) if check else []
        result[name] = (cfg, line)
    if errors:
        raise ConfigError("demo configs:\n" + "\n".join(errors))
    return result


def calculator_stage_configs(configs: Path, out: Path, seed: int, plan: Plan) -> dict:
    """``{stage: (config, equivalent command line)}`` of the calculator task's stages: each YAML of
    ``configs`` (``<configs>/calculator/``) with the paths under ``out`` (``<out>/calculator``), the
    seed and ``plan``'s overrides filled in; the reward and tool settings stay the YAML's.
    ConfigError lists what is wrong in any of them: also an RL stage that does not learn from the
    verifier, a tool stage without the calculator tool, or a no-tool stage with one."""
    task = out / "task"
    inputs = {
        "sft": {
            "model.path": task / "base_model",
            "data.train_file": task / "sft_train.jsonl",
            "data.eval_file": task / "sft_eval.jsonl",
        },
        "sft_notool": {
            "model.path": task / "base_model",
            "data.train_file": task / "sft_notool_train.jsonl",
            "data.eval_file": task / "sft_notool_eval.jsonl",
        },
        **{
            name: {"model.path": out / "sft", "data.prompts": task / "prompts_train.jsonl"}
            for name in CALCULATOR_RUNS
        },
        "grpo_notool": {
            "model.path": out / "sft_notool",
            "data.prompts": task / "prompts_train.jsonl",
        },
    }
    commands = {
        name: {"sft_notool": "sft", "grpo_notool": "grpo"}.get(
            name, METHODS[name].command if name in METHODS else name
        )
        for name in inputs
    }
    tool = f"proximal.tasks.calculator:{calculator.TOOL}"

    def check(name: str, cfg, path: Path) -> list[str]:
        if name in CALCULATOR_RUNS and tool not in cfg.tools.functions:
            return [f"{path}: a tool stage needs tools.functions: [{tool}]"]
        if name == "grpo_notool" and (cfg.tools.functions or cfg.env.factory):
            return [f"{path}: the no-tool baseline runs with no tools and no env"]
        return []

    return _task_stage_configs(
        configs,
        out,
        seed,
        {name: inputs[name] for name in CALCULATOR_STAGES},
        commands,
        plan.calculator,
        verifier=CALCULATOR_VERIFIER,
        task="calculator",
        check=check,
    )


def calculator_agent(cfg) -> dict:
    """``evaluate_policy``'s ``env`` and ``tools`` of a calculator run's config: its trajectories."""
    return {"env": asdict(cfg.env), "tools": asdict(cfg.tools)}


def evaluate_calculator(out: Path, cfgs: dict, samples_per_prompt: int, seed: int) -> dict:
    """Every calculator policy on the held-out prompts, one sampling seed: the tool policies (the SFT
    model and each run from it) as trajectories with the GRPO stage's tool and limits, against the SFT
    model; the no-tool ones as single responses against the no-tool SFT model."""
    agent = calculator_agent(cfgs["grpo"][0])
    tool_turn = cfgs["grpo"][0].rollout.max_new_tokens
    notool = cfgs["grpo_notool"][0].rollout.max_new_tokens
    common = dict(
        prompts_file=out / "task" / "prompts_eval.jsonl",
        scores=CALCULATOR_SCORES,
        samples_per_prompt=samples_per_prompt,
        max_prompt_length=EVAL_PROMPT_TOKENS,
        seed=seed,
    )
    policies = {
        "sft": (out / "sft", "sft", agent, tool_turn),
        **{n: (final_policy(out / n), "sft", agent, tool_turn) for n in CALCULATOR_RUNS},
        "sft_notool": (out / "sft_notool", "sft_notool", {}, notool),
        "grpo_notool": (final_policy(out / "grpo_notool"), "sft_notool", {}, notool),
    }
    return {
        name: evaluate_policy(
            path, reference=out / ref, max_new_tokens=max_new, **agent_kw, **common
        )
        for name, (path, ref, agent_kw, max_new) in policies.items()
    }


#: The last-step metrics an answer task's online stages report, (label, metrics key), in order.
ARITHMETIC_SUMMARY = (
    ("reward", f"score/{ARITHMETIC_VERIFIER}"),
    ("exact match", f"score/{ARITHMETIC_SCORES['exact_match']}"),
    ("format errors", f"score/{ARITHMETIC_SCORES['format_error']}"),
)
CALCULATOR_SUMMARY = (
    ("reward", f"score/{CALCULATOR_VERIFIER}"),
    ("exact match", f"score/{CALCULATOR_SCORES['exact_match']}"),
    ("tool calls per trajectory", "agent/tool_calls_per_trajectory"),
)


def _task_summary(name: str, rows: list[dict], reported: tuple[tuple[str, str], ...]) -> str:
    """An answer task's stage in one line: an SFT stage's held-out loss, first to last; an online
    stage's last-step ``reported`` metrics (those it logged) and its KL."""
    if name.startswith("sft"):
        loss = [r["eval/loss"] for r in rows if "eval/loss" in r]
        return f"held-out loss {loss[0]:.3f} -> {loss[-1]:.3f}"
    last = rows[-1]
    kl = last.get("kl/ref_k3", last.get("kl/seq_mean", 0.0))
    parts = [f"{label} {last[key]:.3f}" for label, key in reported if key in last]
    return "last step: " + ", ".join([*parts, f"KL {kl:.3f}"])


def command_arg(value) -> str:
    """An override's value as typed on the command line (``null``, ``'[a, b]'``)."""
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "'[" + ", ".join(str(v) for v in value) + "]'"
    return str(value)


def _metrics(run_dir: Path) -> list[dict]:
    return list(read_metrics(Path(run_dir) / "metrics.jsonl"))


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="proximal demo",
        description="The whole of RLHF offline on a CPU: task data -> SFT -> reward model -> PPO, then a report.",
        epilog="The report is <out>/report.md; docs/demo.md explains how to read it.",
    )
    parser.add_argument("--out", default="demo_out", help="output directory (default: demo_out)")
    parser.add_argument(
        "--quick", action="store_true", help="the shrunken CI demo: less data, fewer steps"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the data and every stage (default: 0)"
    )
    parser.add_argument(
        "--configs",
        default=None,
        help=f"directory holding sft.yaml, rm.yaml, ppo.yaml, ppo_overopt.yaml (default: {DEFAULT_CONFIGS})",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice, one per core)",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads {args.threads}: must be at least 1")
        torch.set_num_threads(args.threads)

    code, _ = run_reporting(
        "demo", lambda: run_demo(args.out, quick=args.quick, seed=args.seed, configs=args.configs)
    )
    return code
