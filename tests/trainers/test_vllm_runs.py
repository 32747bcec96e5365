"""Runs with ``rollout.engine: vllm`` (issue 41): a GRPO run stopped after a checkpoint and resumed
equals the uninterrupted run — every metric, the samples and the final weights, bitwise on CPU
float32 — because each row samples with its own seed (``row_seed``) on a new engine as on the old.

vLLM takes over process-wide state when it starts, and its parallel state is one per process: these
tests carry the ``vllm`` marker and run in their own pytest process in ``.venv-vllm``, and each run's
engine is closed before the next is built (the trainers close it at the end of a run; a run killed
mid-way is closed here)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm builds .venv-vllm)")

from grpo_support import grpo_config, grpo_main, read_jsonl  # noqa: E402
from ppo_support import (  # noqa: E402
    checkpoint_dirs,
    load_safetensors_dir,
    prompt_texts,
    without_timing,
)

from proximal.data.jsonl import write_jsonl  # noqa: E402
from proximal.models.tiny import build_tiny_causal_lm  # noqa: E402

pytestmark = pytest.mark.vllm

STEPS, CHECKPOINT = 4, 2


@pytest.fixture
def engines(monkeypatch):
    """Every engine the trainers build, closed at the test's end (a closed one stays closed)."""
    from proximal.trainers import online

    built = []
    build = online.build_engine

    def build_and_keep(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(online, "build_engine", build_and_keep)
    yield built
    for engine in built:
        engine.close()


def _config(policy, tmp, name: str) -> dict:
    prompts = tmp / "prompts.jsonl"  # 6 prompts, 2 per step: the checkpoint falls mid-pass
    write_jsonl(prompts, [{"prompt": p} for p in prompt_texts(6)])
    return grpo_config(
        policy,
        prompts,
        tmp / name,
        model={"reward_functions": ["grpo_support:has_a"]},
        rollout={"group_size": 2, "engine": "vllm", "kv_cache_gib": 0.03125},
        grpo={
            "iterations": 2,
            "mini_batch_size": 2,
            "micro_batch_size": 1,
            "beta": 0.1,
            "skip_uniform_groups": True,
        },
        optim={"warmup_steps": 6, "lr": 1e-2},
        train={"steps": STEPS, "save_every": CHECKPOINT, "keep_checkpoints": 3},
    )


def test_a_grpo_run_stopped_and_resumed_with_vllm_equals_the_uninterrupted_run(
    assets, tmp_path, monkeypatch, capsys, engines
):
    from proximal.train import run

    # head dimension 32 (hidden 64, 2 heads): one vLLM's CPU attention runs
    policy = build_tiny_causal_lm(
        tmp_path / "qwen2_h64", assets.tokenizer, arch="qwen2", hidden=64, heads=2, seed=0
    )
    assert grpo_main(_config(policy, tmp_path, "full")) == 0, capsys.readouterr().err
    assert len(engines) == 1
    save = run.save_checkpoint

    def save_then_die(root, step, **kwargs):
        out = save(root, step, **kwargs)
        if step == CHECKPOINT:
            raise SystemExit(f"killed after step {step}")  # escapes the CLI, as a crash would
        return out

    with monkeypatch.context() as mp:
        mp.setattr(run, "save_checkpoint", save_then_die)
        with pytest.raises(SystemExit, match="killed after step 2"):
            grpo_main(_config(policy, tmp_path, "crashed"))
    engines[-1].close()  # the killed run never reached its end, where the trainer closes it
    crashed = tmp_path / "crashed"
    assert [r["step"] for r in read_jsonl(crashed / "metrics.jsonl")] == [1, 2]
    assert grpo_main(None, "--resume", str(crashed)) == 0, capsys.readouterr().err
    assert len(engines) == 3

    full, resumed = (
        read_jsonl(tmp_path / "full" / "metrics.jsonl"),
        read_jsonl(crashed / "metrics.jsonl"),
    )
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert any(k.startswith("rollout/mismatch") for k in full[-1])  # μ is vLLM's: measured
    for a, b in zip(full, resumed):
        a, b = without_timing(a), without_timing(b)
        diff = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        assert not diff, f"step {a['step']}: resumed metrics differ: {diff}"
    assert read_jsonl(tmp_path / "full" / "samples.jsonl") == read_jsonl(crashed / "samples.jsonl")
    # the policy moved: the steps after the checkpoint sampled from pushed, updated weights
    assert full[-1]["data/skipped_uniform_groups"] < STEPS * 2
    a = load_safetensors_dir(checkpoint_dirs(tmp_path / "full")[-1] / "policy")
    b = load_safetensors_dir(checkpoint_dirs(crashed)[-1] / "policy")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "final weights differ"
    p = load_safetensors_dir(policy)
    assert any(not torch.equal(a[k], p[k]) for k in p), "the run never updated the policy"


def test_a_stale_grpo_run_samples_with_vllm_in_its_generator(assets, tmp_path, capsys, engines):
    """rollout.staleness 1 with rollout.engine vllm: the generator process runs its own vLLM engine.
    Step 1's batch (version 0, the starting weights) is the synchronous vllm run's step 1, row for
    row — vLLM's sampler, not the hf engine's — and steps 2 and 3 follow the schedule."""
    policy = build_tiny_causal_lm(
        tmp_path / "qwen2_h64", assets.tokenizer, arch="qwen2", hidden=64, heads=2, seed=0
    )

    def config(name, staleness, engine="vllm"):
        cfg = _config(policy, tmp_path, name)
        cfg["rollout"].update({"staleness": staleness, "engine": engine})
        cfg["train"].update({"steps": 3, "save_every": 0})
        return cfg

    assert grpo_main(config("sync", 0)) == 0, capsys.readouterr().err
    assert grpo_main(config("stale", 1)) == 0, capsys.readouterr().err
    assert grpo_main(config("hf", 0, engine="hf")) == 0, capsys.readouterr().err
    rows = read_jsonl(tmp_path / "stale" / "metrics.jsonl")
    assert [r["rollout/version"] for r in rows] == [0, 0, 1]

    def step(name, t):
        return [
            (r["prompt"], r["response"])
            for r in read_jsonl(tmp_path / name / "samples.jsonl")
            if r["step"] == t
        ]

    assert step("stale", 1) == step("sync", 1)
    assert step("stale", 1) != step("hf", 1)
