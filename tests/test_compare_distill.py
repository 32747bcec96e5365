"""``proximal compare`` with ``distill`` (issue 44, deliverable 5): on-policy distillation as a
compared method — its teacher (``data.teacher``, or on the arithmetic task a longer GRPO run trained
into ``base/teacher``), its reward sources (the teacher alone, or plus the verifier), the same
sampled-response budget as GRPO, and the report's curve of the held-out score against the
responses sampled."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from proximal.cli import main
from proximal.compare import CompareConfig, Inputs, RunSpec, plan, run_config
from proximal.config import load_config
from proximal.demo import ARITHMETIC_SCORES, ARITHMETIC_VERIFIER, DEFAULT_CONFIGS
from proximal.methods import METHODS, TEACHER, VERIFIER, budget_steps


def _groups(**compare):
    cfg = load_config(CompareConfig, None, {f"compare.{k}": v for k, v in compare.items()})
    return list(dict.fromkeys(r.group for r in plan(cfg)))


def test_distill_is_never_a_default_and_learns_from_the_teacher_by_default():
    assert "distill" not in " ".join(_groups()) + " ".join(_groups(task="arithmetic"))
    assert _groups(task="arithmetic", methods=["grpo", "distill", "distill@verifier"]) == [
        "grpo@verifier",
        "distill@teacher",
        "distill@verifier",
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        # the digit task trains no teacher: it must be given
        (["--compare.methods", "[grpo, distill]"], "'distill' distils a teacher into the SFT"),
        (
            ["--compare.methods", "[distill]", "--data.teacher", "/nonexistent/t"],
            "data.teacher: '/nonexistent/t' does not exist",
        ),
        # your own data: distill plus verify needs the verifier (the teacher alone does not)
        (
            [
                *("--compare.methods", "[distill@verifier]", "--data.teacher", "{tmp}"),
                *("--data.sft_model", "{tmp}", "--data.eval_prompts", "{tmp}"),
                *("--data.prompts", "{tmp}", "--compare.max_new_tokens", "8"),
            ],
            "'distill@verifier' learns from the verifier: set data.verifier",
        ),
        (
            ["--compare.methods", "[distill@reward_model]"],
            "Distill cannot use reward source 'reward_model' (it can use: teacher, verifier)",
        ),
    ],
)
def test_distill_config_mistakes_are_one_line(tmp_path, capsys, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    assert main(["compare", "--output.dir", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "out" / "runs").exists()


def _inputs(tmp_path) -> Inputs:
    """Paths that exist (a config checks them), with nothing in them: no run starts here."""
    for d in ("sft", "teacher"):
        (tmp_path / d).mkdir()
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+2=", "answer": "3"}\n')
    return Inputs(
        sft=str(tmp_path / "sft"),
        reward_model=None,
        prompts=str(tmp_path / "prompts.jsonl"),
        pairs=None,
        eval_pairs=None,
        eval_prompts=str(tmp_path / "eval.jsonl"),
        verifier=ARITHMETIC_VERIFIER,
        gold=ARITHMETIC_SCORES["exact_match"],
        teacher=str(tmp_path / "teacher"),
    )


@pytest.mark.parametrize(
    "source, weights, reward_weight", [(TEACHER, [0.0, 0.0], 0.0), (VERIFIER, [1.0, 0.0], 1.0)]
)
def test_a_distill_run_config_names_the_teacher_and_matches_grpo_s_budget(
    tmp_path, source, weights, reward_weight
):
    """The packaged arithmetic distill.yaml: the teacher and the SFT model filled in; the verifier
    and the gold exact match logged (weight 0) or the verifier trained on as well; as many responses
    a step as grpo.yaml (8 prompts x 8), so the same budget is the same step count."""
    cfg = load_config(CompareConfig, None, {"compare.task": "arithmetic", "compare.responses": 640})
    configs = DEFAULT_CONFIGS / "arithmetic"
    inputs = _inputs(tmp_path)
    run, steps, budget = run_config(
        RunSpec(METHODS["distill"], source, 0), cfg, inputs, configs, tmp_path / "run"
    )
    assert run.model.teacher == inputs.teacher and run.model.path == inputs.sft
    assert run.model.reward_functions == [ARITHMETIC_VERIFIER, ARITHMETIC_SCORES["exact_match"]]
    assert run.model.reward_function_weights == weights
    assert run.distill.reward_weight == reward_weight
    grpo, grpo_steps, _ = run_config(
        RunSpec(METHODS["grpo"], VERIFIER, 0), cfg, inputs, configs, tmp_path / "grpo"
    )
    assert (steps, budget) == (grpo_steps, "640 responses sampled") == (10, budget)
    assert budget_steps(METHODS["distill"], run, responses=640, pairs=1) == (10, budget)


def test_a_small_arithmetic_comparison_trains_its_teacher_and_draws_the_samples_curve(tmp_path):
    """The plumbing, not the learning: a 10-step SFT, a 2-step teacher, one seed of GRPO and of
    distill on 64 responses each (about 6 s on 2 cores)."""
    configs = tmp_path / "configs"
    shutil.copytree(DEFAULT_CONFIGS / "arithmetic", configs)
    for name, steps in (("sft", 10), ("teacher", 2)):
        y = yaml.safe_load((configs / f"{name}.yaml").read_text())
        y["train"]["steps"] = steps
        if name == "sft":
            y["train"]["eval_every"] = 5
            y["optim"]["warmup_steps"] = 2
        (configs / f"{name}.yaml").write_text(yaml.safe_dump(y))
    out = tmp_path / "out"
    argv = [
        "compare",
        "--compare.task",
        "arithmetic",
        "--compare.methods",
        "[grpo, distill]",
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
    assert main(argv) == 0
    teacher = out / "base" / "teacher"
    assert json.loads((out / "base" / "teacher.json").read_text())["steps"] == 2
    assert (teacher / "config.json").is_file()  # the teacher's final policy, exported
    run = yaml.safe_load((out / "runs" / "distill@teacher-seed0" / "config.yaml").read_text())
    assert run["model"]["teacher"] == str(teacher)
    result = json.loads((out / "compare.json").read_text())
    assert [row["group"] for row in result["table"]] == ["grpo@verifier", "distill@teacher"]
    assert all(row["finished"] == 1 for row in result["table"])
    assert set(result["teacher"]) >= {"gold", "format_error"}
    assert Path(out / "plots" / "gold_vs_samples.png").is_file()
    text = (out / "compare.md").read_text()
    assert "The distill runs' teacher (base/teacher): gold" in text
    assert "![plots/gold_vs_samples.png]" in text
    # run again: the teacher is kept, nothing retrains
    assert main(argv) == 0
