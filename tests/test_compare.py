"""``proximal compare``: the table's every number recomputed here from the run directories, the
resident models of every method counted on the live modules, failed runs shown with their error,
and config mistakes refused in one line."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import math
import os
import signal
import statistics
import weakref
from pathlib import Path

import pytest
import torch
import yaml

from proximal import dist
from proximal.cli import main
from proximal.commands import trainer
from proximal.compare import (
    CompareConfig,
    CompareData,
    CompareOutput,
    CompareSection,
    Inputs,
    RunSpec,
    prepare_inputs,
    run_config,
)
from proximal.compare_report import collect_run, mean_std
from proximal.methods import METHODS
from proximal.train.run import Run

HERE = Path(__file__).resolve().parent
import sys  # noqa: E402

sys.path.insert(0, str(HERE / "trainers"))
from ppo_support import length, load_safetensors_dir, prompt_texts  # noqa: E402
from test_dpo import count_task, write_jsonl  # noqa: E402

# Each method's config, as small as a step can be: the compare sets paths, seed, steps, checkpoints.
CONFIGS = {
    "ppo": {
        "rollout": {"batch_size": 4, "max_new_tokens": 6},
        "ppo": {"epochs": 2, "mini_batch_size": 2, "micro_batch_size": 2},
        "optim": {"lr": 1e-3, "critic_lr": 1e-3},
        "train": {"device": "cpu"},
    },
    "dpo": {
        "data": {"max_length": 16},
        "train": {"batch_size": 4, "micro_batch_size": 4, "device": "cpu"},
        "optim": {"lr": 1e-3},
    },
    # An absurd learning rate: step 1 is finite, Adam's ±lr moves make step 2's loss NaN — a run that fails.
    "simpo": {
        "data": {"max_length": 16},
        "train": {"batch_size": 4, "micro_batch_size": 4, "device": "cpu"},
        "optim": {"lr": 1e30, "max_grad_norm": 0},
    },
    "grpo": {
        "rollout": {"batch_size": 2, "group_size": 2, "max_new_tokens": 6},
        "grpo": {"micro_batch_size": 4},
        "optim": {"lr": 1e-3},
        "train": {"device": "cpu"},
    },
}


def _write(path: Path, obj: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(obj, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def inputs(assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("compare_inputs")
    configs = root / "configs"
    for name, cfg in CONFIGS.items():
        _write(configs / f"{name}.yaml", cfg)
    eval_prompts = root / "eval_prompts.jsonl"
    write_jsonl(eval_prompts, [{"prompt": p} for p in prompt_texts(6)])
    return {
        "configs": configs,
        "pairs": write_jsonl(root / "pairs.jsonl", count_task(16, seed=5)),
        "eval_prompts": eval_prompts,
        "policy": assets.policy("llama"),
        "rm": assets.reward_model("llama"),
        "prompts": assets.prompts,
    }


def compare_yaml(inputs, out: Path, methods, **compare) -> Path:
    cfg = {
        "compare": {
            "methods": methods,
            "seeds": 1,
            "responses": 8,
            "pairs": 8,
            "evaluations": 2,
            "eval_samples_per_prompt": 2,
            "max_new_tokens": 6,
            "configs": str(inputs["configs"]),
            **compare,
        },
        "data": {
            "sft_model": str(inputs["policy"]),
            "reward_model": str(inputs["rm"]),
            "prompts": str(inputs["prompts"]),
            "pairs": str(inputs["pairs"]),
            "eval_prompts": str(inputs["eval_prompts"]),
            "gold": "ppo_support:length",
        },
        "output": {"dir": str(out), "progress": False},
    }
    return _write(out.parent / f"{out.name}.yaml", cfg)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def nbytes(checkpoint: Path) -> int:
    return sum(t.numel() * t.element_size() for t in load_safetensors_dir(checkpoint).values())


@pytest.fixture(scope="module")
def comparison(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "out"
    # pass@k of the gold score, len/10: a response of 6 characters (the longest here) passes
    config = compare_yaml(
        inputs, out, ["ppo", "dpo", "simpo"], eval_pass_k=[1, 2], eval_pass_threshold=0.6
    )
    err, std = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        code = main(["compare", "--config", str(config)])
    return {
        "out": out,
        "config": config,
        "code": code,
        "stdout": std.getvalue(),
        "stderr": err.getvalue(),
        "json": json.loads((out / "compare.json").read_text()),
        "md": (out / "compare.md").read_text(),
    }


def test_every_number_of_the_table_is_recomputed_from_the_run_directories(comparison, inputs):
    out, result = comparison["out"], comparison["json"]
    table = {row["group"]: row for row in result["table"]}
    assert list(table) == ["ppo@reward_model", "dpo", "simpo"]
    policy, rm = nbytes(inputs["policy"]), nbytes(inputs["rm"])
    expect = {"ppo@reward_model": (4, 2 * policy + 2 * rm), "dpo": (2, 2 * policy)}
    for group, (models, param_bytes) in expect.items():
        run, row = out / "runs" / f"{group}-seed0", table[group]
        assert row["finished"] == row["runs"] == 1 and row["failed"] == []
        # one seed: the mean is the run's number, and there is no spread
        assert row["models_resident"] == [models, None] and row["param_bytes"] == [
            param_bytes,
            None,
        ]
        metrics = [m for m in rows(run / "metrics.jsonl") if m["step"] >= 1]
        assert [m["step"] for m in metrics] == [
            1,
            2,
        ]  # 8 responses / 4 per step; 8 pairs / 4 per step
        assert row["peak_bytes"][0] == max(
            m["memory/peak_bytes"] for m in metrics if m["step"] >= 2
        )
        assert row["wall_s"][0] == metrics[-1]["time/wall_s"]
        if group.startswith("ppo"):
            assert row["tokens_generated"][0] == round(
                sum(m["response/length_mean"] * 4 for m in metrics)
            )
            assert (
                row["optimizer_steps"][0] == sum(m["policy/epochs_run"] for m in metrics) * 2
            )  # 4 / 2 minis
        else:
            assert row["tokens_generated"][0] == 0 and row["optimizer_steps"][0] == 2
        ev = json.loads((run / "eval.json").read_text())
        assert [p["step"] for p in ev["curve"]] == [0, 1, 2]  # the SFT model, then every checkpoint
        final = ev["final"]["rows"]
        assert len(final) == 12  # 6 held-out prompts × 2 samples
        gold = statistics.fmean(
            length([r["prompt"] for r in final], [r["response"] for r in final])
        )
        assert row["gold"][0] == pytest.approx(gold, abs=1e-12)
        for key in ("proxy", "kl", "length"):
            assert row[key][0] == pytest.approx(statistics.fmean(r[key] for r in final), abs=1e-12)
        # pass@k of gold over each prompt's 2 responses (rows 2p, 2p + 1): pass@1 the pass rate,
        # pass@2 whether either passed; maj@n with n = 2 is the first response's pass (two
        # different answers tie and the first wins; two equal ones are that answer)
        passed = [len(r["response"]) / 10 >= 0.6 for r in final]
        pairs = list(zip(passed[0::2], passed[1::2]))
        assert 0 < sum(passed) < len(passed)  # some pass, some do not
        assert row["pass@1"][0] == pytest.approx(sum(passed) / 12, abs=1e-12)
        assert row["pass@2"][0] == pytest.approx(sum(a or b for a, b in pairs) / 6, abs=1e-12)
        assert row["maj@n"][0] == pytest.approx(sum(a for a, _ in pairs) / 6, abs=1e-12)
        assert row["mean@n"][0] == pytest.approx(gold, abs=1e-12)
        curve = [p["mean"]["gold"] for p in ev["curve"]]
        swing = abs(
            curve[2] - curve[1]
        )  # between the run's own two checkpoints (the SFT model excluded)
        run_record = next(r for r in result["runs"] if r["name"] == f"{group}-seed0")
        assert run_record["max_swing"] == pytest.approx(swing) and row[
            "max_swing"
        ] == pytest.approx(swing)
        assert row["collapse_frac"] == float(max(curve) - curve[-1] > 0.05)
        # the markdown shows the same numbers
        line = next(
            ln
            for ln in comparison["md"].splitlines()
            if ln.startswith(f"| {'PPO (reward model)' if group.startswith('ppo') else 'DPO'} |")
            and "±" not in ln
            and "/" not in ln.split("|")[2]
        )
        assert f"{row['gold'][0]:.3f}" in line and f"{row['kl'][0]:.3f}" in line, line
        assert f"{row['pass@2'][0]:.3f} | {row['mean@n'][0]:.3f}" in line, line
    assert "| pass@1 ↑ | pass@2 ↑ | mean@n ↑ | maj@n ↑ |" in comparison["md"]
    assert result["sft"]["kl"] == 0.0  # the SFT model against itself


def test_a_failed_run_is_a_row_with_its_error_and_the_exit_status_says_so(comparison):
    row = next(r for r in comparison["json"]["table"] if r["group"] == "simpo")
    assert row["finished"] == 0 and row["runs"] == 1
    [failed] = row["failed"]
    assert failed["name"] == "simpo-seed0"
    assert failed["error"].startswith("FloatingPointError: step 2: the SIMPO loss is nan"), failed
    assert (
        "## Runs that failed" in comparison["md"]
        and f"| simpo-seed0 | {failed['error']} |" in comparison["md"]
    )
    assert "Traceback" in (comparison["out"] / "runs" / "simpo-seed0" / "error.txt").read_text()
    assert "SimPO |" in comparison["md"]  # the method keeps its rows, with dashes
    assert comparison["code"] == 1
    assert "1 of 3 runs failed" in comparison["stderr"] and "Traceback" not in comparison["stderr"]
    for plot in ("gold_vs_kl", "gold_vs_time", "curves"):
        assert (comparison["out"] / "plots" / f"{plot}.png").stat().st_size > 1000


def test_the_same_command_again_keeps_finished_runs_and_retries_failed_ones(comparison, capsys):
    out = comparison["out"]
    before = {
        p: (out / "runs" / p / "eval.json").stat().st_mtime_ns
        for p in ("ppo@reward_model-seed0", "dpo-seed0")
    }
    assert main(["compare", "--config", str(comparison["config"])]) == 1
    text = capsys.readouterr().out
    assert (
        "ppo@reward_model-seed0: finished earlier, kept" in text
        and "dpo-seed0: finished earlier, kept" in text
    )
    assert "simpo-seed0: SimPO" in text  # tried again
    assert before == {p: (out / "runs" / p / "eval.json").stat().st_mtime_ns for p in before}
    assert json.loads((out / "compare.json").read_text())["table"] == comparison["json"]["table"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"methods": ["ppx"]}, "compare.methods: 'ppx': unknown method"),
        ({"methods": ["dpo@verifier"]}, "DPO cannot use reward source 'verifier'"),
        ({"methods": ["grpo@verifier"]}, "learns from the verifier: set data.verifier"),
        ({"seeds": 0}, "compare.seeds = 0 must be ≥ 1"),
        (
            {"max_new_tokens": None},
            "compare.max_new_tokens is required with your own data (data.sft_model): the held-out "
            "responses' token limit",
        ),
        (
            {"eval_pass_k": [1, 3]},
            "compare.eval_pass_k = [1, 3]: k = 3 is more than compare.eval_samples_per_prompt = 2",
        ),
        ({"reward_timeout_s": 0}, "compare.reward_timeout_s = 0.0 must be > 0 seconds, or null"),
        (
            {"responses": 2},
            "compare.responses = 2 is less than one step of PPO (rollout.batch_size = 4)",
        ),
        (
            {"model": {"heads": 2, "head_dim": 8}},
            "compare.model: unknown key(s) 'head_dim' (known: arch, hidden, layers, heads, "
            "kv_heads, max_positions)",
        ),
        ({"model": {"heads": 3}}, "compare.model: hidden = 64 is not a multiple of heads = 3"),
        ({"model": {"layers": 0}}, "compare.model.layers = 0 must be an integer ≥ 1"),
        ({"model": {"heads": 2}}, "compare.model = {'heads': 2} shapes the built-in task's model"),
        # vLLM is missing (the main suite's environment) or cannot run the policy's 16-wide heads:
        # either way one line, before anything trains
        ({"engine": "vllm"}, "proximal compare: compare.engine = vllm: "),
    ],
)
def test_config_mistakes_are_one_line_and_exit_status_2(inputs, tmp_path, capsys, change, message):
    methods = change.pop("methods", ["ppo"])
    config = compare_yaml(inputs, tmp_path / "out", methods, **change)
    assert main(["compare", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.startswith("proximal compare: "), err
    assert not (tmp_path / "out" / "runs").exists()


@pytest.mark.parametrize("engine", ["vllm", "hf", None])
def test_compare_engine_is_each_runs_rollout_engine_or_eval_engine(
    inputs, tmp_path, engine, monkeypatch
):
    """compare.engine reaches an online method as rollout.engine (its rollouts, and its sampled
    evaluations through eval.engine null), an offline one as eval.engine; null leaves each config's.
    (The translation only: vLLM counts as installed here, whether it is or not.)"""
    import importlib.util

    from proximal.train import sections

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        sections, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    cfg = CompareConfig(
        compare=CompareSection(
            methods=["ppo", "grpo", "dpo"],
            seeds=1,
            responses=8,
            pairs=8,
            evaluations=1,
            configs=str(inputs["configs"]),
            engine=engine,
        ),
        data=CompareData(
            sft_model=str(inputs["policy"]),
            reward_model=str(inputs["rm"]),
            prompts=str(inputs["prompts"]),
            pairs=str(inputs["pairs"]),
            eval_prompts=str(inputs["eval_prompts"]),
        ),
        output=CompareOutput(progress=False),
    )
    shared = Inputs(
        sft=str(inputs["policy"]),
        reward_model=str(inputs["rm"]),
        prompts=str(inputs["prompts"]),
        pairs=str(inputs["pairs"]),
        eval_pairs=None,
        eval_prompts=str(inputs["eval_prompts"]),
        verifier="ppo_support:frac_a",
        gold=None,
    )

    def built(method: str, source: str):
        spec = RunSpec(METHODS[method], source, 0)
        return run_config(spec, cfg, shared, inputs["configs"], tmp_path / method)[0]

    ppo, grpo = built("ppo", "reward_model"), built("grpo", "verifier")
    dpo = built("dpo", "pairs")
    assert (ppo.rollout.engine, grpo.rollout.engine) == (engine or "hf", engine or "hf")
    assert (ppo.eval.engine, grpo.eval.engine) == (None, None)  # null: the run's rollout.engine
    assert dpo.eval.engine == engine


def test_compare_model_shapes_each_builtin_tasks_model(tmp_path, monkeypatch):
    """compare.model is merged over the task's default model: {heads: 2} gives hidden 64 as 2
    heads of 32 (vLLM's CPU attention runs 32, not the default's 16), for every built-in task (a
    reasoning-gym task's hidden 128 as 2 heads of 64)."""
    from proximal import compare
    from proximal.compare import TASKS, prepare_inputs

    monkeypatch.setattr(compare.sft, "train", lambda cfg: None)  # the shape is the question here
    monkeypatch.setattr(compare.reward, "train", lambda cfg: None)
    for task in TASKS:
        cfg = CompareConfig(compare=CompareSection(task=task, model={"heads": 2}))
        assert cfg.validate() == []
        configs = compare.DEFAULT_CONFIGS / ("" if task == "digits" else task)
        prepare_inputs(cfg, tmp_path / task, configs, echo=lambda line: None)
        saved = json.loads((tmp_path / task / "base/task/base_model/config.json").read_text())
        shape = (saved["hidden_size"], saved["num_attention_heads"], saved["num_key_value_heads"])
        hidden = compare.TASK_MODELS[task]["hidden"]  # 64 (digits, arithmetic, calculator), 128
        assert (saved["architectures"], shape) == (["LlamaForCausalLM"], (hidden, 2, 2)), task
        assert saved["hidden_size"] // saved["num_attention_heads"] in (32, 64)  # both vLLM's


@pytest.mark.vllm
def test_with_vllm_the_builtin_tasks_default_heads_are_one_line_and_heads_2_pass():
    """The built-in task's default model has heads of dimension 16, which vLLM's CPU attention does
    not run: compare.engine vllm is refused from the config alone (nothing built, nothing trained),
    with the compare.model that fixes it; {heads: 2} passes."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm builds .venv-vllm)")
    from proximal.compare import engine_problems

    if torch.cuda.is_available():
        pytest.skip("the head-dimension limit is the CPU kernel's")
    assert engine_problems(CompareConfig(compare=CompareSection(engine="vllm"))) == [
        "compare.engine = vllm: the policy's attention heads have dimension 16, which vLLM's CPU "
        "attention does not run (it runs 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512; use "
        "compare.engine: hf); or give the task's model heads it runs: --compare.model '{heads: 2}'"
    ]
    for task in ("digits", "arithmetic", "calculator"):
        shaped = CompareSection(task=task, engine="vllm", model={"heads": 2})
        assert engine_problems(CompareConfig(compare=shaped)) == [], task


def test_a_directory_that_is_not_a_comparison_is_not_written_into(inputs, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "thesis.tex").write_text("precious")
    config = compare_yaml(inputs, tmp_path / "out", ["dpo"])
    assert main(["compare", "--config", str(config)]) == 2
    assert "holds no comparison" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["thesis.tex"]


def test_on_other_ranks_a_mistake_every_rank_meets_is_left_to_rank_0(
    inputs, tmp_path, capsys, monkeypatch
):
    """Under torchrun every process finds the same mistake once the config has loaded; rank 0 says
    it (the test above), the others exit with the same status in silence."""
    monkeypatch.setattr(dist, "launched_rank", lambda: 1)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "thesis.tex").write_text("precious")
    config = compare_yaml(inputs, tmp_path / "out", ["dpo"])
    assert main(["compare", "--config", str(config)]) == 2
    assert capsys.readouterr() == ("", "")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["thesis.tex"]


def test_help_names_the_config_and_no_resume(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["compare", "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: proximal compare [-h] [--config CONFIG]\n")
    assert "YAML file with the compare, data and output sections" in text
    assert "--resume" not in text and "--compare.methods (list[str]" in text


def test_a_stop_signal_names_the_run_and_the_same_command_line_continues(
    inputs, tmp_path, monkeypatch, capsys
):
    """SIGTERM in the second of two DPO runs: exit status 75 and one line naming the run and saying
    that the same compare command line continues (compare has no --resume, which the run's own line
    would suggest); that command line then keeps the first run and trains the second."""
    from proximal.train import fixed

    out = tmp_path / "out"
    config = compare_yaml(inputs, out, ["dpo"], seeds=2)
    original, sent = fixed.accumulate, []

    def signal_in_the_second_run(*args, **kwargs):
        if not sent and (out / "runs" / "dpo-seed0" / "compare_run.json").is_file():
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    with monkeypatch.context() as mp:
        mp.setattr(fixed, "accumulate", signal_in_the_second_run)
        assert main(["compare", "--config", str(config)]) == 75
    err = capsys.readouterr().err
    assert sent and err.count("\n") == 1, err
    assert err.startswith(
        "proximal compare: SIGTERM received during run dpo-seed1 (2 of 2): stopped; the same "
        "proximal compare command line continues the comparison (the runs finished before it are "
        "kept; dpo-seed1 starts again from its first step)"
    ), err
    assert "--resume" not in err
    kept = (out / "runs" / "dpo-seed0" / "eval.json").stat().st_mtime_ns
    assert main(["compare", "--config", str(config)]) == 0
    assert "dpo-seed0: finished earlier, kept" in capsys.readouterr().out
    assert (out / "runs" / "dpo-seed0" / "eval.json").stat().st_mtime_ns == kept
    assert (
        json.loads((out / "runs" / "dpo-seed1" / "compare_run.json").read_text())["status"] == "ok"
    )


# ----------------------------------------------------------------------------------------------
# Resident models, counted on the live modules
# ----------------------------------------------------------------------------------------------


def live_models(before: weakref.WeakSet) -> list[torch.nn.Module]:
    """The top-level modules with parameters alive now that were not alive ``before`` (a module
    inside another is part of it)."""
    gc.collect()
    found = [
        o
        for o in gc.get_objects()
        if issubclass(type(o), torch.nn.Module)
        and o not in before
        and next(o.parameters(), None) is not None
    ]
    inner = {id(sub) for m in found for sub in m.modules() if sub is not m}
    return [m for m in found if id(m) not in inner]


def param_bytes(modules: list[torch.nn.Module]) -> int:
    seen, total = set(), 0
    for m in modules:
        for p in m.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
    return total


RESIDENT = [  # (method, overrides, models resident)
    ("ppo", {}, 4),
    ("ppo", {"model.lora_r": 4}, 3),  # the reference is the policy with its adapters disabled
    ("dpo", {}, 2),
    ("dpo", {"train.precompute_ref_logprobs": True}, 1),
    ("grpo", {}, 2),
    ("grpo", {"grpo.beta": 0.0}, 1),  # no KL term: no reference
    ("simpo", {"optim.lr": 1e-3, "optim.max_grad_norm": 1.0}, 1),
]


@pytest.mark.parametrize(
    "method, overrides, expected",
    RESIDENT,
    ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for m, o, _ in RESIDENT],
)
def test_resident_models_are_counted_on_the_live_modules(
    inputs, tmp_path, monkeypatch, method, overrides, expected
):
    # PPO against the reward model (its four models); GRPO on a verifier (actor and reference only)
    source = {"ppo": "reward_model", "grpo": "verifier"}.get(method, "pairs")
    cfg = CompareConfig(
        compare=CompareSection(
            methods=[method],
            seeds=1,
            responses=8,
            pairs=8,
            evaluations=1,
            configs=str(inputs["configs"]),
        ),
        data=CompareData(
            sft_model=str(inputs["policy"]),
            reward_model=str(inputs["rm"]),
            prompts=str(inputs["prompts"]),
            pairs=str(inputs["pairs"]),
            eval_prompts=str(inputs["eval_prompts"]),
        ),
        output=CompareOutput(progress=False),
    )
    shared = Inputs(
        sft=str(inputs["policy"]),
        reward_model=str(inputs["rm"]),
        prompts=str(inputs["prompts"]),
        pairs=str(inputs["pairs"]),
        eval_pairs=None,
        eval_prompts=str(inputs["eval_prompts"]),
        verifier="ppo_support:frac_a",
        gold=None,
    )
    run_dir = tmp_path / "run"
    run_cfg, _, _ = run_config(
        RunSpec(METHODS[method], source, 0), cfg, shared, inputs["configs"], run_dir
    )
    for key, value in overrides.items():  # the trainer validates the result
        section_name, name = key.split(".")
        setattr(getattr(run_cfg, section_name), name, value)

    gc.collect()
    before = weakref.WeakSet(o for o in gc.get_objects() if issubclass(type(o), torch.nn.Module))
    seen: list[tuple[int, int]] = []
    log = Run.log

    def log_and_count(self, step, metrics, postfix=None):
        if step >= 1 and not seen:  # during training: after the first update
            live = live_models(before)
            seen.append((len(live), param_bytes(live)))
        return log(self, step, metrics, postfix)

    monkeypatch.setattr(Run, "log", log_and_count)
    trainer(METHODS[method].command)(run_cfg)
    [(count, nbytes_live)] = seen
    models = json.loads((run_dir / "models.json").read_text())
    assert count == expected == len(models), (count, sorted(models))
    assert nbytes_live == sum(m["bytes"] for m in models.values())
    record = collect_run(
        run_dir,
        RunSpec(METHODS[method], source, 0).record,
        collapse_margin=0.05,
        stability_score="gold",
    )
    assert record["models_resident"] == expected and record["param_bytes"] == nbytes_live


def test_mean_and_spread_are_the_sample_statistics():
    m, s = mean_std([0.5, 0.7, 0.9])
    assert m == pytest.approx(0.7) and s == pytest.approx(math.sqrt(((0.2**2) * 2) / 2))
    assert mean_std([0.3]) == (0.3, None) and mean_std([None]) == (None, None)


def test_every_method_has_its_stated_row():
    """The report's 'as commonly stated' table has a row for every method compare can train (a
    method added without one would print dashes where its paper's claims belong)."""
    from proximal.compare_report import CLAIMS
    from proximal.methods import METHODS

    assert sorted(METHODS) == sorted(CLAIMS)
    for name, claim in CLAIMS.items():
        assert claim["models_n"] in (1, 2, 4) and all(claim[k] for k in ("critic", "type")), name


def test_your_own_data_is_evaluated_with_no_tasks_scorer_or_lengths(inputs, tmp_path):
    """With data.sft_model the held-out evaluation takes its scores from the config (here data.gold
    only: no digit-task verifier), its response length from compare.max_new_tokens (required, above)
    and keeps every held-out prompt whole: no task's 64-token prompt limit cuts it."""
    from proximal.config import load_config
    from proximal.evaluation import evaluate_policy

    out = tmp_path / "out"
    cfg = load_config(CompareConfig, compare_yaml(inputs, out, ["ppo"]))
    got = prepare_inputs(cfg, out, inputs["configs"], echo=lambda _: None)
    assert got.scores == {"gold": "ppo_support:length"} and got.prompt_limit is None
    long = "ab " * 30 + "c"  # 91 characters, a token each for the char-level tokenizer
    prompts = write_jsonl(tmp_path / "long.jsonl", [{"prompt": long}])
    ev = evaluate_policy(
        got.sft,
        reference=got.sft,
        prompts_file=prompts,
        scores=got.scores,
        max_new_tokens=cfg.compare.response_limit(),
        max_prompt_length=got.prompt_limit,
    )
    assert ev["rows"][0]["prompt"] == long
    assert ev["rows"][0]["length"] <= 6  # compare_yaml's compare.max_new_tokens
