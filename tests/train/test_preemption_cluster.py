"""Pre-emption with two processes (marker ``cluster``: ``make test-cluster``). A SIGTERM that reaches
one rank only, in the middle of a step, stops both after that step: they agree at the step boundary,
write the step's checkpoint together (one shard each) and exit with status 75; ``--resume auto``
on two processes then finishes with the uninterrupted two-process run's metrics and weights,
bitwise, and on one process (a change of process count: every method) within the 1-vs-2-process
tolerance. Through real ``torchrun`` too: a SIGTERM to torchrun, which forwards it to each worker."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multiproc import launch, run_ranks
from ppo_support import prompt_texts, read_jsonl, tiny_config, write_yaml
from resume_support import fixed_argv, grpo_config, measured_out, weights, write_rows

from proximal.data.jsonl import write_jsonl
from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm

pytestmark = pytest.mark.cluster

STOP, TOTAL = 2, 4
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_causal_lm(
        tmp_path_factory.mktemp("preempt2") / "base", build_char_tokenizer("abcdefgh="), seed=0
    )


def _in_rank(argv: list[str], stop_rank: int | None = None, hook: tuple[str, str] = ("", "")):
    """``proximal <argv>`` in a forked rank; with ``stop_rank``, that rank alone sends itself
    SIGTERM at the start of step STOP (the STOP-th call of ``hook``, a function called once a step)."""
    import importlib

    from proximal import dist
    from proximal.cli import main

    if stop_rank is not None and dist.rank() == stop_rank:
        module = importlib.import_module(hook[0])
        original, calls = getattr(module, hook[1]), [0]

        def wrapped(*args, **kwargs):
            calls[0] += 1
            if calls[0] == STOP:
                os.kill(os.getpid(), signal.SIGTERM)
            return original(*args, **kwargs)

        setattr(module, hook[1], wrapped)
    return main(argv)


def _setup(command: str, base, assets, tmp_path):
    """``(argv of a run into DIR, the hook, the final weights' folders under a run)``."""
    if command in ("sft", "dpo"):
        data = write_rows(command, tmp_path / "d.jsonl", 16)
        return (
            lambda d: fixed_argv(command, base, data, d, "--resume", "auto", save_every=0),
            ("proximal.train.fixed", "accumulate"),
            [""],
        )
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, [{"prompt": p} for p in prompt_texts(8 if command == "ppo" else 4)])
    make = tiny_config if command == "ppo" else grpo_config
    sections = {"train": {"steps": TOTAL, "save_every": 0}, "optim": {"warmup_steps": 3}}
    if command == "grpo":
        sections["model"] = {"reward_functions": ["ppo_support:length"]}

    def argv(d: Path) -> list[str]:
        config = write_yaml(
            d.with_suffix(".yaml"), make(assets.policy("llama"), prompts, d, **sections)
        )
        return [command, "--config", str(config), "--resume", "auto"]

    last = f"checkpoints/step_{TOTAL:06d}"
    subs = [f"{last}/policy", f"{last}/critic"] if command == "ppo" else [f"{last}/policy"]
    return argv, (f"proximal.trainers.{command}", "collect_step"), subs


def _rows(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if r["step"] > 0]


