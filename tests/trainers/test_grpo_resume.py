"""``proximal grpo --resume RUN_DIR`` reproduces the uninterrupted run exactly: the metrics of the
steps after the checkpoint, the samples and the final weights, bitwise on CPU float32.

The run exercises every piece of resumable state GRPO has: AdamW's moments and a warm-up schedule
that spans the checkpoint, the prompt sampler in the middle of a pass, the skipped-uniform-groups
counter, and the RNGs (sampling is seeded per row; mini-batch shuffling per step).
"""

from __future__ import annotations

import json

import pytest
import torch
from grpo_support import grpo_config, grpo_main, read_jsonl
from ppo_support import checkpoint_dirs, load_safetensors_dir, prompt_texts, without_timing

from proximal.data.jsonl import write_jsonl

STEPS, CHECKPOINT = 4, 2


def _config(assets, tmp, name: str) -> dict:
    prompts = (
        tmp / "prompts.jsonl"
    )  # 6 prompts, 2 per step: the checkpoint after step 2 falls mid-pass
    write_jsonl(prompts, [{"prompt": p} for p in prompt_texts(6)])
    # The reward model is scored and logged but weighs 0; the trained score is 1 where the response
    # has an 'a', so groups that agree are uniform (and skipped, and counted).
    return grpo_config(
        assets.policy("llama"),
        prompts,
        tmp / name,
        model={
            "reward_model": str(assets.reward_model("llama")),
            "reward_model_weight": 0.0,
            "reward_functions": ["grpo_support:has_a"],
        },
        rollout={"group_size": 2},
        grpo={
            "iterations": 2,
            "mini_batch_size": 2,
            "micro_batch_size": 1,
            "beta": 0.1,
            "skip_uniform_groups": True,
            "clip_eps_high": 0.28,
        },
        optim={"warmup_steps": 6, "lr": 1e-2},
        train={"steps": STEPS, "save_every": CHECKPOINT, "keep_checkpoints": 3},
    )


def test_resume_after_a_crash_reproduces_the_run(assets, tmp_path, monkeypatch, capsys):
    """The second run is killed right after it writes the step-2 checkpoint, then resumed."""
    from proximal.train import run

    assert grpo_main(_config(assets, tmp_path, "full")) == 0, capsys.readouterr().err
    save = run.save_checkpoint

    def save_then_die(root, step, **kwargs):
        out = save(root, step, **kwargs)
        if step == CHECKPOINT:
            raise SystemExit(
                f"killed after step {step}"
            )  # not one of the errors the CLI reports: it escapes
        return out

    with monkeypatch.context() as mp:
        mp.setattr(run, "save_checkpoint", save_then_die)
        with pytest.raises(SystemExit, match="killed after step 2"):
            grpo_main(_config(assets, tmp_path, "crashed"))
    crashed = tmp_path / "crashed"
    assert [r["step"] for r in read_jsonl(crashed / "metrics.jsonl")] == [1, 2]
    assert grpo_main(None, "--resume", str(crashed)) == 0, capsys.readouterr().err

    full, resumed = (
        read_jsonl(tmp_path / "full" / "metrics.jsonl"),
        read_jsonl(crashed / "metrics.jsonl"),
    )
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1)), (
        "each step logged exactly once"
    )
    for a, b in zip(full, resumed):
        a, b = without_timing(a), without_timing(b)
        diff = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        assert not diff, f"step {a['step']}: resumed metrics differ: {diff}"
    assert read_jsonl(tmp_path / "full" / "samples.jsonl") == read_jsonl(crashed / "samples.jsonl")
    assert (
        full[-1]["data/skipped_uniform_groups"]
        > full[CHECKPOINT - 1]["data/skipped_uniform_groups"]
        > 0
    )  # counted across
    assert (
        0 < full[CHECKPOINT]["lr/actor"] < 1e-2
    )  # the step after the checkpoint is still warming up
    a = load_safetensors_dir(checkpoint_dirs(tmp_path / "full")[-1] / "policy")
    b = load_safetensors_dir(checkpoint_dirs(crashed)[-1] / "policy")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "final weights differ"


