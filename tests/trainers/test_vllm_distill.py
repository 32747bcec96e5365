"""``proximal distill`` with ``rollout.engine: vllm`` (issue 44, item 4): the student's responses
are sampled by a vLLM engine holding its own copy of the student's weights, pushed after every
update, exactly as in GRPO (``set_up`` is shared); the teacher grades them in the trainer. With the
teacher equal to the student every advantage, the loss and the gradient are exactly 0 — log π_old
and log π_t are both the trainer's, whatever the engine sampled — and with another teacher the run
trains. Seconds: two 2-step runs on a tiny Qwen2 of head dimension 32 (what vLLM's CPU attention
runs); the ``vllm`` marker runs them in .venv-vllm, each in its own pytest process's engine state.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm builds .venv-vllm)")

from ppo_support import command_main, load_safetensors_dir, read_jsonl  # noqa: E402

from proximal.models.tiny import build_tiny_causal_lm  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture
def engines(monkeypatch):
    """Every engine the trainers build, closed at the test's end."""
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


def _config(student, teacher, prompts, run_dir) -> dict:
    return {
        "model": {"path": str(student), "teacher": str(teacher)},
        "data": {"prompts": str(prompts), "max_prompt_length": 16},
        "rollout": {
            "batch_size": 2,
            "group_size": 2,
            "max_new_tokens": 8,
            "engine": "vllm",
            "kv_cache_gib": 0.03125,
        },
        "distill": {"micro_batch_size": 2},
        "optim": {"lr": 1e-2},
        "train": {"steps": 2, "seed": 0, "device": "cpu"},
        "output": {"dir": str(run_dir), "progress": False, "samples_per_step": 2},
    }


def test_distill_samples_with_vllm_and_the_teacher_grades_in_the_trainer(
    assets, tmp_path, capsys, engines
):
    # head dimension 32 (hidden 64, 2 heads): one vLLM's CPU attention runs
    student = build_tiny_causal_lm(
        tmp_path / "student", assets.tokenizer, arch="qwen2", hidden=64, heads=2, seed=0
    )
    teacher = build_tiny_causal_lm(
        tmp_path / "teacher", assets.tokenizer, arch="qwen2", hidden=64, heads=2, seed=7
    )
    same = tmp_path / "same"
    assert command_main("distill", _config(student, student, assets.prompts, same)) == 0, (
        capsys.readouterr().err
    )
    assert len(engines) == 1
    for r in read_jsonl(same / "metrics.jsonl"):
        assert r["distill/reverse_kl"] == 0.0 and r["advantage/token_mean"] == 0.0
        assert r["loss/policy"] == 0.0 and r["grad_norm/actor"] == 0.0
        assert "rollout/mismatch_k1" in r  # μ is the engine's, measured against π_old

    other = tmp_path / "other"
    assert command_main("distill", _config(student, teacher, assets.prompts, other)) == 0, (
        capsys.readouterr().err
    )
    assert len(engines) == 2
    rows = read_jsonl(other / "metrics.jsonl")
    for r in rows:
        assert math.isfinite(r["distill/reverse_kl"]) and r["distill/reverse_kl"] != 0.0
        assert r["grad_norm/actor"] > 0
    # step 2 sampled from the pushed, updated weights; the exported student moved
    final = load_safetensors_dir(other)
    start = load_safetensors_dir(student)
    assert any(not torch.equal(final[k], start[k]) for k in start), "the student never trained"
