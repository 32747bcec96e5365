"""Every user mistake gets one clear line and never a traceback; nothing is trained on silently.

One test per kind of bad input that was found answered badly (issue 13), through the real command
line: the exit status (2 for bad input, 1 for a failure during training), the message (it names the
file and line, the config field, or the reward function and the step), no traceback, and nothing
written where nothing should be. Then damaged checkpoints: truncated or corrupted at several
offsets, each file of a checkpoint, they are never resumed from.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from ppo_support import ppo_main, read_jsonl, tiny_config, without_timing

from proximal.cli import main
from proximal.data.jsonl import write_jsonl


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


def _sft_argv(assets, train_file, out, *extra):
    return [
        "sft",
        "--model.path",
        str(assets.policy("llama")),
        "--data.train_file",
        str(train_file),
        "--data.max_length",
        "32",
        "--train.batch_size",
        "2",
        "--train.micro_batch_size",
        "1",
        "--train.steps",
        "1",
        "--output.dir",
        str(out),
        "--output.progress",
        "false",
        *extra,
    ]


def _rm_argv(assets, train_file, out, *extra):
    return [
        "rm",
        "--model.path",
        str(assets.policy("llama")),
        "--data.train_file",
        str(train_file),
        "--data.max_length",
        "32",
        "--train.batch_size",
        "2",
        "--train.micro_batch_size",
        "1",
        "--train.steps",
        "1",
        "--output.dir",
        str(out),
        "--output.progress",
        "false",
        *extra,
    ]


# ---------------------------------------------------------------------------------- data files


def test_non_utf8_bytes_name_the_file_and_line(assets, tmp_path, capsys):
    bad = (
        b'{"prompt": "ab 1", "response": "aa", "chosen": "a", "rejected": "b"}\n'
        b'{"prompt": "caf\xe9", "response": "a", "chosen": "a", "rejected": "b"}\n'
    )
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(bad)
    for argv in (_sft_argv(assets, f, tmp_path / "sft"), _rm_argv(assets, f, tmp_path / "rm")):
        assert main(argv) == 2
        assert f"{f}:2: not valid UTF-8 (byte 0xe9 at column" in _err(capsys)
    assert ppo_main(tiny_config(assets.policy("llama"), f, tmp_path / "ppo")) == 2
    assert f"{f}:2: not valid UTF-8" in _err(capsys)
    assert not any((tmp_path / d).exists() for d in ("sft", "rm", "ppo"))  # nothing written


def test_empty_prompt_is_an_error_or_skipped_and_counted(assets, tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    write_jsonl(
        f,
        [
            {"prompt": "ab 1"},
            {"prompt": ""},
            {"prompt": "cd 2"},
            {"prompt": "e 3"},
            {"prompt": "f 4"},
        ],
    )
    assert ppo_main(tiny_config(assets.policy("llama"), f, tmp_path / "run")) == 2
    assert f"{f}:2: the prompt '' has no tokens after tokenisation" in _err(capsys)
    assert (
        ppo_main(
            tiny_config(
                assets.policy("llama"),
                f,
                tmp_path / "run",
                data={"on_empty_prompt": "skip"},
                train={"steps": 1},
            )
        )
        == 0
    )
    [row] = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert row["data/prompts_skipped_empty"] == 1
    only_empty = tmp_path / "empty.jsonl"
    write_jsonl(only_empty, [{"prompt": ""}] * 3)
    assert (
        ppo_main(
            tiny_config(
                assets.policy("llama"),
                only_empty,
                tmp_path / "run2",
                data={"on_empty_prompt": "skip"},
            )
        )
        == 2
    )
    assert f"{only_empty}: no prompts (3 were empty and skipped)" in _err(capsys)


def test_empty_responses_are_errors_or_skipped_and_counted(assets, tmp_path, capsys):
    sft = tmp_path / "sft.jsonl"
    write_jsonl(
        sft,
        [
            {"prompt": "a", "response": "b"},
            {"prompt": "c", "response": ""},
            {"prompt": "d", "response": "e"},
        ],
    )
    assert main(_sft_argv(assets, sft, tmp_path / "s1")) == 2
    assert f"{sft}:2: the response is empty" in _err(capsys)
    assert main(_sft_argv(assets, sft, tmp_path / "s2", "--data.on_empty", "skip")) == 0
    assert read_jsonl(tmp_path / "s2" / "metrics.jsonl")[0]["data/train_skipped_empty"] == 1
    prefs = tmp_path / "prefs.jsonl"
    write_jsonl(
        prefs,
        [
            {"prompt": "a", "chosen": "b", "rejected": "c"},
            {"prompt": "a", "chosen": "", "rejected": "c"},
            {"prompt": "a", "chosen": "b", "rejected": "b"},
            {"prompt": "d", "chosen": "e", "rejected": "f"},
        ],
    )
    assert main(_rm_argv(assets, prefs, tmp_path / "r1")) == 2
    assert f"{prefs}:2: 'chosen' is empty" in _err(capsys)
    assert main(_rm_argv(assets, prefs, tmp_path / "r2", "--data.on_empty", "skip")) == 0
    assert (
        read_jsonl(tmp_path / "r2" / "metrics.jsonl")[0]["data/train_skipped_empty"] == 2
    )  # empty, and same twice
    write_jsonl(prefs, [{"prompt": "a", "chosen": "b", "rejected": "b"}])
    assert main(_rm_argv(assets, prefs, tmp_path / "r3")) == 2
    assert (
        f"{prefs}:1: 'chosen' and 'rejected' are the same response, so the pair teaches nothing"
        in _err(capsys)
    )


# ---------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "override, field",
    [
        (("--ppo.clip_eps", "1.5"), "ppo.clip_eps = 1.5 must lie in (0, 1)"),
        (("--ppo.lam", "1.2"), "ppo.lam = 1.2 must lie in [0, 1]"),
        (("--kl.beta", "-0.1"), "kl.beta = -0.1 must lie in [0, ∞)"),
        (("--rollout.temperature", "0"), "rollout.temperature = 0.0 must lie in (0, ∞)"),
        (("--train.device", "gpu"), "train.device = 'gpu' is not one of auto, cpu, cuda, cuda:N"),
    ],
)
def test_out_of_range_values_are_refused_before_any_model_loads(
    override, field, assets, tmp_path, capsys, monkeypatch
):
    from proximal.trainers import ppo

    monkeypatch.setattr(ppo, "build_models", lambda *a, **k: pytest.fail("models were loaded"))
    assert (
        ppo_main(tiny_config(assets.policy("llama"), assets.prompts, tmp_path / "run"), *override)
        == 2
    )
    assert field in _err(capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        (
            ("--output.tensorboard", "true"),
            "output.tensorboard=true needs TensorBoard: pip install 'proximal-rlhf[tensorboard]'",
        ),
        (
            ("--output.wandb_project", "p"),
            "output.wandb_project needs Weights & Biases: pip install 'proximal-rlhf[wandb]'",
        ),
    ],
)
def test_a_missing_logging_extra_is_refused_before_overwrite_deletes_anything(
    override, message, assets, tmp_path, capsys, monkeypatch
):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("tensorboard", "wandb") else find_spec(name, *a),
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("earlier: run\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = tiny_config(assets.policy("llama"), assets.prompts, run)
    assert ppo_main(cfg, "--output.overwrite", "true", *override) == 2
    assert f"invalid configuration:\n  - {message}" in _err(capsys)
    assert (run / "config.yaml").read_text() == "earlier: run\n" and (
        run / "metrics.jsonl"
    ).is_file()


def test_a_causal_lm_as_reward_model_is_named_as_such(assets, tmp_path, capsys):
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / "run",
        model={"reward_model": str(assets.policy("gpt2"))},
    )
    assert ppo_main(cfg) == 2
    err = _err(capsys)
    assert (
        "is a GPT2LMHeadModel (a language model), not a reward model" in err
        and "proximal rm" in err
    )
    assert "labels" not in err


def test_a_reward_model_as_the_policy_is_named_as_such(assets, tmp_path, capsys):
    """transformers would load the backbone into a causal LM with a fresh output layer and train it."""
    cfg = tiny_config(
        assets.reward_model("llama"),
        assets.prompts,
        tmp_path / "run",
        model={"reward_model": str(assets.reward_model("llama"))},
    )
    assert ppo_main(cfg) == 2
    err = _err(capsys)
    assert (
        f"policy (model.path): {str(assets.reward_model('llama'))!r} is a LlamaForSequenceClassification (a classifier"
        in err
    )
    assert "not a language model" in err


def test_a_non_finite_gradient_names_the_step(assets, tmp_path, capsys, monkeypatch):
    """The second step's gradient norm is NaN (as after a loss overflow): exit status 1, the step and
    the model named, the weights of step 1 kept (the step was not applied)."""
    real, calls = torch.nn.utils.clip_grad_norm_, []

    def nan_on_the_second(params, max_norm, *args, **kwargs):
        calls.append(1)
        norm = real(params, max_norm, *args, **kwargs)
        return norm * float("nan") if len(calls) == 2 else norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", nan_on_the_second)
    rows = tmp_path / "sft.jsonl"
    write_jsonl(rows, [{"prompt": "ab 1", "response": "aa"}, {"prompt": "ba 2", "response": "b"}])
    assert main(_sft_argv(assets, rows, tmp_path / "sft", "--train.steps", "3")) == 1
    err = _err(capsys)
    assert "step 2: the gradient norm of the model is nan; the step was not applied" in err
    assert len(calls) == 2 and len(read_jsonl(tmp_path / "sft" / "metrics.jsonl")) >= 1


def test_repeated_character_in_a_tiny_tokenizer(assets):
    from proximal.models.tiny import build_char_tokenizer

    with pytest.raises(ValueError, match="the alphabet repeats 'a'"):
        build_char_tokenizer("abca")


# ---------------------------------------------------------------------------------- reward functions


def test_a_reward_function_that_raises_is_named_with_the_step(assets, tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    write_jsonl(f, [{"prompt": p} for p in ("ab 1", "cd 2", "h 3", "ef 4")])
    cfg = tiny_config(
        assets.policy("llama"),
        f,
        tmp_path / "run",
        model={"reward_functions": ["ppo_support:raise_for_h"]},
    )
    assert ppo_main(cfg) == 2
    assert (
        "reward function 'ppo_support:raise_for_h' at step 1 raised KeyError: \"no reference answer for 'h 3'\""
        in _err(capsys)
    )


def test_a_reward_function_returning_a_string_is_refused(assets, tmp_path, capsys):
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / "run",
        model={"reward_functions": ["ppo_support:digits_as_string"]},
    )
    assert ppo_main(cfg) == 2
    err = _err(capsys)
    assert "reward function 'ppo_support:digits_as_string' at step 1 returned str '" in err
    assert "it must return a list of 4 numbers, one per completion" in err


# ---------------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def finished_run(assets, tmp_path_factory):
    """A 2-step PPO run with a checkpoint after each step, and the uninterrupted 3-step run."""
    root = tmp_path_factory.mktemp("ckpt")

    def cfg(name, steps):
        return tiny_config(
            assets.policy("llama"),
            assets.prompts,
            root / name,
            model={"reward_model": str(assets.reward_model("llama")), "critic": "reward_model"},
            train={"steps": steps, "save_every": 1, "keep_checkpoints": 3},
        )

    assert ppo_main(cfg("two", 2)) == 0
    assert ppo_main(cfg("three", 3)) == 0
    return root


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def test_a_truncated_trainer_state_falls_back_to_the_intact_checkpoint(
    finished_run, tmp_path, capsys
):
    run = _copy(finished_run / "two", tmp_path / "run")
    state = run / "checkpoints" / "step_000002" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    assert ppo_main(None, "--resume", str(run), "--train.steps", "3") == 0
    out = capsys.readouterr().out
    assert (
        "skipping checkpoint step_000002:" in out
        and "trainer_state.pt has" in out
        and "truncated" in out
    )
    assert "resuming from step_000001, the newest intact checkpoint" in out
    resumed = [without_timing(r) for r in read_jsonl(run / "metrics.jsonl")]
    full = [without_timing(r) for r in read_jsonl(finished_run / "three" / "metrics.jsonl")]
    assert resumed == full  # steps 2 and 3 were redone from step 1's state, exactly


def test_an_interrupted_save_is_cleaned_up_on_resume(finished_run, tmp_path, capsys):
    run = _copy(finished_run / "two", tmp_path / "run")
    left = run / "checkpoints" / ".step_000003.tmp"
    (left / "state").mkdir(parents=True)
    (left / "state" / "__0_0.distcp").write_bytes(b"\0" * 1000)
    assert ppo_main(None, "--resume", str(run), "--train.steps", "3") == 0
    assert (
        "removed 1 incomplete checkpoint(s) left by an interrupted save: .step_000003.tmp"
        in capsys.readouterr().out
    )
    assert not left.exists()


def test_no_intact_checkpoint_is_a_clear_error(finished_run, tmp_path, capsys):
    run = _copy(finished_run / "two", tmp_path / "run")
    for ckpt in (run / "checkpoints").glob("step_*"):
        (ckpt / "state" / ".metadata").write_bytes(b"garbage")
    assert ppo_main(None, "--resume", str(run)) == 2
    err = _err(capsys)
    assert (
        f"--resume {run}: no intact checkpoint" in err and "skipping checkpoint step_000002" in err
    )


def test_damage_anywhere_in_a_checkpoint_is_detected(finished_run, tmp_path):
    """Every file of a checkpoint, truncated at three offsets or with one byte flipped: the checkpoint
    is never chosen for resuming, and the intact older one is."""
    from proximal.train.checkpoint import find_checkpoint

    src = finished_run / "two" / "checkpoints"
    files = sorted(
        p.relative_to(src / "step_000002")
        for p in (src / "step_000002").rglob("*")
        if p.is_file() and p.name != "manifest.json"
    )
    assert len(files) >= 10 and any(str(f).startswith("state/") for f in files)
    checked = 0
    for rel in files:
        size = (src / "step_000002" / rel).stat().st_size
        for damage in ("start", "middle", "end-1", "flip"):
            root = tmp_path / "c"
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(src, root)
            f = root / "step_000002" / rel
            data = f.read_bytes()
            if damage == "flip":
                if not data:
                    continue
                i = len(data) // 3
                f.write_bytes(data[:i] + bytes([data[i] ^ 0x20]) + data[i + 1 :])
            else:
                cut = {"start": 0, "middle": size // 2, "end-1": max(size - 1, 0)}[damage]
                if cut == size:
                    continue
                f.write_bytes(data[:cut])
            found, notes = find_checkpoint(root)
            assert found == root / "step_000001", (rel, damage, notes)
            assert any(str(rel.name) in n for n in notes), (rel, damage, notes)
            checked += 1
    assert checked >= 3 * len(files)


@pytest.mark.parametrize("override", [["--model.path", "OTHER"], ["--model.lora_r", "4"]])
def test_resuming_with_other_models_is_refused(override, finished_run, assets, tmp_path, capsys):
    run = _copy(finished_run / "two", tmp_path / "run")
    other = str(assets.policy("gpt2"))
    override = [other if v == "OTHER" else v for v in override]
    assert ppo_main(None, "--resume", str(run), "--train.steps", "3", *override) == 2
    err = _err(capsys)
    key = override[0][2:]
    assert f"--resume {run}: a resumed run keeps the models it was trained with; {key} = " in err
    assert "(the run has " in err and "Traceback" not in err
    assert not (run / "checkpoints" / "step_000003").exists()


def test_a_checkpoint_that_does_not_fit_the_model_is_named(finished_run, assets, tmp_path, capsys):
    """config.yaml edited by hand to another architecture: the checkpoint's keys are missing from it."""
    import yaml

    run = _copy(finished_run / "two", tmp_path / "run")
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["model"]["path"] = str(assets.policy("gpt2"))
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert ppo_main(None, "--resume", str(run), "--train.steps", "3") == 2
    err = _err(capsys)
    assert (
        f"checkpoint {run / 'checkpoints' / 'step_000002'}: its weights do not fit the models being trained"
        in err
    )
    assert "Missing key" in err and "Traceback" not in err


def test_resuming_past_the_configured_steps(finished_run, tmp_path, capsys):
    """Fewer steps than the checkpoint's: refused, nothing touched. As many: a note, nothing trained."""
    run = _copy(finished_run / "two", tmp_path / "run")
    before = (run / "metrics.jsonl").read_text()
    assert ppo_main(None, "--resume", str(run), "--train.steps", "1") == 2
    err = _err(capsys)
    assert (
        f"--resume {run}: its checkpoint is at step 2, past the 1 steps this config trains" in err
    )
    assert "give --train.steps larger than 2" in err
    assert (run / "metrics.jsonl").read_text() == before
    listing = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert listing == ["latest", "newest", "step_000001", "step_000002"]
    assert ppo_main(None, "--resume", str(run)) == 0
    assert "the run is already at step 2 of 2: nothing to train" in capsys.readouterr().out
    assert (run / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == listing