def test_a_resume_keeps_the_recorded_cpu_backend_against_a_new_measurement(
    assets, tmp_path, monkeypatch, capsys
):
    """Issue 37: ``train.cpu_matmul: auto`` measured oneDNN faster when the run started; when it is
    resumed, a new measurement would say BLAS (a busy machine flips it). The resumed run takes the
    backend its models.json recorded, and equals the uninterrupted run bitwise — every metric (the
    rollouts' log-probability mismatch and ratios included) and the final weights. A resume that
    cannot use it (here ``PROXIMAL_CPU_MATMUL`` overrides it) says so in one line."""
    from proximal.models import kernels
    from proximal.models.tiny import build_tiny_causal_lm
    from proximal.train import run

    if kernels._OP is None:
        pytest.skip("this torch has no oneDNN product")
    monkeypatch.delenv(kernels.ENV, raising=False)
    for name in ("_BACKEND", "_OP", "_REORDER", "_PROBED"):
        monkeypatch.setattr(kernels, name, getattr(kernels, name))
    # hidden 256: the training passes' products are above kernels.MIN_MACS, so the backend matters
    policy = build_tiny_causal_lm(tmp_path / "p256", assets.tokenizer, hidden=256, heads=4, seed=0)
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, [{"prompt": p} for p in prompt_texts(6)])

    def config(name: str) -> dict:
        return grpo_config(
            policy,
            prompts,
            tmp_path / name,
            rollout={"group_size": 2},
            train={"steps": 3, "save_every": 1, "compile": "eager"},
        )

    measured = {"backend": "onednn"}  # what "auto" would measure now
    calls = []

    def auto_backend():
        calls.append(measured["backend"])
        faster = measured["backend"] == "onednn"
        rounds = (
            {"blas": [2.0] * 4, "onednn": [1.0] * 4}
            if faster
            else {"blas": [1.0] * 4, "onednn": [2.0] * 4}
        )
        backend, record = kernels.decide(rounds)
        return backend, {**record, "key": "test", "threads": 1, "cached": False}

    monkeypatch.setattr(kernels, "auto_backend", auto_backend)
    assert grpo_main(config("full")) == 0, capsys.readouterr().err
    save = run.save_checkpoint

    def save_then_die(root, step, **kwargs):
        out = save(root, step, **kwargs)
        if step == 1:
            raise SystemExit("killed after step 1")
        return out

    with monkeypatch.context() as mp:
        mp.setattr(run, "save_checkpoint", save_then_die)
        with pytest.raises(SystemExit, match="killed after step 1"):
            grpo_main(config("crashed"))
    crashed = tmp_path / "crashed"
    assert calls == ["onednn", "onednn"]
    measured["backend"] = "blas"  # the resume's measurement would choose the other backend
    capsys.readouterr()
    assert grpo_main(None, "--resume", str(crashed)) == 0, capsys.readouterr().err
    assert calls == ["onednn", "onednn"]  # nothing measured: the recorded backend was taken
    models = json.loads((crashed / "models.json").read_text())
    assert models["actor"]["cpu_matmul"]["backend"] == "onednn"
    assert models["actor"]["cpu_matmul"]["why"].startswith(
        "train.cpu_matmul = auto: onednn, as the run being resumed recorded"
    )
    assert "cpu matmul" not in capsys.readouterr().out  # nothing changed: nothing to say

    full, resumed = (
        read_jsonl(tmp_path / "full" / "metrics.jsonl"),
        read_jsonl(crashed / "metrics.jsonl"),
    )
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert any(k.startswith("rollout/mismatch") for k in resumed[-1])
    for a, b in zip(full, resumed):
        a, b = without_timing(a), without_timing(b)
        diff = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        assert not diff, f"step {a['step']}: resumed metrics differ: {diff}"
    a = load_safetensors_dir(checkpoint_dirs(tmp_path / "full")[-1] / "policy")
    b = load_safetensors_dir(checkpoint_dirs(crashed)[-1] / "policy")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "final weights differ"

    # The environment overrides the recorded backend: one line says the numbers now differ.
    monkeypatch.setenv(kernels.ENV, "blas")
    assert grpo_main(None, "--resume", str(crashed)) == 0, capsys.readouterr().err
    lines = [line for line in capsys.readouterr().out.splitlines() if "cpu matmul" in line]
    assert lines == [
        "proximal grpo: cpu matmul: blas, not the onednn the run being resumed used "
        "(PROXIMAL_CPU_MATMUL=blas overrides train.cpu_matmul = auto): from here its numbers "
        "differ from an uninterrupted run's in the last digits"
    ]
