"""Two processes: a run stopped after a checkpoint resumes to exactly the uninterrupted run; a rank
that fails ends the whole job with its own message; what happens on one rank only (a non-finite
score, the early stop) never leaves the other waiting. And ``torchrun`` itself, end to end."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multiproc import run_launched, run_ranks
from ppo_support import read_jsonl, tiny_config, without_timing, write_yaml

HERE = Path(__file__).resolve().parent


class Crash(Exception):
    pass


def _ppo(cfg: dict, resume: bool = False, crash_after: int | None = None):
    """Inside a rank: ``ppo.train``; with ``crash_after`` the run dies right after that checkpoint."""
    from proximal import dist
    from proximal.config import load_config
    from proximal.train import run
    from proximal.trainers import ppo

    if crash_after is not None:
        original = run.save_checkpoint

        def save_then_crash(root, step, **kw):
            out = original(root, step, **kw)
            if step == crash_after:
                raise Crash(f"killed after step {step}")
            return out

        run.save_checkpoint = save_then_crash
    path = Path(cfg["output"]["dir"]).with_suffix(".yaml")
    if dist.is_main():
        write_yaml(path, cfg)
    dist.barrier()
    cfg_obj = load_config(ppo.PPOConfig, path)
    ppo.train(cfg_obj, resume_dir=cfg["output"]["dir"] if resume else None)
    return read_jsonl(Path(cfg["output"]["dir"]) / "metrics.jsonl") if dist.is_main() else None


def _config(assets, run_dir, **sections):
    base = dict(
        model={"reward_model": str(assets.reward_model("llama")), "critic": "reward_model"},
        rollout={"batch_size": 4, "max_new_tokens": 6},
        ppo={"epochs": 2, "mini_batch_size": 4, "micro_batch_size": 1},
        kl={"controller": "adaptive", "target": 0.05, "beta": 0.1},
        optim={"warmup_steps": 3, "schedule": "linear"},
        train={"steps": 4, "save_every": 2},
    )
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return tiny_config(assets.policy("llama"), assets.prompts, run_dir, **base)


@pytest.mark.slow
def test_two_process_run_resumes_exactly_after_a_crash(assets, tmp_path):
    full = run_ranks(2, _ppo, _config(assets, tmp_path / "full"))[0]
    crashed = run_ranks(
        2, _ppo, _config(assets, tmp_path / "crashed"), crash_after=2, expect_failure=True
    )
    assert all(status == "error" and "killed after step 2" in msg for status, msg in crashed)
    resumed = run_ranks(2, _ppo, _config(assets, tmp_path / "crashed"), resume=True)[0]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [without_timing(r) for r in resumed] == [
        without_timing(r) for r in full
    ]  # bitwise, on 2 processes
    assert len({r["kl/beta"] for r in full}) > 1  # the controller's state mattered


def test_nonfinite_score_on_one_rank_only_does_not_hang(assets, tmp_path):
    from proximal.data.jsonl import write_jsonl

    prompts = tmp_path / "p.jsonl"  # one 'h' prompt in a batch of 4: it lands on one rank only
    write_jsonl(prompts, [{"prompt": p} for p in ("ab 1", "h 2", "cd 3", "ef 4")])
    cfg = tiny_config(
        assets.policy("llama"),
        prompts,
        tmp_path / "run",
        model={"reward_functions": ["ppo_support:nan_for_h"]},
        train={"steps": 3},
    )
    rows = run_ranks(2, _ppo, cfg, timeout_s=120, collective_timeout_s=30)[0]
    assert [r["data/skipped_nonfinite"] for r in rows] == [1, 2, 3]
    one = run_ranks(1, _ppo, {**cfg, "output": {**cfg["output"], "dir": str(tmp_path / "one")}})[0]
    for a, b in zip(rows, one):
        assert a["score/mean"] == pytest.approx(b["score/mean"], rel=1e-4, abs=1e-5)


def test_early_stop_is_decided_for_every_rank(assets, tmp_path):
    """``ppo.target_kl`` tiny: the epochs stop at the first mini-batch whose *global* approximate KL
    passes it; a per-rank decision would leave one rank in the next collective alone."""
    cfg = _config(
        assets,
        tmp_path / "two",
        ppo={"target_kl": 1e-9, "epochs": 4, "mini_batch_size": 2},
        train={"steps": 2, "save_every": 0},
    )
    two = run_ranks(2, _ppo, cfg, timeout_s=120, collective_timeout_s=30)[0]
    one = run_ranks(1, _ppo, {**cfg, "output": {**cfg["output"], "dir": str(tmp_path / "one")}})[0]
    assert [r["policy/early_stopped"] for r in two] == [r["policy/early_stopped"] for r in one]
    assert two[-1]["policy/early_stopped"] == 1.0 and two[-1]["policy/epochs_run"] < 4


def _torchrun(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(HERE.parent / "trainers" / "ppo"), os.environ.get("PYTHONPATH", "")]
        ),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "proximal",
    ] + args
    return run_launched(cmd, timeout=timeout, cwd=cwd, env=env)  # a timeout kills the workers too


@pytest.mark.slow
def test_torchrun_two_processes_end_to_end(assets, tmp_path):
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / "run",
        model={"reward_model": str(assets.reward_model("llama")), "critic": "reward_model"},
        train={"steps": 2, "save_every": 0},
    )
    config = write_yaml(tmp_path / "ppo.yaml", cfg)
    done = _torchrun(["ppo", "--config", str(config)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("proximal ppo: done") == 1  # rank 0 says it, once
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    shards = sorted(
        p.name
        for p in (tmp_path / "run" / "checkpoints" / "step_000002" / "state").glob("*.distcp")
    )
    assert len(shards) == 2  # each rank wrote its own shard of the sharded state


@pytest.mark.slow
def test_torchrun_a_failing_rank_ends_the_job_with_its_message(assets, tmp_path):
    from proximal.data.jsonl import write_jsonl

    prompts = (
        tmp_path / "p.jsonl"
    )  # the 'h' prompt reaches one rank only; its reward function raises
    write_jsonl(prompts, [{"prompt": p} for p in ("ab 1", "cd 2", "h 3", "ef 4")])
    cfg = tiny_config(
        assets.policy("llama"),
        prompts,
        tmp_path / "run",
        model={"reward_functions": ["ppo_support:raise_for_h"]},
        data={"shuffle": False},
        train={"steps": 2, "dist_timeout_s": 20},
    )
    config = write_yaml(tmp_path / "ppo.yaml", cfg)
    t0 = time.monotonic()
    done = _torchrun(["ppo", "--config", str(config)], tmp_path)
    assert done.returncode != 0
    assert time.monotonic() - t0 < 120
    assert (
        "[rank 1] proximal ppo: reward function 'ppo_support:raise_for_h' at step 1 raised KeyError"
        in done.stderr
    )


@pytest.mark.slow
def test_a_two_process_checkpoint_resumes_on_one_process(assets, tmp_path):
    """DCP reshards the saved state: a run checkpointed by 2 processes continues on 1 and computes what
    the 2-process run computes, up to float32 summation order (see test_run_invariance)."""
    cfg = _config(assets, tmp_path / "full", optim={"warmup_steps": 0, "schedule": "constant"})
    full = run_ranks(2, _ppo, cfg)[0]
    part = {
        **cfg,
        "train": {**cfg["train"], "steps": 2},
        "output": {**cfg["output"], "dir": str(tmp_path / "moved")},
    }
    run_ranks(2, _ppo, part)
    resumed = run_ranks(1, _ppo, {**part, "train": {**part["train"], "steps": 4}}, resume=True)[0]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full[2:], resumed[2:]):
        for k in ("score/mean", "kl/seq_mean", "kl/beta", "loss/policy", "loss/value"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-4), (a["step"], k)
