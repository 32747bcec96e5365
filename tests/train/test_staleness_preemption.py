"""A ``rollout.staleness 1`` run as a scheduler meets it (marker ``cluster``: ``make test-cluster``):
``proximal grpo`` in a process of its own, stopped with SIGTERM (it finishes the step, checkpoints
the step with its batches in flight, exits 75) or killed with SIGKILL after a checkpoint (its
generator dies with it: Linux's parent-death signal); ``--resume auto`` then finishes the run with
the uninterrupted run's metrics and final weights, bitwise, and no generator process outlives its
trainer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multiproc import alive, children, launch, run_launched
from ppo_support import load_safetensors_dir, prompt_texts, read_jsonl, without_timing, write_yaml
from resume_support import grpo_config

from proximal.data.jsonl import write_jsonl

pytestmark = pytest.mark.cluster

STEPS = 6
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    path = [str(ROOT), str(ROOT / "tests" / "trainers" / "ppo")]  # ppo_support's reward functions
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")])}


def _argv(assets, tmp_path, name: str) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, [{"prompt": p} for p in prompt_texts(6)])
    cfg = grpo_config(
        assets.policy("llama"),
        prompts,
        tmp_path / name,
        rollout={"group_size": 2, "staleness": 1},
        grpo={"iterations": 2, "mini_batch_size": 4, "micro_batch_size": 2},
        optim={"lr": 1e-2},
        train={"steps": STEPS, "save_every": 2},
    )
    config = write_yaml(tmp_path / f"{name}.yaml", cfg)
    return [sys.executable, "-m", "proximal", "grpo", "--config", str(config), "--resume", "auto"]


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s {what}"
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_stale_run_stopped_or_killed_resumes_to_the_uninterrupted_run(assets, tmp_path, how):
    full = run_launched(_argv(assets, tmp_path, "full"), timeout=300, env=_env())
    assert full.returncode == 0, full.stderr[-2000:]
    run = tmp_path / "cut"
    metrics = run / "metrics.jsonl"
    with launch(
        _argv(assets, tmp_path, "cut"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env()
    ) as p:
        if how == "SIGTERM":  # during step 3 or 4: it finishes the step and saves it
            _wait(
                lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2,
                240,
                "for step 2",
            )
            generators = children(p.pid)
            os.kill(p.pid, signal.SIGTERM)
            _, err = p.communicate(timeout=120)
            assert p.returncode == 75, err.decode()[-2000:]
            assert "SIGTERM received: stopped after step" in err.decode()
        else:  # right after the step-2 checkpoint is published
            _wait(lambda: (run / "checkpoints" / "step_000002").is_dir(), 240, "for checkpoint 2")
            generators = children(p.pid)
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        assert generators, "the trainer had its generator process"
        _wait(lambda: not any(alive(g) for g in generators), 10, "for the generator to end")
    stopped = len(read_jsonl(metrics))
    assert 2 <= stopped < STEPS
    resumed = run_launched(_argv(assets, tmp_path, "cut"), timeout=300, env=_env())
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = read_jsonl(tmp_path / "full" / "metrics.jsonl"), read_jsonl(metrics)
    # a SIGKILL after checkpoint 2 may have logged steps past it: the resumed run logs them again
    b = [r for i, r in enumerate(b) if r["step"] not in {x["step"] for x in b[i + 1 :]}]
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b, strict=True):
        x, y = without_timing(x), without_timing(y)
        diff = {k: (x.get(k), y.get(k)) for k in x.keys() | y.keys() if x.get(k) != y.get(k)}
        assert not diff, f"step {x['step']}: resumed metrics differ: {diff}"
    wa, wb = load_safetensors_dir(tmp_path / "full"), load_safetensors_dir(run)
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa), (
        "final weights differ"
    )
