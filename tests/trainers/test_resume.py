"""``proximal sft --resume`` and ``proximal rm --resume`` reproduce the uninterrupted run exactly: the
metrics of every step after the checkpoint (held-out evaluations included) and the final weights,
bitwise on CPU float32. The run dies right after the step-K checkpoint, inside a warm-up and a
linear decay that span it and in the middle of the second pass over the data."""

from __future__ import annotations

import json
import random

import pytest
import torch

from proximal.cli import main
from proximal.logging import read_metrics
from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm

N, K = 6, 3


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_causal_lm(
        tmp_path_factory.mktemp("resume") / "base", build_char_tokenizer("abcdefgh="), seed=0
    )


def _data(command: str, path, n: int = 20):  # 2 batches of 8 per pass, 4 rows left out
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        x = rng.choice("abcdefgh")
        rows.append(
            {"prompt": f"{x}=", "response": x * 3}
            if command == "sft"
            else {"prompt": f"{x}=", "chosen": x * 2, "rejected": x + ("a" if x != "a" else "b")}
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _argv(command, base, tmp_path, name, steps):
    data = _data(command, tmp_path / f"{command}.jsonl")
    return [
        command,
        "--model.path",
        str(base),
        "--data.train_file",
        data,
        "--data.eval_file",
        data,
        "--data.max_length",
        "16",
        "--optim.lr",
        "3e-3",
        "--optim.warmup_steps",
        "2",
        "--optim.schedule",
        "linear",
        "--train.steps",
        str(steps),
        "--train.batch_size",
        "8",
        "--train.micro_batch_size",
        "4",
        "--train.eval_every",
        "2",
        "--train.save_every",
        str(K),
        "--train.device",
        "cpu",
        "--output.dir",
        str(tmp_path / name),
        "--output.progress",
        "false",
    ]


def _without_time(rows):
    return [
        {k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "memory/"))}
        for r in rows
    ]


@pytest.mark.parametrize("command", ["sft", "rm"])
def test_resume_after_a_crash_reproduces_the_run(command, base, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    from proximal.train import run

    assert main(_argv(command, base, tmp_path, "full", N)) == 0
    original = run.save_checkpoint

    def save_then_crash(root, step, **kw):
        out = original(root, step, **kw)
        if step == K:
            raise KeyboardInterrupt  # as if killed: nothing after the checkpoint is written
        return out

    monkeypatch.setattr(run, "save_checkpoint", save_then_crash)
    assert main(_argv(command, base, tmp_path, "crashed", N)) == 130
    assert [r["step"] for r in read_metrics(tmp_path / "crashed" / "metrics.jsonl")] == list(
        range(K + 1)
    )
    monkeypatch.setattr(run, "save_checkpoint", original)

    assert main([command, "--resume", str(tmp_path / "crashed")]) == 0, capsys.readouterr().err
    full, resumed = (
        read_metrics(tmp_path / "full" / "metrics.jsonl"),
        read_metrics(tmp_path / "crashed" / "metrics.jsonl"),
    )
    assert [r["step"] for r in resumed] == list(range(N + 1))
    assert _without_time(resumed) == _without_time(full)
    assert (
        len({r["train/lr"] for r in full[1:]}) > 2
    )  # warm-up and decay: the schedule's state mattered
    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "crashed" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_extending_a_finished_run_follows_the_new_schedule(base, tmp_path, capsys):
    """``--resume DIR --train.steps M`` on a run that finished at N < M: the linear decay is stretched to M
    steps, and the first new step runs at the new schedule's rate, not at the old one's last (0)."""
    argv = _argv("sft", base, tmp_path, "run", 4)
    assert main(argv) == 0
    assert main(["sft", "--resume", str(tmp_path / "run"), "--train.steps", "8"]) == 0, (
        capsys.readouterr().err
    )
    lrs = [r["train/lr"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")[1:]]
    # warm-up 2 steps then linear to 0 over 8: step k (0-based) runs at 3e-3·(8 − k)/6 for k ≥ 2
    assert lrs[4:] == pytest.approx([3e-3 * (8 - k) / 6 for k in range(4, 8)], rel=1e-9)