@pytest.mark.parametrize("command", ["sft", "dpo", "ppo", "grpo"])
def test_a_signal_on_one_rank_stops_both_after_the_same_step(command, base, assets, tmp_path):
    argv, hook, subs = _setup(command, base, assets, tmp_path)
    full, stopped, moved = tmp_path / "full", tmp_path / "stopped", tmp_path / "moved"
    assert run_ranks(2, _in_rank, argv(full)) == [0, 0]
    assert run_ranks(2, _in_rank, argv(stopped), stop_rank=1, hook=hook) == [75, 75]
    ckpt = stopped / "checkpoints" / f"step_{STOP:06d}"
    assert (stopped / "checkpoints" / "latest").read_text() == f"{ckpt.name}\n"
    assert len(list((ckpt / "state").glob("*.distcp"))) == 2  # both ranks wrote their shard
    assert _rows(stopped)[-1]["step"] == STOP
    shutil.copytree(stopped, moved)

    assert run_ranks(2, _in_rank, argv(stopped)) == [0, 0]  # two processes: exactly
    assert measured_out(_rows(stopped)) == measured_out(_rows(full))
    for sub in subs:
        a, b = weights(full / sub), weights(stopped / sub)
        assert all(b[k].equal(a[k]) for k in a), sub

    # One process from the two-process checkpoint: DCP reshards the weights and optimiser states;
    # the sampler's state is the global position, so the batches are the same. What differs is
    # float32 summation order (gradients reduced over 2 ranks, then over 1), amplified by AdamW at
    # near-zero gradients: the bound of tests/distributed/test_resume_and_failures.py.
    assert run_ranks(1, _in_rank, argv(moved)) == [0]
    one, two = _rows(moved), _rows(full)
    assert [r["step"] for r in one] == list(range(1, TOTAL + 1))
    keys = {"sft": ("train/loss",), "dpo": ("train/loss", "train/reward_margin")}.get(
        command, ("score/mean", "loss/policy")
    )
    for a, b in zip(two[STOP:], one[STOP:]):
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-4), (a["step"], k)


def test_torchrun_forwards_sigterm_and_every_worker_saves(base, tmp_path):
    """A real SIGTERM to torchrun (as SLURM or Kubernetes send it), once the run is under way."""
    run = tmp_path / "run"
    data = write_rows("sft", tmp_path / "d.jsonl", 16)
    argv = fixed_argv("sft", base, data, run, "--resume", "auto", "--train.steps", "400")
    argv[argv.index("--train.epochs") + 1] = "1"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parents[1])}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 180
    with launch(  # torchrun and its workers killed if still running when this block ends
        command + ["-m", "proximal"] + argv,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            if proc.poll() is not None or time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):  # its output ends once it is gone
                    os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"no 3 steps within 180 s: {proc.communicate()[1][-3000:]}")
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    stopped = read_jsonl(metrics)[-1]["step"]
    assert 2 <= stopped < 400, err[-3000:]
    ckpt = run / "checkpoints" / f"step_{stopped:06d}"
    assert (run / "checkpoints" / "latest").read_text() == f"{ckpt.name}\n"
    assert len(list((ckpt / "state").glob("*.distcp"))) == 2
    assert f"proximal sft: SIGTERM received: stopped after step {stopped} of 400" in err
    assert "[rank 1] proximal sft" not in err  # rank 0 speaks for both
    print(f"torchrun's exit status after forwarding SIGTERM: {proc.returncode}")


def _full_disk_on_rank_1(argv: list[str]):
    """``proximal <argv>`` in a forked rank; rank 1's RNG file of step 3's checkpoint meets ENOSPC."""
    import errno

    import torch

    from proximal import dist
    from proximal.cli import main

    if dist.rank() == 1:
        save = torch.save

        def full(obj, f, *a, **k):
            if "step_000003.tmp/rng" in str(f):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
            return save(obj, f, *a, **k)

        torch.save = full
    return main(argv)


def test_a_full_disk_on_one_rank_fails_the_save_on_both(base, tmp_path, capfd):
    """Rank 1 alone cannot write its file: both learn it after that phase of the save, both exit 1
    at once (no rank waits in the next collective), and step 2's checkpoint stays latest."""
    run = tmp_path / "run"
    argv = fixed_argv("sft", base, write_rows("sft", tmp_path / "d.jsonl", 16), run, save_every=1)
    t0 = time.monotonic()
    assert run_ranks(2, _full_disk_on_rank_1, argv, collective_timeout_s=120) == [1, 1]
    assert time.monotonic() - t0 < 60  # not a collective timeout
    err = capfd.readouterr().err
    assert err.count("no space left on device") == 1, err  # rank 0 speaks for both
    assert f"(writing {run}/checkpoints/.step_000003.tmp/rng/rank_00001.pt)" in err
    assert "step_000002 is intact and still latest" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "latest",
        "newest",
        "step_000001",
        "step_000002",
    ]
    assert os.readlink(run / "checkpoints" / "newest") == "step_000002/model"
