"""Bad input gets a clear message that names the file, line or value (issue 3 item 12), through the
real CLI, with exit status 2 and no traceback; config errors are found before any model is loaded.
A run stopped by a non-finite score exits with 1."""

from __future__ import annotations

import math

import pytest
from ppo_support import ppo_main, read_jsonl, tiny_config

from proximal.data.jsonl import write_jsonl


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if the trainer gets as far as building models."""
    from proximal.trainers import ppo

    def forbidden(*args, **kwargs):
        raise AssertionError("models were loaded before the config error was reported")

    monkeypatch.setattr(ppo, "build_models", forbidden)


def _run(capsys, cfg, *args):
    rc = ppo_main(cfg, *args)
    out, err = capsys.readouterr()
    return rc, err


# ----------------------------------------------------------------------------------------------
# Config errors: exit 2, one message, nothing loaded, nothing written
# ----------------------------------------------------------------------------------------------


def test_missing_prompts_path(assets, tmp_path, capsys, no_model_loading):
    missing = tmp_path / "nowhere" / "prompts.jsonl"
    cfg = tiny_config(assets.policy("llama"), missing, tmp_path / "run")
    rc, err = _run(capsys, cfg)
    assert rc == 2
    assert f"data.prompts: no file or directory {missing}" in err
    assert not (tmp_path / "run").exists()


def test_unknown_config_keys(assets, tmp_path, capsys, no_model_loading):
    cfg = tiny_config(assets.policy("llama"), assets.prompts, tmp_path / "run")
    cfg["ppo"]["clip_epsilon"] = 0.1  # a typo in the YAML file …
    rc, err = _run(capsys, cfg, "--rollout.max_tokens", "4")  # … and one on the command line
    assert rc == 2
    assert "ppo.clip_epsilon: unknown key" in err and "clip_eps" in err  # the known keys are listed
    assert "rollout.max_tokens: unknown key" in err
    assert err.count("invalid configuration") == 1  # one message with both


def test_batch_sizes_that_do_not_divide(assets, tmp_path, capsys, no_model_loading):
    cfg = tiny_config(assets.policy("llama"), assets.prompts, tmp_path / "run")
    rc, err = _run(
        capsys,
        cfg,
        "--rollout.batch_size",
        "6",
        "--ppo.mini_batch_size",
        "4",
        "--ppo.micro_batch_size",
        "3",
    )
    assert rc == 2
    assert err.count("invalid configuration") == 1
    assert "rollout.batch_size = 6 is not divisible by ppo.mini_batch_size = 4" in err
    assert "ppo.mini_batch_size = 4 is not divisible by ppo.micro_batch_size = 3" in err
    assert err.count("not divisible") == 2  # each problem once


def test_wrong_type(assets, tmp_path, capsys, no_model_loading):
    cfg = tiny_config(assets.policy("llama"), assets.prompts, tmp_path / "run")
    rc, err = _run(capsys, cfg, "--rollout.max_new_tokens", "eight")
    assert rc == 2
    assert "rollout.max_new_tokens: 'eight' is not a valid int" in err


# ----------------------------------------------------------------------------------------------
# Data and model errors: exit 1 with the file, line or value named
# ----------------------------------------------------------------------------------------------


def test_malformed_jsonl_line(assets, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "ab 1"}\n{"prompt": "cd 2"}\n{"prompt": "ef 3"\n{"prompt": "gh 4"}\n'
    )
    rc, err = _run(capsys, tiny_config(assets.policy("llama"), prompts, tmp_path / "run"))
    assert rc == 2
    assert f"{prompts}:3: not valid JSON" in err


def test_prompt_record_without_a_prompt(assets, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, [{"prompt": "ab 1"}, {"text": "cd 2"}])
    rc, err = _run(capsys, tiny_config(assets.policy("llama"), prompts, tmp_path / "run"))
    assert rc == 2
    assert f"{prompts}:2: missing field 'prompt'" in err


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_empty_prompts_file(assets, tmp_path, capsys, content):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    rc, err = _run(capsys, tiny_config(assets.policy("llama"), prompts, tmp_path / "run"))
    assert rc == 2
    assert f"{prompts}: no prompts" in err


def test_missing_policy_path(assets, tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    rc, err = _run(capsys, tiny_config(missing, assets.prompts, tmp_path / "run"))
    assert rc == 2
    assert f"model.path: no directory {missing}" in err


def test_reward_model_with_two_labels(assets, tmp_path, capsys):
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / "run",
        model={"reward_model": str(assets.two_label_reward_model)},
    )
    rc, err = _run(capsys, cfg)
    assert rc == 2
    assert "reward model" in err and str(assets.two_label_reward_model) in err
    assert "has 2 labels" in err and "exactly one" in err


def test_reward_function_that_cannot_be_imported(assets, tmp_path, capsys, no_model_loading):
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / "run",
        model={
            "reward_functions": ["ppo_support:no_such_function", "no_such_module_xyz:f", "frac_a"]
        },
    )
    rc, err = _run(capsys, cfg)
    assert rc == 2
    assert "model.reward_functions[2] = 'frac_a': expected 'module:function'" in err


def test_reward_function_import_error_names_the_spec(assets, tmp_path, capsys, no_model_loading):
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / "run",
        model={"reward_functions": ["ppo_support:no_such_function"]},
    )
    rc, err = _run(capsys, cfg)
    assert rc == 2
    assert "reward function 'ppo_support:no_such_function': cannot import" in err


def test_output_dir_holding_a_run_is_not_overwritten(assets, tmp_path, capsys, no_model_loading):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    rc, err = _run(capsys, tiny_config(assets.policy("llama"), assets.prompts, run_dir))
    assert rc == 2
    assert f"output.dir {run_dir} already holds a run" in err and "--resume" in err
    assert (
        run_dir / "metrics.jsonl"
    ).read_text() == '{"step": 1}\n'  # nothing already written is lost


def test_tokenizer_without_pad_token_is_handled(assets, tmp_path, capsys):
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(assets.no_pad_policy).pad_token is None
    run_dir = tmp_path / "run"
    rc, err = _run(capsys, tiny_config(assets.no_pad_policy, assets.prompts, run_dir))
    assert rc == 0, err
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss/policy"]) and math.isfinite(r["loss/value"]) for r in rows)


# ----------------------------------------------------------------------------------------------
# Non-finite scores: skipped and counted, or a stop — never trained on
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def nan_prompts(tmp_path):
    """4 prompts, one starting with 'h' (which ppo_support:nan_for_h scores NaN); batch 4 = all of them."""
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"prompt": p} for p in ("ab 1", "h 2", "cd 3", "ef 4")])
    return path


def _nan_config(assets, prompts, run_dir, **sections):
    return tiny_config(
        assets.policy("llama"),
        prompts,
        run_dir,
        model={"reward_functions": ["ppo_support:nan_for_h"]},
        **sections,
    )


def test_nan_scores_are_skipped_and_counted(assets, tmp_path, nan_prompts, capsys):
    run_dir = tmp_path / "run"
    rc, err = _run(capsys, _nan_config(assets, nan_prompts, run_dir, train={"steps": 3}))
    assert rc == 0, err
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["data/skipped_nonfinite"] for r in rows] == [1, 2, 3]  # cumulative
    for r in rows:
        for k in ("score/mean", "reward/total_mean", "loss/policy", "loss/value", "kl/seq_mean"):
            assert math.isfinite(r[k]), (r["step"], k, r[k])
    assert all(not s["prompt"].startswith("h") for s in read_jsonl(run_dir / "samples.jsonl"))


def test_skipped_count_survives_resume(assets, tmp_path, nan_prompts, capsys):
    """``data/skipped_nonfinite`` is a running count: a resumed run continues it, like every metric."""
    run_dir = tmp_path / "run"
    assert ppo_main(_nan_config(assets, nan_prompts, run_dir, train={"steps": 1})) == 0
    rc, err = _run(capsys, None, "--resume", str(run_dir), "--train.steps", "3")
    assert rc == 0, err
    assert [r["data/skipped_nonfinite"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]


def test_nan_scores_can_stop_the_run(assets, tmp_path, nan_prompts, capsys):
    run_dir = tmp_path / "run"
    rc, err = _run(
        capsys, _nan_config(assets, nan_prompts, run_dir), "--rollout.nonfinite_scores", "error"
    )
    assert rc == 1
    assert "step 1: non-finite scores [nan]" in err and "h 2" in err
    assert "rollout.nonfinite_scores" in err  # says how to skip instead
    assert not (run_dir / "metrics.jsonl").exists() or read_jsonl(run_dir / "metrics.jsonl") == []
    assert (run_dir / "config.yaml").is_file()  # what was written before the error is kept


def test_config_file_with_yaml_error_names_the_line(tmp_path, capsys):
    bad = tmp_path / "run.yaml"
    bad.write_text("model:\n  policy: x\nppo: [1, 2\n")
    rc = ppo_main(None, "--config", str(bad))
    assert rc == 2
    assert f"config file {bad}:" in capsys.readouterr().err
