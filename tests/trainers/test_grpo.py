"""The real ``proximal grpo`` command end to end on the tiny Llama, GPT-2 and Qwen2 models, with each
loss and each advantage mode; rewards from a reward model and reward functions; β = 0 loading no
reference; LoRA's reference as the adapters switched off; DAPO's filters counted; bad input in one
line with exit status 2; and every config field documented."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from grpo_support import REQUIRED_METRICS, grpo_config, grpo_main, read_jsonl
from ppo_support import Spy, checkpoint_dirs

from proximal.config import describe
from proximal.train import host
from proximal.trainers.grpo_config import GRPOConfig


def _assert_healthy(rows: list[dict], steps: int, *, beta: float, max_new_tokens: int = 8) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    required = [k for k in REQUIRED_METRICS if beta > 0 or k != "kl/ref_k3"]
    for r in rows:
        missing = [k for k in required if k not in r]
        assert not missing, f"step {r['step']}: metrics missing {missing}"
        if (
            r["policy/optimizer_steps"] == 0
        ):  # every row filtered out: the update's statistics are null
            assert r["data/trained_frac"] == 0.0 and r["policy/entropy"] is None
            continue
        bad = {
            k: r[k]
            for k in required
            if not (isinstance(r[k], (int, float)) and math.isfinite(r[k]))
        }
        assert not bad, f"step {r['step']}: non-finite metrics {bad}"
        assert 0 <= r["policy/clipfrac_low"] <= 1 and 0 <= r["policy/clipfrac_high"] <= 1
        assert 0 <= r["data/uniform_group_frac"] <= 1 and 0 <= r["response/eos_frac"] <= 1
        assert 1 <= r["response/length_mean"] <= max_new_tokens
        assert r["policy/entropy"] > 0 and r["score/std"] >= 0
        if beta > 0:
            assert r["kl/ref_k3"] >= 0
        else:
            assert "kl/ref_k3" not in r and r["loss/kl"] == 0.0


# Each loss and each advantage mode runs on every architecture; the DAPO row also has DAPO's other
# pieces (clip-higher, β = 0, overlong and dynamic-sampling filters; stop strings make most responses
# stop, so the overlong filter leaves some to train on; a length reward, so the dynamic-sampling
# filter leaves groups whose rewards differ), the Dr. GRPO row β = 0 as in
# its paper, and the RLOO row μ = 2 iterations of two mini-batches each.
COMBOS = {
    "grpo-group": ["--grpo.loss", "grpo", "--grpo.advantage", "group"],
    "dr_grpo-unscaled": [
        "--grpo.loss",
        "dr_grpo",
        "--grpo.advantage",
        "unscaled",
        "--grpo.beta",
        "0",
    ],
    "dapo-batch": [
        "--grpo.loss",
        "dapo",
        "--grpo.advantage",
        "batch",
        "--grpo.beta",
        "0",
        "--grpo.clip_eps_high",
        "0.28",
        "--grpo.mask_truncated",
        "true",
        "--grpo.skip_uniform_groups",
        "true",
        "--rollout.stop_strings",
        "[a, b, c, d]",
        "--model.reward_functions",
        "[ppo_support:length]",
    ],
    "grpo-rloo": [
        "--grpo.advantage",
        "rloo",
        "--grpo.iterations",
        "2",
        "--grpo.mini_batch_size",
        "4",
        "--grpo.micro_batch_size",
        "2",
    ],
}


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_cli_runs_each_loss_and_advantage(arch, combo, assets, tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = grpo_config(assets.policy(arch), assets.prompts, run_dir)
    rc = grpo_main(cfg, *COMBOS[combo])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert f"run directory {run_dir}" in out
    rows = read_jsonl(run_dir / "metrics.jsonl")
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    _assert_healthy(rows, steps=2, beta=saved["grpo"]["beta"])
    steps_per_update = saved["grpo"]["iterations"] * (8 // (saved["grpo"]["mini_batch_size"] or 8))
    if combo == "dapo-batch":
        assert any(r["policy/optimizer_steps"] > 0 for r in rows)
    for r in rows:
        assert r["policy/optimizer_steps"] <= steps_per_update
        if (
            combo == "dapo-batch"
        ):  # only the responses that stopped, of groups that differ, are trained on
            assert r["data/trained_frac"] <= r["response/eos_frac"] + 1e-12
            assert r["data/skipped_uniform_groups"] >= 0
        else:
            assert r["data/trained_frac"] == 1.0 and r["policy/optimizer_steps"] == steps_per_update
    [ckpt] = checkpoint_dirs(run_dir)
    assert (ckpt / "policy" / "model.safetensors").is_file()
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == [
        "policy",
        "rng",
        "state",
    ]  # no critic
    assert len(read_jsonl(run_dir / "samples.jsonl")) == 4


def test_reward_model_and_reward_functions_together(assets, tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = grpo_config(
        assets.policy("llama"),
        assets.prompts,
        run_dir,
        model={
            "reward_model": str(assets.reward_model("llama")),
            "reward_model_weight": 0.5,
            "reward_functions": ["ppo_support:frac_a"],
            "reward_function_weights": [2.0],
        },
    )
    assert grpo_main(cfg, "--train.steps", "1") == 0, capsys.readouterr().err
    [row] = read_jsonl(run_dir / "metrics.jsonl")
    assert row["score/mean"] == pytest.approx(
        0.5 * row["score/reward_model"] + 2.0 * row["score/ppo_support:frac_a"], abs=1e-6
    )
    for s in read_jsonl(run_dir / "samples.jsonl"):
        assert s["score"] == pytest.approx(
            0.5 * s["score/reward_model"] + 2.0 * s["score/ppo_support:frac_a"], abs=1e-6
        )


def _count_policy_loads(monkeypatch) -> list[str]:
    from proximal.models import policy

    loads: list[str] = []
    load = policy.load_causal_lm

    def counting(path, **kw):
        loads.append(kw.get("role", ""))
        return load(path, **kw)

    monkeypatch.setattr(policy, "load_causal_lm", counting)
    return loads


def test_beta_zero_loads_no_reference(assets, tmp_path, monkeypatch, capsys):
    from proximal.trainers import grpo

    loads = _count_policy_loads(monkeypatch)
    spy = Spy(grpo.build_models)
    monkeypatch.setattr(grpo, "build_models", spy)
    cfg = grpo_config(assets.policy("llama"), assets.prompts, tmp_path / "run", grpo={"beta": 0.0})
    assert grpo_main(cfg, "--train.steps", "1") == 0, capsys.readouterr().err
    assert spy.results[-1].reference is None
    assert loads == ["policy (model.path)"]  # one causal LM in memory: the actor

    loads.clear()
    cfg = grpo_config(assets.policy("llama"), assets.prompts, tmp_path / "run2", grpo={"beta": 0.1})
    assert grpo_main(cfg, "--train.steps", "1") == 0
    assert loads == ["policy (model.path)", "reference (model.path)"]
    [row] = read_jsonl(tmp_path / "run2" / "metrics.jsonl")
    assert (
        row["kl/ref_k3"] == 0.0
    )  # one optimiser step, taken on the rollout policy = the reference, bitwise


def test_lora_reference_is_the_policy_with_adapters_off(assets, tmp_path, monkeypatch, capsys):
    from proximal.trainers import grpo

    loads = _count_policy_loads(monkeypatch)
    spy = Spy(grpo.build_models)
    monkeypatch.setattr(grpo, "build_models", spy)
    run_dir = tmp_path / "run"
    cfg = grpo_config(
        assets.policy("llama"),
        assets.prompts,
        run_dir,
        model={"lora_r": 4},
        optim={"lr": 5e-2},
        grpo={"beta": 0.1},
    )
    # the adapters alone in the checkpoints (merged: tests/trainers/test_lora_exports.py)
    assert grpo_main(cfg, "--train.steps", "3", "--output.merge_lora", "false") == 0, (
        capsys.readouterr().err
    )
    models = spy.results[-1]
    assert models.reference.shares_actor and models.reference.model is models.actor
    assert loads == ["policy (model.path)"]  # no second copy of the weights
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[0]["kl/ref_k3"] == 0.0  # LoRA's B starts at 0: π_θ = π_ref exactly
    assert rows[-1]["kl/ref_k3"] > 0  # the adapters moved the policy away from the reference
    ckpt = checkpoint_dirs(run_dir)[-1]
    assert (ckpt / "policy" / "adapter_model.safetensors").is_file()
    assert not (ckpt / "policy" / "model.safetensors").exists()


def test_uniform_groups_are_counted_and_skipped(assets, tmp_path, capsys):
    """A constant reward: every group is uniform (zero advantage). With the filter every group is left
    out and counted, and no optimiser step is taken; without it they are trained on (only β·k3 acts)."""
    skip = tmp_path / "skip"
    cfg = grpo_config(
        assets.policy("llama"),
        assets.prompts,
        skip,
        model={"reward_functions": ["ppo_support:constant"]},
        grpo={"skip_uniform_groups": True},
        train={"steps": 3},
    )
    assert grpo_main(cfg) == 0, capsys.readouterr().err
    rows = read_jsonl(skip / "metrics.jsonl")
    assert [r["data/uniform_group_frac"] for r in rows] == [1.0] * 3
    assert [r["data/skipped_uniform_groups"] for r in rows] == [
        2,
        4,
        6,
    ]  # 2 prompts (groups) per step
    assert all(r["data/trained_frac"] == 0.0 and r["policy/optimizer_steps"] == 0 for r in rows)
    keep = tmp_path / "keep"
    cfg["output"]["dir"] = str(keep)
    cfg["grpo"]["skip_uniform_groups"] = False
    assert grpo_main(cfg) == 0
    rows = read_jsonl(keep / "metrics.jsonl")
    assert all(
        r["data/skipped_uniform_groups"] == 0 and r["policy/optimizer_steps"] == 1 for r in rows
    )
    assert all(
        r["advantage/min"] == r["advantage/max"] == 0.0 and r["loss/policy"] == 0.0 for r in rows
    )


def test_bf16_mixed_runs(assets, tmp_path, capsys, monkeypatch):
    """A bf16-mixed run trains; on a CPU without bfloat16 products (stood in for, so that every CPU
    runs this) it says at its start that torch emulates them and what to use instead."""
    monkeypatch.setattr(host, "bfloat16_instructions", lambda: False)
    run_dir = tmp_path / "run"
    cfg = grpo_config(
        assets.policy("llama"),
        assets.prompts,
        run_dir,
        train={"precision": "bf16-mixed", "steps": 1},
    )
    assert grpo_main(cfg) == 0, capsys.readouterr().err
    _assert_healthy(read_jsonl(run_dir / "metrics.jsonl"), steps=1, beta=0.04)
    out = capsys.readouterr()
    said = [
        line for line in (out.out + out.err).splitlines() if "without bfloat16 products" in line
    ]
    assert len(said) == 1 and said[0].endswith("use --train.precision 32-true on this CPU"), said


# ----------------------------------------------------------------------------------------------
# Bad input: one line, exit status 2, before any model is loaded
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rollout.group_size", "1"], "rollout.group_size = 1 must be ≥ 2"),
        (
            ["--grpo.mini_batch_size", "3"],
            "rollout.batch_size × rollout.group_size = 8 is not divisible by "
            "grpo.mini_batch_size = 3",
        ),
        (
            ["--grpo.micro_batch_size", "3"],
            "rollout.batch_size × rollout.group_size = 8 is not divisible by "
            "grpo.micro_batch_size = 3",
        ),
        (
            ["--grpo.mini_batch_size", "4", "--grpo.micro_batch_size", "8"],
            "grpo.mini_batch_size = 4 is not divisible by grpo.micro_batch_size = 8",
        ),
        (["--grpo.clip_eps_high", "0"], "grpo.clip_eps_high = 0.0 must lie in (0, ∞)"),
        (["--grpo.beta", "-0.1"], "grpo.beta = -0.1 must lie in [0, ∞)"),
        (["--grpo.iterations", "0"], "grpo.iterations = 0 must be ≥ 1"),
        (["--grpo.loss", "ppo"], "grpo.loss: 'ppo' is not one of 'grpo', 'dr_grpo', 'dapo'"),
        (
            ["--grpo.advantage", "gae"],
            "grpo.advantage: 'gae' is not one of 'group', 'batch', 'unscaled', 'rloo'",
        ),
    ],
)
def test_bad_config_is_one_line_and_exit_2(args, message, assets, tmp_path, monkeypatch, capsys):
    from proximal.trainers import grpo

    def forbidden(*a, **kw):
        raise AssertionError("models were loaded before the config error was reported")

    monkeypatch.setattr(grpo, "build_models", forbidden)
    cfg = grpo_config(assets.policy("llama"), assets.prompts, tmp_path / "run")
    rc = grpo_main(cfg, *args)
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err, err
    assert "Traceback" not in err and err.count("invalid configuration") == 1
    assert not (tmp_path / "run").exists()


def test_batch_not_divisible_by_processes_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = GRPOConfig()
    cfg.rollout.batch_size = 3
    assert any(
        "rollout.batch_size = 3 is not divisible by the 2 processes" in p for p in cfg.validate()
    )
    cfg.rollout.batch_size, cfg.rollout.group_size, cfg.grpo.micro_batch_size = 2, 4, 8
    assert any(
        "over 2 processes is 4 rows each, not divisible by grpo.micro_batch_size = 8" in p
        for p in cfg.validate()
    )


def test_every_field_is_documented():
    """Every field has help text and a row of docs/grpo.md's tables showing its current default (the
    rendering and the table reader of tests/test_docs.py)."""
    from test_docs import render_default, table_rows

    rows = table_rows((Path(__file__).parents[2] / "docs" / "grpo.md").read_text())
    for name, _, default, help_ in describe(GRPOConfig):
        assert help_, name
        lines = rows.get(f"`{name}`")
        assert lines, f"docs/grpo.md has no table row for {name}"
        assert any(f"`{render_default(default)}`" in line for line in lines), (
            f"docs/grpo.md: the row of {name} does not show its default `{render_default(default)}`"
        )


def test_the_command_is_registered(capsys):
    from proximal.cli import main

    with pytest.raises(SystemExit) as e:
        main(["grpo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--grpo.skip_uniform_groups" in out and "--rollout.group_size" in out


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_demo_configs_load(name, assets, tmp_path):
    """proximal/configs/demo/{grpo,rloo}.yaml validate once the demo fills in the paths, train on the
    digit task's verifier and log the gold score without training on it."""
    from proximal.config import load_config
    from proximal.demo import DEFAULT_CONFIGS

    cfg = load_config(
        GRPOConfig,
        DEFAULT_CONFIGS / f"{name}.yaml",
        {
            "model.path": str(assets.policy("llama")),
            "data.prompts": str(assets.prompts),
            "output.dir": str(tmp_path / "run"),
        },
    )
    assert cfg.model.reward_functions == [
        "proximal.tasks.digits:exact_sort",
        "proximal.tasks.digits:gold_score",
    ]
    assert cfg.model.reward_function_weights == [1.0, 0.0]
    assert (
        cfg.responses_per_step == 64
    )  # PPO's demo batch, so the stages compare on the same number of samples
    assert cfg.grpo.advantage == ("rloo" if name == "rloo" else "group")
