"""``--resume auto``: one command line for the first launch and every relaunch. It starts a run in a
new directory, or in one that an earlier launch left without a checkpoint; continues from the newest
intact checkpoint (tests/train/test_preemption.py: a pre-empted run continued this way equals the
uninterrupted one); does nothing to a finished run, before any model loads; and refuses what it
cannot continue, in one line with exit status 2."""

from __future__ import annotations

import shutil

import pytest
from resume_support import (  # noqa: F401
    fixed_argv,
    grpo_config,
    metrics,
    one_thread,
    write_rows,
)

from proximal.cli import main
from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_causal_lm(
        tmp_path_factory.mktemp("auto") / "base", build_char_tokenizer("abcdefgh="), seed=0
    )


@pytest.fixture(scope="module")
def finished(base, tmp_path_factory):
    """A finished SFT run launched with --resume auto into a new directory; (argv, run dir, stdout)."""
    tmp = tmp_path_factory.mktemp("finished")
    argv = fixed_argv("sft", base, write_rows("sft", tmp / "d.jsonl", 16), tmp / "run")
    return argv, tmp / "run"


def test_a_new_directory_starts_and_a_finished_run_is_left_alone(finished, monkeypatch, capsys):
    argv, run = finished
    assert main(argv + ["--resume", "auto"]) == 0, capsys.readouterr().err
    assert "--resume auto: no checkpoint in" in capsys.readouterr().out
    assert [r["step"] for r in metrics(run)] == [0, 1, 2, 3, 4]  # 2 passes of 2 steps

    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    from proximal.trainers import sft

    def no_model(*a, **k):
        raise AssertionError("a finished run loaded its model")

    monkeypatch.setattr(sft, "load_causal_lm", no_model)
    assert main(argv + ["--resume", "auto"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"proximal sft: the run in {run} is finished (its checkpoint is step 4 of 4)" in out
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before  # nothing touched


def test_a_finished_online_run_stops_before_its_models_load(assets, tmp_path, monkeypatch, capsys):
    from ppo_support import command_main

    from proximal.trainers import grpo

    cfg = grpo_config(assets.policy("llama"), assets.prompts, tmp_path / "run", train={"steps": 1})
    assert command_main("grpo", cfg, "--resume", "auto") == 0, capsys.readouterr().err
    monkeypatch.setattr(grpo, "build_models", lambda *a, **k: pytest.fail("models loaded"))
    assert command_main("grpo", cfg, "--resume", "auto") == 0
    assert "is finished (its checkpoint is step 1 of 1)" in capsys.readouterr().out


def test_an_interrupted_first_launch_is_started_again(base, tmp_path, capsys):
    """Killed before its first checkpoint: config.yaml, two metrics lines and a half-written
    checkpoint; --resume auto starts the run afresh in the same directory."""
    run = tmp_path / "run"
    argv = fixed_argv("sft", base, write_rows("sft", tmp_path / "d.jsonl", 16), run)
    (run / "checkpoints" / ".step_000001.tmp" / "state").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n")
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    assert main(argv + ["--resume", "auto"]) == 0, capsys.readouterr().err
    assert "starting the run (replacing the files of an earlier launch)" in capsys.readouterr().out
    assert [r["step"] for r in metrics(run)] == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "latest",
        "newest",
        "step_000003",
        "step_000004",
    ]


def test_what_auto_cannot_continue_is_refused(finished, base, tmp_path, capsys):
    argv, run = finished
    if not (run / "checkpoints").is_dir():  # the finished run is built by the first test
        assert main(argv + ["--resume", "auto"]) == 0
    capsys.readouterr()

    def refused(argv_: list[str]) -> str:
        assert main(argv_ + ["--resume", "auto"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err  # one line, no traceback
        return err

    assert "output.overwrite = true would delete it" in refused(
        argv + ["--output.overwrite", "true"]
    )
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not a run")
    assert "does not look like a run directory" in refused(argv + ["--output.dir", str(other)])
    # the model of a run is its own
    other_base = build_tiny_causal_lm(tmp_path / "b2", build_char_tokenizer("abcdefgh="), seed=1)
    assert "a resumed run keeps the models it was trained with" in refused(
        argv + ["--model.path", str(other_base)]
    )
    # a run of another command
    dpo = fixed_argv("dpo", base, write_rows("dpo", tmp_path / "p.jsonl", 16), run)
    assert "is a checkpoint of proximal sft, not of proximal dpo" in refused(dpo)
    # every checkpoint damaged
    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged)
    for ckpt in (damaged / "checkpoints").glob("step_*"):
        (ckpt / "trainer_state.pt").write_bytes(b"")
    err = refused(argv + ["--output.dir", str(damaged)])
    assert (
        f"--resume auto: {damaged} has checkpoints but none is intact (skipping checkpoint" in err
    )
    assert "launch it without --resume auto and with --output.overwrite true" in err
