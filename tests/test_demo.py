"""``proximal demo --quick`` end to end: every artifact exists, and the report's numbers are the run files' numbers.

The quick demo runs once for the module (its three tasks took 96 s on a quiet 2-core AVX2-only AMD
EPYC, 124 s in one of `make test`'s one-thread workers) through the real command line; the tests
then read what it wrote. Expected values are taken from the trainers' own ``metrics.jsonl`` files
and from ``eval.json``, never from the report code under test.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from proximal.cli import main

pytestmark = pytest.mark.slow

GOLD = "score/proximal.tasks.digits:gold_score"
PLOTS = ("plots/ppo_training.png", "plots/overoptimisation.png", "plots/methods.png")
POLICIES = ("ppo", "ppo_overopt", "dpo", "simpo", "grpo", "rloo")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(["demo", "--quick", "--out", str(out)])
    assert rc == 0
    return out, stdout.getvalue()


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_every_artifact_exists(demo):
    out, _ = demo
    expected = [
        "task/task.json",
        "task/tokenizer/tokenizer.json",
        "task/base_model/model.safetensors",
        *(f"task/{k}_{s}.jsonl" for k in ("sft", "prefs", "prompts") for s in ("train", "eval")),
        "sft/model.safetensors",
        "sft/config.json",
        "sft/tokenizer.json",
        "sft/metrics.jsonl",
        "sft/config.yaml",
        "rm/model.safetensors",
        "rm/config.json",
        "rm/metrics.jsonl",
        "rm/config.yaml",
        *(
            f"{run}/{f}"
            for run in ("ppo", "ppo_overopt", "grpo", "rloo")
            for f in (
                "metrics.jsonl",
                "samples.jsonl",
                "config.yaml",
                "models.json",
                "checkpoints/latest",
            )
        ),
        *(
            f"{run}/{f}"
            for run in ("dpo", "simpo")
            for f in (
                "model.safetensors",
                "metrics.jsonl",
                "config.yaml",
                "models.json",
                "checkpoints/latest",
            )
        ),
        "eval.json",
        "demo.json",
        "report.md",
        "report.json",
        *PLOTS,
    ]
    missing = [p for p in expected if not (out / p).is_file()]
    assert not missing
    for png in PLOTS:
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    report = (out / "report.md").read_text()
    assert all(f"]({png})" in report for png in PLOTS)


def test_checkpoints_load_with_plain_transformers(demo):
    out, _ = demo
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from proximal.demo import final_policy

    for path in (
        out / "sft",
        *(final_policy(out / p) for p in POLICIES),
        out / "dpo",
        out / "simpo",
    ):
        AutoModelForCausalLM.from_pretrained(path)
        AutoTokenizer.from_pretrained(path)
    rm = AutoModelForSequenceClassification.from_pretrained(out / "rm")
    assert rm.config.num_labels == 1


def test_ppo_curves_in_report_are_the_metrics_files(demo):
    out, _ = demo
    r = json.loads((out / "report.json").read_text())
    for run in ("ppo", "ppo_overopt"):
        rows = _jsonl(out / run / "metrics.jsonl")
        got = r["runs"][run]
        assert got["step"] == [row["step"] for row in rows] == list(range(1, len(rows) + 1))
        assert got["proxy"] == [row["score/reward_model"] for row in rows]
        assert got["gold"] == [row[GOLD] for row in rows]
        assert got["kl"] == [row["kl/seq_mean"] for row in rows]
        assert got["beta"] == [row["kl/beta"] for row in rows]
    # the gold column PPO logged is the task's gold score of the logged samples
    from proximal.tasks.digits import gold_score

    samples = _jsonl(out / "ppo" / "samples.jsonl")
    assert [s[GOLD] for s in samples] == pytest.approx(
        gold_score([s["prompt"] for s in samples], [s["response"] for s in samples]), abs=1e-6
    )
    # the over-optimisation summary: trailing means over `window` steps, recomputed here by hand
    o, w = r["overopt"], r["overopt"]["window"]
    gold = [row[GOLD] for row in _jsonl(out / "ppo_overopt" / "metrics.jsonl")]
    assert o["gold_final"] == pytest.approx(sum(gold[-w:]) / w, abs=1e-12)
    assert f"{o['gold_final']:.3f}" in (out / "report.md").read_text()


def test_reward_model_and_sft_numbers_are_the_metrics_files(demo):
    out, _ = demo
    r = json.loads((out / "report.json").read_text())
    report = (out / "report.md").read_text()
    rm_evals = [row for row in _jsonl(out / "rm" / "metrics.jsonl") if "eval/accuracy" in row]
    assert r["rm"]["eval_accuracy"] == rm_evals[-1]["eval/accuracy"]
    assert f"Held-out accuracy **{rm_evals[-1]['eval/accuracy']:.3f}**" in report
    sft_evals = [row for row in _jsonl(out / "sft" / "metrics.jsonl") if "eval/loss" in row]
    assert (r["sft"]["eval_loss_start"], r["sft"]["eval_loss_end"]) == (
        sft_evals[0]["eval/loss"],
        sft_evals[-1]["eval/loss"],
    )
    assert f"from {sft_evals[0]['eval/loss']:.3f} to {sft_evals[-1]['eval/loss']:.3f}" in report
    assert sft_evals[-1]["eval/loss"] < sft_evals[0]["eval/loss"]


def test_heldout_table_is_eval_json(demo):
    out, stdout = demo
    evaluation = json.loads((out / "eval.json").read_text())
    report = (out / "report.md").read_text()
    table = [
        line
        for line in report.splitlines()
        if line.startswith("| ") and "KL to reference" not in line
    ]
    r = json.loads((out / "report.json").read_text())
    labels = {
        "sft": "SFT",
        "ppo": "PPO, β = 1",
        "ppo_overopt": "PPO over-optimised, β = 0.01",
        "dpo": "DPO, β = 0.3",
        "simpo": "SimPO, β = 2, γ/β = 1",
        "grpo": "GRPO (grpo loss, β = 0.04), exact-sort verifier",
        "rloo": "RLOO (dr_grpo loss, β = 0.04), exact-sort verifier",
    }
    timings = json.loads((out / "demo.json").read_text())["timings_s"]
    for policy, label in labels.items():
        rows = evaluation[policy]["rows"]
        assert evaluation[policy]["n"] == len(rows) == 64
        # means recomputed from the individual responses
        mean = {
            k: sum(float(x[k]) for x in rows) / len(rows)
            for k in ("gold", "proxy", "kl", "length", "eos")
        }
        assert evaluation[policy]["mean"] == pytest.approx(mean, abs=1e-12)
        held = len(json.loads((out / policy / "models.json").read_text()))
        assert r["models_held"][policy] == held
        cells = [f"{mean[k]:.3f}" for k in ("gold", "proxy", "kl", "length", "eos")] + [
            str(held),
            f"{timings[policy]:.0f}",
        ]
        line = next(t for t in table if t.startswith(f"| {label}"))
        assert [c.strip() for c in line.strip("|").split("|")][1:] == cells
        # the terminal ends with the same table
        assert any(
            s.startswith(label) and re.split(r"\s{2,}", s.strip())[1:] == cells
            for s in stdout.splitlines()
        )
    # PPO holds actor, reference, reward model and critic; DPO policy and reference; GRPO/RLOO at β > 0
    # actor and reference; SimPO the policy alone
    assert r["models_held"] == {
        "sft": 1,
        "ppo": 4,
        "ppo_overopt": 4,
        "dpo": 2,
        "simpo": 1,
        "grpo": 2,
        "rloo": 2,
    }
    assert evaluation["sft"]["mean"]["kl"] == pytest.approx(
        0.0, abs=1e-6
    )  # the reference is the SFT model
    from proximal.tasks.digits import gold

    assert all(x["gold"] == gold(x["prompt"], x["response"]) for x in evaluation["ppo"]["rows"])


def test_terminal_shows_every_stage_and_ends_with_the_report_path(demo):
    out, stdout = demo
    stages = (
        "task",
        "sft",
        "rm",
        "ppo",
        "ppo_overopt",
        "dpo",
        "simpo",
        "grpo",
        "rloo",
        "arithmetic/sft",
        "arithmetic/ppo",
        "arithmetic/grpo",
        "arithmetic/rloo",
        "calculator/sft",
        "calculator/ppo",
        "calculator/grpo",
        "calculator/rloo",
        "calculator/sft_notool",
        "calculator/grpo_notool",
        "eval + report",
    )
    for n, name in enumerate(stages, start=1):
        assert f"[{n}/20] {name}:" in stdout
    assert "same as: proximal sft --config" in stdout and "same as: proximal ppo --config" in stdout
    assert stdout.rstrip().splitlines()[-1] == f"Report: {out / 'report.md'}"


def test_evaluation_is_deterministic_given_the_seed(demo):
    out, _ = demo
    from proximal.demo import EVAL_PROMPT_TOKENS, evaluate_policy, final_policy
    from proximal.tasks.digits import EVAL_SCORES

    kwargs = dict(
        reference=out / "sft",
        reward_model=out / "rm",
        prompts_file=out / "task" / "prompts_eval.jsonl",
        scores=EVAL_SCORES,
        max_new_tokens=12,
        max_prompt_length=EVAL_PROMPT_TOKENS,
    )
    a = evaluate_policy(final_policy(out / "ppo"), seed=3, **kwargs)
    b = evaluate_policy(final_policy(out / "ppo"), seed=3, **kwargs)
    c = evaluate_policy(final_policy(out / "ppo"), seed=4, **kwargs)
    assert a == b
    assert [x["response"] for x in a["rows"]] != [x["response"] for x in c["rows"]]
    # and the demo's own evaluation (seed 0) is reproduced exactly
    assert (
        evaluate_policy(final_policy(out / "ppo"), seed=0, **kwargs)["rows"]
        == json.loads((out / "eval.json").read_text())["ppo"]["rows"]
    )


def test_missing_configs_is_a_clear_error(tmp_path, capsys):
    rc = main(
        ["demo", "--quick", "--out", str(tmp_path / "o"), "--configs", str(tmp_path / "nowhere")]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert (
        "sft.yaml, rm.yaml, ppo.yaml, ppo_overopt.yaml, dpo.yaml, simpo.yaml, grpo.yaml, rloo.yaml, "
        "arithmetic/sft.yaml, arithmetic/ppo.yaml, arithmetic/grpo.yaml, arithmetic/rloo.yaml, "
        "calculator/sft.yaml, calculator/ppo.yaml, calculator/grpo.yaml, calculator/rloo.yaml, "
        "calculator/sft_notool.yaml, calculator/grpo_notool.yaml not found"
        in err
        and "--configs" in err
    )


def test_config_mistakes_stop_the_demo_before_training(tmp_path, capsys):
    import shutil

    from proximal.demo import DEFAULT_CONFIGS

    configs = tmp_path / "configs"
    shutil.copytree(DEFAULT_CONFIGS, configs)
    ppo = configs / "ppo.yaml"
    ppo.write_text(
        ppo.read_text().replace("reward_function_weights: [0.0]", "reward_function_weights: [1.0]")
    )
    overopt = configs / "ppo_overopt.yaml"
    overopt.write_text(overopt.read_text().replace("  beta: 0.01", "  beta: 0.01\n  betta: 0.02"))
    rc = main(["demo", "--quick", "--out", str(tmp_path / "o"), "--configs", str(configs)])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"{ppo}: the demo logs the gold score without training on it" in err
    assert f"{overopt}: invalid configuration" in err and "kl.betta: unknown key" in err
    assert not (tmp_path / "o" / "sft").exists()  # nothing was trained


def test_the_arithmetic_task_table_is_its_evaluation(demo):
    """The arithmetic stages: each policy loads, learned from the verifier, and the report's table is
    arithmetic/eval.json's means, recomputed here from the held-out responses with the task's functions."""
    out, stdout = demo
    from transformers import AutoModelForCausalLM

    from proximal.demo import final_policy
    from proximal.tasks.arithmetic import exact_match, format_error

    a = out / "arithmetic"
    for run in ("ppo", "grpo", "rloo"):
        AutoModelForCausalLM.from_pretrained(final_policy(a / run))
        rows = _jsonl(a / run / "metrics.jsonl")
        assert "score/proximal.tasks.arithmetic:verify" in rows[-1]
        cfg = (a / run / "config.yaml").read_text()
        assert "proximal.tasks.arithmetic:verify" in cfg
    evaluation = json.loads((a / "eval.json").read_text())
    r = json.loads((out / "report.json").read_text())["arithmetic"]
    report = (out / "report.md").read_text()
    assert "## 6. A reasoning task" in report and "Arithmetic task, held-out prompts" in stdout
    for name in ("sft", "ppo", "grpo", "rloo"):
        ev = evaluation[name]
        prompts = [x["prompt"] for x in ev["rows"]]
        responses = [x["response"] for x in ev["rows"]]
        em, fe = exact_match(prompts, responses), format_error(prompts, responses)
        assert [x["exact_match"] for x in ev["rows"]] == em
        assert [x["format_error"] for x in ev["rows"]] == fe
        assert r["heldout"][name]["exact_match"] == pytest.approx(sum(em) / len(em), abs=1e-12)
        assert r["heldout"][name]["format_error"] == pytest.approx(sum(fe) / len(fe), abs=1e-12)
        m = ev["mean"]
        assert (
            f"| {r['labels'][name]} | {m['exact_match']:.3f} | {m['format_error']:.3f} | "
            f"{m['kl']:.3f} | {m['length']:.3f} |" in report
        )
    assert evaluation["sft"]["mean"]["kl"] == pytest.approx(0.0, abs=1e-6)
    gains = ", ".join(
        f"{name.upper()} {r['heldout'][name]['exact_match'] - r['heldout']['sft']['exact_match']:+.3f}"
        for name in ("ppo", "grpo", "rloo")
    )
    assert f"Exact match over SFT: {gains}." in report  # the methods' names, not half a label


def test_the_calculator_task_table_is_its_evaluation(demo):
    """The calculator stages: each policy loads; the tool runs learned with the tool (agent/* every
    step, trajectories in samples.jsonl), the no-tool ones without; the held-out tool policies were
    evaluated as trajectories and the no-tool ones as single responses; the report's table is
    calculator/eval.json's means, recomputed here from the held-out rows."""
    out, stdout = demo
    from transformers import AutoModelForCausalLM

    from proximal.demo import final_policy
    from proximal.tasks.calculator import exact_match

    c = out / "calculator"
    for run in ("ppo", "grpo", "rloo", "grpo_notool"):
        AutoModelForCausalLM.from_pretrained(final_policy(c / run))
        rows = _jsonl(c / run / "metrics.jsonl")
        assert "score/proximal.tasks.calculator:verify" in rows[-1]
        assert ("agent/tool_calls" in rows[-1]) == (run != "grpo_notool")
        sample = _jsonl(c / run / "samples.jsonl")[0]
        assert ("trajectory" in sample) == (run != "grpo_notool")
    evaluation = json.loads((c / "eval.json").read_text())
    r = json.loads((out / "report.json").read_text())["calculator"]
    report = (out / "report.md").read_text()
    assert "## 7. A tool task" in report and "Calculator tool task, held-out prompts" in stdout
    for name in ("sft", "ppo", "grpo", "rloo", "sft_notool", "grpo_notool"):
        ev = evaluation[name]
        tool = not name.endswith("_notool")
        assert all(("trajectory" in x) == tool for x in ev["rows"])
        prompts = [x["prompt"] for x in ev["rows"]]
        em = exact_match(prompts, [x["response"] for x in ev["rows"]])
        assert [x["exact_match"] for x in ev["rows"]] == em
        assert r["heldout"][name]["exact_match"] == pytest.approx(sum(em) / len(em), abs=1e-12)
        calls = [x.get("tool_calls", 0) for x in ev["rows"]]
        assert r["heldout"][name]["tool_calls"] == pytest.approx(sum(calls) / len(calls), abs=1e-12)
        m = r["heldout"][name]
        assert (
            f"| {r['labels'][name]} | {m['exact_match']:.3f} | {m['format_error']:.3f} | "
            f"{m['tool_calls']:.3f} | {m['tool_errors']:.3f} | {m['kl']:.3f} | {m['length']:.3f} |"
            in report
        )
    for sft in ("sft", "sft_notool"):  # each SFT model is its runs' reference
        assert evaluation[sft]["mean"]["kl"] == pytest.approx(0.0, abs=1e-6)


def test_the_task_stages_configs_are_checked(tmp_path):
    """The arithmetic and calculator stages' configs (proximal.demo): the packaged ones load, with
    each stage's inputs, seed and command; a copy whose RL stage learns from something else than the
    task's verifier, a tool stage without the tool and a no-tool stage with one are each refused,
    all problems in one ConfigError."""
    import shutil

    import yaml

    from proximal.config import ConfigError
    from proximal.demo import (
        CALCULATOR_STAGES,
        DEFAULT_CONFIGS,
        FULL,
        arithmetic_stage_configs,
        calculator_stage_configs,
    )
    from proximal.tasks import arithmetic, calculator

    out, calc_out = tmp_path / "arithmetic", tmp_path / "calculator_out"
    arithmetic.make_task_data(out / "task", 3)
    calculator.make_task_data(calc_out / "task", 3)
    arith = arithmetic_stage_configs(DEFAULT_CONFIGS / "arithmetic", out, 3, FULL)
    assert list(arith) == ["sft", "ppo", "grpo", "rloo"]
    cfg, line = arith["grpo"]
    assert cfg.train.seed == 3 and cfg.output.dir == str(out / "grpo")
    assert cfg.model.path == str(out / "sft") and line.startswith("proximal grpo --config ")
    calc = calculator_stage_configs(DEFAULT_CONFIGS / "calculator", calc_out, 3, FULL)
    assert list(calc) == list(CALCULATOR_STAGES)
    assert calc["grpo_notool"][0].model.path == str(calc_out / "sft_notool")
    assert calc["grpo_notool"][1].startswith("proximal grpo --config ")

    broken = tmp_path / "calculator"
    shutil.copytree(DEFAULT_CONFIGS / "calculator", broken)

    def edit(name, change):
        path = broken / f"{name}.yaml"
        data = yaml.safe_load(path.read_text())
        change(data)
        path.write_text(yaml.safe_dump(data))

    edit("grpo", lambda d: d["model"].update(reward_function_weights=[0.5, 0.0, 0.0]))
    edit("ppo", lambda d: d["tools"].update(functions=[]))
    edit("grpo_notool", lambda d: d.setdefault("tools", {}).update(functions=["x:y"]))
    with pytest.raises(ConfigError) as caught:
        calculator_stage_configs(broken, calc_out, 3, FULL)
    message = str(caught.value)
    assert f"{broken / 'grpo.yaml'}: the calculator runs learn from the verifier" in message
    assert f"{broken / 'ppo.yaml'}: a tool stage needs tools.functions" in message
    assert f"{broken / 'grpo_notool.yaml'}: the no-tool baseline runs with no tools" in message
