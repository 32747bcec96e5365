"""Running one side of one work as a fresh process: proximal through its CLI, an anchor through its
runner script in its own environment. Each returns one record of plain numbers (see :func:`record`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from harness import proximal_side
from harness.measure import cpu_busy, loadavg, run_measured
from harness.proximal_side import median_from_step2
from harness.works import Work

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
GRPO_BETA = (
    0.04  # β of the GRPO work on both sides (TRL's default 0.0 would skip the reference model)
)
GRPO_LOSS = "grpo"  # the loss type on both sides: grpo | dr_grpo | dapo


def child_env(threads: int, *, pythonpath: list[Path]) -> dict:
    """The environment of every child: the same thread counts on both sides, no hub access, no
    inherited PYTHONPATH (an anchor must not import this tree's proximal)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    }
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRL_EXPERIMENTAL_SILENCE="1",
        PYTHONUNBUFFERED="1",
    )
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    return env


def _before() -> dict:
    return {"loadavg_before": loadavg(), "cpu_busy_before": cpu_busy(1.0)}


def record(work: Work, side: str, measured: dict, periods: list[float], extra: dict) -> dict:
    """One run: whole-process wall and peak RSS (measured outside), step spans, the median of steps 2..N."""
    return {
        "work": work.name,
        "side": side,
        **measured,
        "period_s": periods,
        "median_step_s": median_from_step2(periods) if periods else None,
        **extra,
    }


def run_proximal(
    work: Work,
    assets: dict,
    *,
    steps: int,
    threads: int,
    scratch: Path,
    timeout_s: float,
    keep_run: bool = False,
    logprobs: str | None = None,
) -> dict:
    """``proximal <method>`` on ``work``; ``logprobs`` sets ``train.logprobs`` (None: the default).
    The record holds the path the run used, as its saved config says (``logprobs``)."""
    method = work.method
    run_dir = scratch / "run"
    if method == "ppo":
        cfg = proximal_side.ppo_config(
            work,
            model=assets["model"],
            prompts=assets["prompts"],
            steps=steps,
            out_dir=run_dir,
            logprobs=logprobs,
        )
    else:
        cfg = proximal_side.grpo_config(
            work,
            model=assets["model"],
            prompts=assets["prompts"],
            steps=steps,
            out_dir=run_dir,
            beta=GRPO_BETA,
            loss=GRPO_LOSS,
            logprobs=logprobs,
        )
    path = proximal_side.write_config(cfg, scratch / "config.yaml")
    before = _before()
    m = run_measured(
        proximal_side.command(method, path),
        env=child_env(threads, pythonpath=[ROOT, BENCH]),
        log_path=scratch / "log.txt",
        timeout_s=timeout_s,
        cwd=str(ROOT),
    )
    extra = {
        **before,
        "log": str(scratch / "log.txt"),
        "threads": threads,
        "logprobs": proximal_side.logprobs_used(run_dir),
    }
    periods: list[float] = []
    if (run_dir / "metrics.jsonl").is_file():
        steps_ = proximal_side.read_steps(run_dir)
        shutil.copy(run_dir / "metrics.jsonl", scratch / "metrics.jsonl")
        periods = steps_["period_s"]
        extra.update(
            step_s=steps_["step_s"],
            median_own_step_s=median_from_step2(steps_["step_s"]),
            mfu=steps_["mfu"],
            median_mfu=median_from_step2([x for x in steps_["mfu"] if x is not None]),
            response_length_mean=steps_["response_length_mean"],
            eos_frac=steps_["eos_frac"],
        )
        bad = [x for x in steps_["response_length_mean"] if x != work.response_len]
        if bad:
            extra["error"] = (
                f"responses were not all {work.response_len} tokens (length_mean {bad[0]})"
            )
    if m["rc"] != 0 and "error" not in extra:
        extra["error"] = f"exit {m['rc']}: " + _tail(scratch / "log.txt")
    if not keep_run:
        shutil.rmtree(run_dir, ignore_errors=True)  # wide-vocab checkpoints are GBs
    return record(work, "proximal", m, periods, extra)


def trl_command(
    work: Work, assets: dict, python: Path, *, steps: int, threads: int, out: Path
) -> list[str]:
    model, prompts = assets["model"], assets["prompts"]
    if work.method == "ppo":
        cmd = [
            str(python),
            str(BENCH / "trl_ppo_run.py"),
            "--policy",
            model["policy"],
            "--reward",
            model["reward"],
            "--prompt-ids",
            prompts["ids"],
            "--batch",
            str(work.batch),
            "--response-length",
            str(work.response_len),
        ]
    else:
        cmd = [
            str(python),
            str(BENCH / "trl_grpo_run.py"),
            "--policy",
            model["policy"],
            "--prompts",
            prompts["jsonl"],
            "--prompts-per-step",
            str(work.batch // work.group_size),
            "--group-size",
            str(work.group_size),
            "--response-length",
            str(work.response_len),
            "--beta",
            str(GRPO_BETA),
            "--loss",
            GRPO_LOSS,
        ]
    cmd += [
        "--steps",
        str(steps),
        "--threads",
        str(threads),
        "--seed",
        str(work.seed),
        "--out",
        str(out),
    ]
    return cmd + (["--bf16"] if work.bf16 else [])


def run_trl(
    work: Work,
    assets: dict,
    python: Path,
    *,
    steps: int,
    threads: int,
    scratch: Path,
    timeout_s: float,
) -> dict:
    out = scratch / "trl.json"
    out.unlink(missing_ok=True)
    cmd = trl_command(work, assets, python, steps=steps, threads=threads, out=out)
    before = _before()
    m = run_measured(
        cmd,
        env=child_env(threads, pythonpath=[]),
        log_path=scratch / "log.txt",
        timeout_s=timeout_s,
        cwd=str(BENCH),
    )
    extra = {**before, "log": str(scratch / "log.txt"), "threads": threads}
    periods: list[float] = []
    if out.is_file():
        r = json.loads(out.read_text())
        periods = r["period_s"]
        extra.update(
            {
                k: r[k]
                for k in (
                    "settings",
                    "versions",
                    "checked_generations",
                    "start_to_train_s",
                    "ru_maxrss_self_kib",
                )
            }
        )
    if m["rc"] != 0:
        extra["error"] = f"exit {m['rc']}: " + _tail(scratch / "log.txt")
    return record(work, "trl", m, periods, extra)


def _tail(path: Path, n: int = 6) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-n:])[-800:]
