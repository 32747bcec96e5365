"""``proximal compare --compare.task calculator``: the online methods with the calculator tool and the
no-tool baseline row, the tool runs evaluated as trajectories (tool calls, tool errors beside exact
match), the no-tool one against its own SFT model; and the config mistakes it refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from proximal.cli import main
from proximal.compare import CompareConfig, plan
from proximal.config import load_config
from proximal.demo import DEFAULT_CONFIGS


def test_the_calculator_tasks_runs():
    cfg = load_config(CompareConfig, None, {"compare.task": "calculator", "compare.seeds": 2})
    runs = plan(cfg)
    assert [r.name for r in runs] == [
        "ppo@verifier-seed0",
        "grpo@verifier-seed0",
        "rloo@verifier-seed0",
        "grpo@verifier-notool-seed0",
        "ppo@verifier-seed1",
        "grpo@verifier-seed1",
        "rloo@verifier-seed1",
        "grpo@verifier-notool-seed1",
    ]
    assert cfg.compare.response_limit() == 24  # one turn's


def test_calculator_config_mistakes(tmp_path, capsys):
    argv = ["compare", "--compare.task", "calculator", "--output.dir", str(tmp_path / "out")]
    assert main([*argv, "--compare.methods", "[dpo]"]) == 2
    err = capsys.readouterr().err
    assert "'dpo': the calculator task has a verifier only" in err and "Traceback" not in err, err
    assert not (tmp_path / "out" / "runs").exists()


@pytest.mark.slow
def test_a_small_calculator_comparison(tmp_path):
    # The packaged calculator configs with 10-step SFTs: the plumbing, not the learning.
    configs = tmp_path / "configs"
    shutil.copytree(DEFAULT_CONFIGS / "calculator", configs)
    for name in ("sft", "sft_notool"):
        sft = yaml.safe_load((configs / f"{name}.yaml").read_text())
        sft["train"].update(steps=10, eval_every=5)
        sft["optim"]["warmup_steps"] = 2
        (configs / f"{name}.yaml").write_text(yaml.safe_dump(sft))
    out = tmp_path / "out"
    rc = main(
        [
            "compare",
            "--compare.task",
            "calculator",
            "--compare.methods",
            "[grpo]",
            "--compare.configs",
            str(configs),
            "--compare.seeds",
            "1",
            "--compare.responses",
            "64",
            "--compare.evaluations",
            "1",
            "--compare.eval_samples_per_prompt",
            "1",
            "--output.dir",
            str(out),
            "--output.progress",
            "false",
        ]
    )
    assert rc == 0
    result = json.loads((out / "compare.json").read_text())
    rows = {row["group"]: row for row in result["table"]}
    assert list(rows) == ["grpo@verifier", "grpo@verifier-notool"]
    from proximal.tasks.calculator import exact_match

    for group, row in rows.items():
        assert row["finished"] == 1, row["failed"]
        run = out / "runs" / f"{group}-seed0"
        ev = json.loads((run / "eval.json").read_text())
        final = ev["final"]
        tool = group == "grpo@verifier"
        assert all(("trajectory" in r) == tool for r in final["rows"])
        assert ("tool_calls" in final["mean"]) == tool
        prompts = [r["prompt"] for r in final["rows"]]
        responses = [r["response"] for r in final["rows"]]
        assert [r["gold"] for r in final["rows"]] == exact_match(prompts, responses)
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["model"]["reward_functions"][0] == "proximal.tasks.calculator:verify"
        assert bool(cfg["tools"]["functions"]) == tool
        # each run starts from (and is measured against) its own SFT model
        assert cfg["model"]["path"] == str(out / "base" / ("sft" if tool else "sft_notool"))
        assert ev["curve"][0]["policy"] == cfg["model"]["path"]
    text = (out / "compare.md").read_text()
    assert "tool calls / trajectory" in text and "| GRPO (verifier), no tool |" in text
