"""``proximal grpo --resume RUN_DIR`` reproduces the uninterrupted run exactly: the metrics of the
steps after the checkpoint, the samples and the final weights, bitwise on CPU float32.

The run exercises every piece of resumable state GRPO has: AdamW's moments and a warm-up schedule
that spans the checkpoint, the prompt sampler in the middle of a pass, the skipped-uniform-groups
counter, and the RNGs (sampling is seeded per row; mini-batch shuffling per step).
"""

from __future__ import annotations

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
