"""``proximal dpo`` / ``proximal simpo`` through the real command line: every tiny architecture, LoRA and
resume, bad input (one line, exit status 2 — or 1 for a training failure — no traceback), and every
config field documented. One process against two: ``tests/distributed/test_run_invariance.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from test_dpo import count_task, write_jsonl  # noqa: E402  (tests/trainers is on sys.path)

from proximal.cli import main
from proximal.config import describe
from proximal.logging import read_metrics
from proximal.models.loading import load_causal_lm
from proximal.trainers.dpo import DPOConfig, SimPOConfig


def write_yaml(path, model_path, tmp_path, method, train_rows=None, **sections):
    cfg = {
        "model": {"path": str(model_path)},
        "data": {
            "train_file": write_jsonl(
                tmp_path / "train.jsonl", train_rows or count_task(16, seed=5)
            ),
            "eval_file": write_jsonl(tmp_path / "eval.jsonl", count_task(8, seed=6)),
            "max_length": 16,
        },
        "train": {"batch_size": 8, "micro_batch_size": 4, "steps": 2, "device": "cpu"},
        "optim": {"lr": 1e-3},
        "output": {"dir": str(tmp_path / "run"), "progress": False},
    }
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("method", ["dpo", "simpo"])
def test_cli_end_to_end(assets, tmp_path, capsys, arch, method):
    config = write_yaml(tmp_path / f"{method}.yaml", assets.policy(arch), tmp_path, method)
    assert main([method, "--config", config, "--train.seed", "3"]) == 0, capsys.readouterr().err
    out = tmp_path / "run"
    for name in (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "config.yaml",
        "metrics.jsonl",
    ):
        assert (out / name).is_file(), name
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["seed"] == 3
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in (
        "loss",
        "reward_chosen",
        "reward_rejected",
        "reward_margin",
        "accuracy",
        "logp_chosen",
        "logp_rejected",
    ):
        assert f"train/{key}" in rows[1]
        assert f"eval/{key}" in rows[2]
    for key in ("train/grad_norm", "train/lr", "speed/tokens_per_s"):
        assert rows[1][key] > 0
    assert rows[2]["eval/kl"] > 0 and rows[0]["eval/kl"] == 0.0
    assert f"proximal {method}: held-out preference accuracy" in capsys.readouterr().out
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == arch


def test_cli_lora_runs_and_resumes(assets, tmp_path, capsys):
    config = write_yaml(
        tmp_path / "dpo.yaml",
        assets.policy("llama"),
        tmp_path,
        "dpo",
        model={"lora_r": 4},
        train={"save_every": 1, "steps": 1},
        optim={"lr": 1e-2},
        output={"merge_lora": False},  # the adapters alone (merged: test_lora_exports.py)
    )
    assert main(["dpo", "--config", config]) == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "adapter_config.json").is_file()
    assert main(["dpo", "--resume", str(tmp_path / "run"), "--train.steps", "2"]) == 0, (
        capsys.readouterr().err
    )
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[0]["eval/kl"] == 0.0 < rows[2]["eval/kl"]


def test_a_lora_run_is_the_next_stage_s_model_with_its_adapters_merged(assets, tmp_path, capsys):
    """model.path = a LoRA run's directory: one plain model whose outputs are the adapted policy's
    (loaded as transformers would by default, the adapters would be trained on top and exported alone)."""
    from peft import AutoPeftModelForCausalLM

    config = write_yaml(
        tmp_path / "dpo.yaml",
        assets.policy("llama"),
        tmp_path,
        "dpo",
        model={"lora_r": 4},
        train={"steps": 2},
        optim={"lr": 5e-2},
        output={"merge_lora": False},  # an adapters-only run directory as the next stage's model
    )
    assert main(["dpo", "--config", config]) == 0, capsys.readouterr().err
    merged = load_causal_lm(str(tmp_path / "run"))
    assert not hasattr(merged, "peft_config") and not any(
        "lora" in n for n, _ in merged.named_parameters()
    )
    adapted = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "run"))
    base = load_causal_lm(str(assets.policy("llama")))
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        want, got, before = (m(input_ids=ids).logits for m in (adapted, merged, base))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - before).abs().max() > 1e-3  # the adapters did change the model


# --------------------------------------------------------------------------------------------------
# Bad input: one line, the row or the field, no traceback
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["dpo", "simpo"])
@pytest.mark.parametrize(
    "row, overrides, message",
    [
        (
            {"prompt": "1 ", "chosen": "ab", "rejected": "ab"},
            [],
            "{f}:3: 'chosen' and 'rejected' are the same response, so the pair teaches nothing",
        ),
        ({"prompt": "1 ", "chosen": "", "rejected": "ab"}, [], "{f}:3: 'chosen' is empty"),
        (
            {"prompt": "0123456789012345", "chosen": "a", "rejected": "b"},
            ["--data.on_too_long", "truncate"],
            "{f}:3: the prompt is 16 tokens, which leaves no room for a response within data.max_length = 16",
        ),
        (
            {"prompt": "0123456789", "chosen": "aaaaaaaaa", "rejected": "b"},
            [],
            "{f}:3: prompt + chosen is 20 tokens (prompt 10 + response and EOS 10), longer than data.max_length = 16",
        ),
    ],
)
def test_bad_rows_are_one_line_naming_file_and_line(
    assets, tmp_path, capsys, method, row, overrides, message
):
    f = tmp_path / "prefs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in count_task(2, seed=1) + [row]))
    config = write_yaml(
        tmp_path / "c.yaml",
        assets.policy("llama"),
        tmp_path,
        method,
        train={"batch_size": 2, "micro_batch_size": 2},
    )
    assert main([method, "--config", config, "--data.train_file", str(f), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"proximal {method}: " + message.format(f=f)), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained


@pytest.mark.parametrize("method", ["dpo", "simpo"])
def test_a_non_finite_loss_stops_the_run_with_exit_status_1(assets, tmp_path, capsys, method):
    # An absurd learning rate: the first step is finite; Adam's ±lr moves make the next forward overflow.
    config = write_yaml(
        tmp_path / "c.yaml",
        assets.policy("llama"),
        tmp_path,
        method,
        optim={"lr": 1e30, "max_grad_norm": 0},
        train={"steps": 3},
    )
    assert main([method, "--config", config]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"proximal {method}: step 2: the {method.upper()} loss is nan; the step was not applied"
    ), err
    assert "Traceback" not in err
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1]


def test_config_errors_are_one_message(assets, tmp_path, capsys):
    config = write_yaml(tmp_path / "d.yaml", assets.policy("llama"), tmp_path, "dpo")
    assert (
        main(
            [
                "dpo",
                "--config",
                config,
                "--dpo.beta",
                "0",
                "--dpo.loss_type",
                "ipo",
                "--dpo.label_smoothing",
                "0.1",
                "--train.batch_size",
                "6",
                "--data.on_too_long",
                "cut",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("proximal dpo:") == 1
    assert "dpo.beta = 0.0 must lie in (0, ∞) (DPO β)" in err
    assert "dpo.label_smoothing = 0.1: the ipo loss has no label-noise variant; use 0" in err
    assert "train.batch_size = 6 is not divisible by train.micro_batch_size = 4" in err
    assert err.count("not divisible") == 1  # each problem once
    assert "data.on_too_long: 'cut' is not one of 'error', 'skip', 'truncate'" in err
    config = write_yaml(tmp_path / "s.yaml", assets.policy("llama"), tmp_path, "simpo")
    assert (
        main(
            [
                "simpo",
                "--config",
                config,
                "--simpo.gamma_beta_ratio",
                "-1",
                "--simpo.beta",
                "nan",
                "--train.precompute_ref_logprobs",
                "true",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "simpo.gamma_beta_ratio = -1.0 must lie in [0, ∞) (SimPO γ/β)" in err
    assert "simpo.beta = nan must lie in (0, ∞) (SimPO β)" in err
    assert (
        "train.precompute_ref_logprobs: unknown key" in err
    )  # SimPO has no reference to precompute
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------------
# Documentation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls, page", [(DPOConfig, "dpo.md"), (SimPOConfig, "simpo.md")])
def test_every_field_is_documented(cls, page):
    doc = (Path(__file__).parents[2] / "docs" / page).read_text()
    for name, _, _, help_ in describe(cls):
        assert help_, name
        assert f"`{name}`" in doc, f"docs/{page} does not document {name}"


def test_dpo_and_simpo_share_every_section_but_their_own():
    dpo = [n for n, *_ in describe(DPOConfig) if not n.startswith("dpo.")]
    simpo = [n for n, *_ in describe(SimPOConfig) if not n.startswith("simpo.")]
    assert sorted(set(dpo) - set(simpo)) == ["train.precompute_ref_logprobs"]
    assert set(simpo) <= set(dpo)
