"""proximal's side of a benchmark: the run config of each work, the command, and its step times.

The PPO config sets every field the issue pins (4 epochs, one mini-batch, lr 1e-5 for both models,
T = R, temperature 1, CPU, the critic from the reward model) and leaves the rest at proximal's
defaults; docs of each field: ``python -m proximal ppo --help`` and ``python -m proximal grpo --help``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from harness.works import Work

ROOT = Path(__file__).resolve().parents[2]
#: The reward function GRPO uses on both sides (benchmarks/grpo_reward.py): pure Python, microseconds.
GRPO_REWARD = "grpo_reward:distinct_chars"


def ppo_config(
    work: Work,
    *,
    model: dict,
    prompts: dict,
    steps: int,
    out_dir: Path,
    logprobs: str | None = None,
) -> dict:
    """``proximal ppo``; ``logprobs`` sets ``train.logprobs`` (fused | logits; None: the default)."""
    B = work.batch
    return with_logprobs(
        {
            "model": {
                "path": model["policy"],
                "reward_model": model["reward"],
                "critic": "reward_model",
            },
            "data": {"prompts": prompts["jsonl"], "max_prompt_length": work.prompt_len},
            "rollout": {
                "batch_size": B,
                "max_new_tokens": work.response_len,
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
            },
            "ppo": {"epochs": 4, "mini_batch_size": B, "micro_batch_size": B},
            "optim": {"lr": 1.0e-5, "critic_lr": 1.0e-5},
            "train": {
                "steps": steps,
                "save_every": 0,
                "seed": 0,
                "device": "cpu",
                "precision": work.precision,
            },
            "output": {"dir": str(out_dir), "progress": False, "overwrite": True},
        },
        logprobs,
    )


def grpo_config(
    work: Work,
    *,
    model: dict,
    prompts: dict,
    steps: int,
    out_dir: Path,
    beta: float,
    loss: str,
    logprobs: str | None = None,
) -> dict:
    """``proximal grpo``: rollout.batch_size prompts a step, rollout.group_size completions each, one
    pass (grpo.iterations), grpo.loss in grpo|dr_grpo|dapo, β = grpo.beta; the whole batch in one
    micro-batch, as TRL's per_device_train_batch_size = the batch does."""
    return with_logprobs(
        {
            "model": {"path": model["policy"], "reward_functions": [GRPO_REWARD]},
            "data": {"prompts": prompts["jsonl"], "max_prompt_length": work.prompt_len},
            "rollout": {
                "batch_size": work.batch // work.group_size,
                "group_size": work.group_size,
                "max_new_tokens": work.response_len,
                "temperature": 1.0,
            },
            "grpo": {
                "iterations": 1,
                "loss": loss,
                "beta": beta,
                "clip_eps": 0.2,
                "micro_batch_size": work.batch,
            },
            "optim": {"lr": 1.0e-5},
            "train": {
                "steps": steps,
                "save_every": 0,
                "seed": 0,
                "device": "cpu",
                "precision": work.precision,
            },
            "output": {"dir": str(out_dir), "progress": False, "overwrite": True},
        },
        logprobs,
    )


def with_logprobs(cfg: dict, logprobs: str | None) -> dict:
    """``cfg`` with ``train.logprobs`` set (issue 22: ``fused`` computes log-probabilities from hidden
    states, ``logits`` through the (B, T, V) logits), or as it is for None (proximal's default)."""
    if logprobs is not None:
        cfg["train"]["logprobs"] = logprobs
    return cfg


def has_train_field(name: str, tree: Path = ROOT) -> bool:
    """Whether ``tree``'s proximal (this one by default) has ``train.<name>`` (``logprobs`` arrives
    with issue 22, ``compile`` with issue 27)."""
    code = (
        "import sys, dataclasses; from proximal.train.sections import TrainSection; "
        f"sys.exit(0 if {name!r} in {{f.name for f in dataclasses.fields(TrainSection)}} else 1)"
    )
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-c", code], cwd=str(tree), env=env).returncode == 0


def with_compiled_blocks(cfg: dict, tree: Path) -> dict:
    """``cfg`` with ``train.compile: blocks`` where ``tree``'s proximal has the field: the harness
    measures steady steps (the median of steps 2..N), the compiled path a long run takes, while
    ``auto`` leaves a run of a few steps eager (its compiling would not pay back)."""
    if has_train_field("compile", tree):
        cfg["train"]["compile"] = "blocks"
    return cfg


def logprobs_used(run_dir: Path) -> str | None:
    """``train.logprobs`` as the run saved it in ``config.yaml`` (every field, defaults included), or
    None where this proximal has no such field."""
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    except OSError:
        return None
    return (cfg.get("train") or {}).get("logprobs")


def version() -> str:
    """This tree's commit, ``+dirty`` when ``proximal/`` has uncommitted changes (what was measured)."""
    try:
        git = ["git", "-C", str(ROOT)]
        commit = subprocess.run(
            git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            git + ["status", "--porcelain", "--", "proximal"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "?"
    return (commit or "?") + ("+dirty" if dirty else "")


def has_command(name: str) -> bool:
    """Whether this tree's proximal has ``proximal <name>`` (GRPO may not exist yet)."""
    code = (
        f"import sys; from proximal.cli import COMMANDS; sys.exit(0 if {name!r} in COMMANDS else 1)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), env=env).returncode == 0


def command(method: str, config_path: Path, python: str = sys.executable) -> list[str]:
    """``python -m proximal <method> --config FILE``: the CLI, as a user runs it."""
    return [python, "-m", "proximal", method, "--config", str(config_path)]


def write_config(cfg: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def read_steps(run_dir: Path) -> dict:
    """Step times from ``metrics.jsonl``.

    ``period_s[k]`` is the time from step k-1's log line to step k's (``time/wall_s`` differences; step
    1's from the loop's start): the whole loop, logging and sample writing included — the same span as
    TRL's ``on_step_end`` to ``on_step_end``. ``step_s`` is proximal's own ``time/step_s`` (step start
    to metrics, no logging). The last checkpoint is written after step N's log line, so neither holds it.
    ``mfu`` is each step's ``perf/mfu`` (model FLOPs over the machine's peak; docs/performance.md).
    """
    rows = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    rows = [r for r in rows if "time/step_s" in r]
    wall = [float(r["time/wall_s"]) for r in rows]
    period = [wall[0]] + [b - a for a, b in zip(wall, wall[1:])]
    lengths = [float(r.get("response/length_mean", float("nan"))) for r in rows]
    eos = [float(r.get("response/eos_frac", float("nan"))) for r in rows]
    return {
        "step_s": [float(r["time/step_s"]) for r in rows],
        "mfu": [float(r["perf/mfu"]) if r.get("perf/mfu") is not None else None for r in rows],
        "period_s": period,
        "wall_s": wall,
        "response_length_mean": lengths,
        "eos_frac": eos,
    }


def median_from_step2(xs: list[float]) -> float | None:
    """The median of steps 2..N (step 1 warms caches and allocators); step 1 alone when N = 1."""
    tail = xs[1:] if len(xs) > 1 else xs
    return statistics.median(tail) if tail else None
