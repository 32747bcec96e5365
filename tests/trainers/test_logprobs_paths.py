"""``train.logprobs``: every method's run on the fused path (the default) is its run through the
logits, up to float32 round-off — and under bf16-mixed up to bfloat16's.

Each command runs twice through the real command line on the tiny Llama, two steps (the second
starts from weights the first updated through that path's gradients), once with
``train.logprobs: fused`` and once with ``logits``; every logged number but the clock's must agree.
The paths share nothing past the model's own forward: the logits path is
:func:`proximal.models.heads.lm_logits` + :mod:`proximal.core.logprobs`, the fused one
:mod:`proximal.core.fused` on the hidden states (tests/models/test_output.py checks the two on every
kind of head). PPO runs with the entropy bonus trained on and PTX, so every pass of the method
goes through the path; DPO and SimPO log held-out metrics (DPO with the exact KL to the start).

Tolerance: the two paths compute the same float32 products in another order (a (V, H) product per
chunk against one per batch), about 1e-7 relative on a log-probability; two Adam steps amplify a
difference in a near-zero gradient (Adam's first step is about sign(g)·lr), so the bound on every
logged number is 3e-5 relative (1e-6 absolute; measured here: PPO 3.1e-6, SimPO 2.7e-7, GRPO
7.8e-8, DPO 1.8e-8, SFT 0 — at V = 23 one chunk holds every token, the same product). bf16-mixed:
2e-2 relative or 4e-3 absolute: bfloat16's unit round-off (2^-8 = 3.9e-3) on log-probabilities of
order one, whose differences (the KL to the reference, ~0.03) carry it undivided. How close a CPU
comes depends on its bfloat16 products: 2.3e-2 of a value of ~0.04 (9e-4) where the CPU has them
(AVX-512 BF16: Intel Xeon, AMD Zen 5), 1.4e-3 on PPO's ``kl/seq_mean`` (-0.0299 against -0.0286) on
an AVX2-only AMD Zen 3, where torch emulates them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from ppo_support import without_timing  # noqa: E402  (tests/trainers/ppo is on sys.path)

from proximal.cli import main
from proximal.logging import read_metrics

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"


def _config(command: str, assets, out: Path, logprobs: str, precision: str) -> dict:
    cfg = {
        "model": {"path": str(assets.policy())},
        "train": {
            "steps": 2,
            "seed": 0,
            "device": "cpu",
            "logprobs": logprobs,
            "precision": precision,
        },
        "optim": {"lr": 1e-3},
        "output": {"dir": str(out), "progress": False},
    }
    if command in ("ppo", "grpo"):
        cfg["model"]["reward_functions"] = ["ppo_support:frac_a"]
        cfg["data"] = {"prompts": str(assets.prompts), "max_prompt_length": 16}
        if command == "ppo":
            cfg["model"]["critic"] = "policy"
            cfg["data"].update(ptx_file=str(FIXTURES / "ptx_text.jsonl"), ptx_batch_size=4)
            cfg["rollout"] = {"batch_size": 4, "max_new_tokens": 8}
            cfg["ppo"] = {
                "epochs": 2,
                "mini_batch_size": 4,
                "micro_batch_size": 2,
                "entropy_coef": 0.01,
                "ptx_coef": 0.5,
            }
            cfg["optim"]["critic_lr"] = 1e-3
        else:
            cfg["rollout"] = {"batch_size": 2, "group_size": 4, "max_new_tokens": 8}
            cfg["grpo"] = {"micro_batch_size": 4, "beta": 0.04, "iterations": 2}
    else:
        pairs = command in ("dpo", "simpo")
        data = FIXTURES / ("pref_explicit.jsonl" if pairs else "sft_prompt_completion.jsonl")
        cfg["data"] = {"train_file": str(data), "eval_file": str(data), "max_length": 32}
        cfg["train"].update(batch_size=4, micro_batch_size=2)
        if command == "dpo":
            cfg["train"]["eval_kl"] = True
    return cfg


def _run(command: str, cfg: dict, capsys) -> list[dict]:
    path = Path(cfg["output"]["dir"]).with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    assert main([command, "--config", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "through the logits" not in out  # the tiny Llama's head is one the fused path reads
    return [without_timing(r) for r in read_metrics(Path(cfg["output"]["dir"]) / "metrics.jsonl")]


def _compare(command, assets, tmp_path, capsys, precision, rel, abs_):
    runs = {
        path: _run(
            command,
            _config(command, assets, tmp_path / path, path, precision),
            capsys,
        )
        for path in ("fused", "logits")
    }
    fused, logits = runs["fused"], runs["logits"]
    assert len(fused) == len(logits) >= 2
    compared, worst = 0, 0.0
    for a, b in zip(fused, logits):
        assert a.keys() == b.keys()
        for k, v in a.items():
            if v is None or (isinstance(v, float) and math.isnan(v)):
                assert b[k] is None or math.isnan(b[k]), (a["step"], k)
                continue
            assert v == pytest.approx(b[k], rel=rel, abs=abs_), (a["step"], k, v, b[k])
            if isinstance(v, float):
                compared += 1
                worst = max(worst, abs(v - b[k]) / max(abs(b[k]), abs_))
    assert compared >= 8
    print(f"{command} {precision}: {compared} numbers, largest relative difference {worst:.2g}")
    return fused


@pytest.mark.parametrize("command", ["ppo", "grpo", "dpo", "simpo", "sft"])
def test_fused_run_is_the_logits_run(command, assets, tmp_path, capsys):
    rows = _compare(command, assets, tmp_path, capsys, "32-true", rel=3e-5, abs_=1e-6)
    if command == "ppo":  # the passes the path serves ran: the entropy bonus and PTX
        assert all(r["loss/ptx"] > 0 and r["policy/entropy"] > 0 for r in rows if r["step"] > 0)
    if command == "dpo":
        assert any(r.get("eval/kl", 0) > 0 for r in rows)  # the held-out KL after an update


@pytest.mark.parametrize("command", ["ppo", "dpo"])
def test_fused_run_is_the_logits_run_under_bf16_mixed(command, assets, tmp_path, capsys):
    _compare(command, assets, tmp_path, capsys, "bf16-mixed", rel=2e-2, abs_=4e-3)
