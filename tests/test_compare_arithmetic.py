"""``proximal compare --compare.task arithmetic``: the online methods on the arithmetic reasoning task,
rewarded by the answer verifier, with exact match and format errors as held-out columns; and the
config mistakes it refuses in one line before anything trains."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from proximal.cli import main
from proximal.compare import CompareConfig, plan
from proximal.config import load_config
from proximal.demo import DEFAULT_CONFIGS


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compare.methods", "[dpo]"], "'dpo': the arithmetic task has a verifier only"),
        (["--compare.methods", "[grpo@reward_model]"], "the arithmetic task has a verifier only"),
        (["--compare.task", "sums"], "compare.task: 'sums' is not a built-in task"),
        (["--data.sft_model", "."], "needs data.sft_model unset"),
    ],
)
def test_arithmetic_config_mistakes(tmp_path, capsys, args, message):
    argv = ["compare", "--compare.task", "arithmetic", "--output.dir", str(tmp_path / "out")]
    if args[0] == "--data.sft_model":
        args = [*args, "--data.eval_prompts", str(tmp_path)]
    assert main(argv + args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "out" / "runs").exists()


def test_the_tasks_default_methods(tmp_path):
    def groups(**compare):
        cfg = load_config(CompareConfig, None, {f"compare.{k}": v for k, v in compare.items()})
        return list(dict.fromkeys(r.group for r in plan(cfg)))

    assert groups() == [
        "ppo@reward_model",
        "dpo",
        "simpo",
        "grpo@verifier",
        "rloo@verifier",
    ]
    assert groups(task="arithmetic") == ["ppo@verifier", "grpo@verifier", "rloo@verifier"]
    # a bare ppo learns from the verifier where there is no reward model
    assert groups(task="arithmetic", methods=["ppo", "grpo"]) == ["ppo@verifier", "grpo@verifier"]


@pytest.mark.slow
def test_a_small_arithmetic_comparison(tmp_path):
    # The packaged arithmetic configs, with a 10-step SFT: the plumbing, not the learning.
    configs = tmp_path / "configs"
    shutil.copytree(DEFAULT_CONFIGS / "arithmetic", configs)
    sft = yaml.safe_load((configs / "sft.yaml").read_text())
    sft["train"].update(steps=10, eval_every=5)
    sft["optim"]["warmup_steps"] = 2
    (configs / "sft.yaml").write_text(yaml.safe_dump(sft))
    out = tmp_path / "out"
    rc = main(
        [
            "compare",
            "--compare.task",
            "arithmetic",
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
    assert list(rows) == ["ppo@verifier", "grpo@verifier", "rloo@verifier"]
    for group, row in rows.items():
        assert row["finished"] == 1, row["failed"]
        ev = json.loads((out / "runs" / f"{group}-seed0" / "eval.json").read_text())["final"]
        assert set(ev["mean"]) >= {"gold", "format_error", "kl", "length"}
        # the held-out columns are the task's own functions of the logged responses
        from proximal.tasks.arithmetic import exact_match, format_error

        prompts = [r["prompt"] for r in ev["rows"]]
        responses = [r["response"] for r in ev["rows"]]
        assert [r["gold"] for r in ev["rows"]] == exact_match(prompts, responses)
        assert [r["format_error"] for r in ev["rows"]] == format_error(prompts, responses)
        assert row["format_error"][0] == pytest.approx(ev["mean"]["format_error"], abs=1e-12)
        # trained on the verifier: the run's config says so
        cfg = yaml.safe_load((out / "runs" / f"{group}-seed0" / "config.yaml").read_text())
        assert cfg["model"]["reward_functions"][0] == "proximal.tasks.arithmetic:verify"
        assert cfg["model"]["reward_model"] is None
    text = (out / "compare.md").read_text()
    assert (
        "| method | gold ↑ | KL to SFT | length | format errors |" in text
        and "| PPO (verifier) |" in text
    )
    assert Path(out / "base" / "task" / "prompts_eval.jsonl").is_file()
