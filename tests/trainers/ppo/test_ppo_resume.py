"""``proximal ppo --resume RUN_DIR`` reproduces the uninterrupted run exactly (issue 3 item 9): the
metrics of the steps after the checkpoint, the samples, and the final weights, bitwise on CPU float32.

The run exercises every piece of resumable state: optimiser moments and a warm-up schedule that
spans the checkpoint, the adaptive KL controller's β, the prompt sampler in the middle of its second
pass over the data, the PTX sampler, and the torch / Python RNGs of sampling and mini-batch shuffling.
"""

from __future__ import annotations

import pytest
import torch
from ppo_support import (
    checkpoint_dirs,
    load_safetensors_dir,
    ppo_main,
    read_jsonl,
    tiny_config,
    without_timing,
    write_yaml,
)

from proximal.data.jsonl import write_jsonl

N, K = 4, 2


class _Crash(Exception):
    pass


def _resume_config(assets, tmp_path, name: str, steps: int) -> dict:
    prompts = tmp_path / "prompts6.jsonl"  # 6 prompts, 4 per step: the checkpoint falls mid-pass
    if not prompts.exists():
        write_jsonl(
            prompts, [{"prompt": p} for p in ("ab 1", "cc 2", "h 3", "dddd 4", "e 5", "fg 6")]
        )
    ptx = tmp_path / "ptx.txt"
    ptx.write_text("abc def\ngh 123\n0 1 2 3\nhgfedcba\n")
    return tiny_config(
        assets.policy("llama"),
        prompts,
        tmp_path / name,
        model={"reward_model": str(assets.reward_model("llama")), "critic": "reward_model"},
        data={"ptx_file": str(ptx), "ptx_batch_size": 2},
        ppo={"epochs": 2, "mini_batch_size": 2, "micro_batch_size": 1, "ptx_coef": 0.5},
        kl={"controller": "adaptive", "target": 0.01, "k_beta": 0.2},
        optim={"warmup_steps": 6},
        train={"steps": steps, "save_every": K, "keep_checkpoints": 3},
    )


@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory):
    """The reference: N steps in one go. Returns its folder's parent and a config maker for the others."""
    tmp = tmp_path_factory.mktemp("resume")
    assert ppo_main(_resume_config(assets, tmp, "full", N)) == 0
    return tmp, lambda name, steps: _resume_config(assets, tmp, name, steps)


def _assert_same_run(full_dir, resumed_dir):
    full, resumed = (
        read_jsonl(full_dir / "metrics.jsonl"),
        read_jsonl(resumed_dir / "metrics.jsonl"),
    )
    assert [r["step"] for r in resumed] == list(range(1, N + 1)), "each step logged exactly once"
    for a, b in zip(full, resumed):
        a, b = without_timing(a), without_timing(b)
        diff = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        assert not diff, f"step {a['step']}: resumed metrics differ: {diff}"
    assert read_jsonl(full_dir / "samples.jsonl") == read_jsonl(resumed_dir / "samples.jsonl")
    # The betas really moved (so the controller's state mattered), and the final weights agree bitwise.
    assert len({r["kl/beta"] for r in full}) > 1
    for sub in ("policy", "critic"):
        a = load_safetensors_dir(checkpoint_dirs(full_dir)[-1] / sub)
        b = load_safetensors_dir(checkpoint_dirs(resumed_dir)[-1] / sub)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (
            f"final {sub} weights differ"
        )


def test_resume_after_a_crash_reproduces_the_run(uninterrupted, monkeypatch, capsys):
    """The run is configured for N steps and dies right after writing the step-K checkpoint."""
    from proximal.train import run

    tmp, make_config = uninterrupted
    original = run.save_checkpoint

    def save_then_crash(root, step, **kwargs):
        out = original(root, step, **kwargs)
        if step == K:
            raise _Crash(f"killed after step {step}")
        return out

    monkeypatch.setattr(run, "save_checkpoint", save_then_crash)
    with pytest.raises(_Crash):
        ppo_main(make_config("crashed", N))
    crashed = tmp / "crashed"
    assert [r["step"] for r in read_jsonl(crashed / "metrics.jsonl")] == [1, 2]
    monkeypatch.setattr(run, "save_checkpoint", original)

    assert ppo_main(None, "--resume", str(crashed)) == 0, capsys.readouterr().err
    _assert_same_run(tmp / "full", crashed)


def test_resume_a_finished_run_to_more_steps(uninterrupted, capsys):
    """``train.steps: K`` runs to the end; ``--resume DIR --train.steps N`` continues it to N."""
    tmp, make_config = uninterrupted
    short = tmp / "short"
    assert ppo_main(make_config("short", K)) == 0
    assert ppo_main(None, "--resume", str(short), "--train.steps", str(N)) == 0, (
        capsys.readouterr().err
    )
    _assert_same_run(tmp / "full", short)


def test_resume_without_a_checkpoint_is_an_error(assets, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    assert ppo_main(None, "--resume", str(run)) == 2
    assert "no config.yaml there" in capsys.readouterr().err
    # A run that died before its first checkpoint: config.yaml is there, a checkpoint is not.
    write_yaml(run / "config.yaml", tiny_config(assets.policy("llama"), assets.prompts, run))
    assert ppo_main(None, "--resume", str(run)) == 2
    assert (
        f"--resume {run}: no intact checkpoint under {run / 'checkpoints'} (none was ever written)"
        in capsys.readouterr().err
    )


def test_resume_with_lora_reproduces_the_run(assets, tmp_path, capsys):
    """The LoRA path resumes from adapter checkpoints (actor and critic) instead of full weights."""

    def config(name, steps):
        return tiny_config(
            assets.policy("llama"),
            assets.prompts,
            tmp_path / name,
            model={
                "reward_model": str(assets.reward_model("llama")),
                "critic": "reward_model",
                "lora_r": 4,
                "critic_lora": True,
            },
            ppo={"epochs": 2, "mini_batch_size": 2, "micro_batch_size": 2},
            optim={"lr": 1e-2, "critic_lr": 1e-2},
            train={"steps": steps, "save_every": 1},
        )

    assert ppo_main(config("full", 3)) == 0
    assert ppo_main(config("short", 1)) == 0
    assert ppo_main(None, "--resume", str(tmp_path / "short"), "--train.steps", "3") == 0, (
        capsys.readouterr().err
    )
    full, resumed = (
        read_jsonl(tmp_path / "full" / "metrics.jsonl"),
        read_jsonl(tmp_path / "short" / "metrics.jsonl"),
    )
    assert [without_timing(r) for r in resumed] == [without_timing(r) for r in full]
    for sub in ("policy", "critic"):
        a = load_safetensors_dir(checkpoint_dirs(tmp_path / "full")[-1] / sub)
        b = load_safetensors_dir(checkpoint_dirs(tmp_path / "short")[-1] / sub)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (
            f"final {sub} adapters differ"
        )
