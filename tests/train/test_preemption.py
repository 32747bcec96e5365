"""Pre-emption (proximal.train.signals): SIGTERM, SIGUSR1 or SIGINT in the middle of a step lets the
step finish, writes that step's checkpoint though none is due, and ends the run with exit status 75
(130 for SIGINT); the same command line with ``--resume auto`` then finishes the run with the
uninterrupted run's metrics (measurements aside) and weights, bitwise. Every run here is stopped at
the end of a pass over its data, so each also proves that a resume at a pass boundary trains the
next pass (the resume of verl#7401 trained no step and exited 0). A second signal during the save
stops at once and leaves the previous checkpoint intact and ``latest``. One process here; two
processes, and a signal that reaches one rank only: tests/train/test_preemption_cluster.py."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from ppo_support import command_main, prompt_texts, read_jsonl, tiny_config
from resume_support import (  # noqa: F401
    assert_same_weights,
    fixed_argv,
    grpo_config,
    measured_out,
    metrics,
    one_thread,
    write_rows,
)

from proximal.cli import main
from proximal.data.jsonl import write_jsonl
from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm
from proximal.train import signals
from proximal.train.checkpoint import completed

STOP = 2  # the step the signal arrives in: the end of the first pass over the data (2 steps a pass)
TOTAL = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_causal_lm(
        tmp_path_factory.mktemp("preempt") / "base", build_char_tokenizer("abcdefgh="), seed=0
    )


def signal_during(monkeypatch, module, name: str, step: int, signum=signal.SIGTERM, **once):
    """Make ``module.name`` (called once per step) send ``signum`` to this process at the start of
    its ``step``-th call: the signal lands in the middle of that step."""
    original, calls = getattr(module, name), [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == step:
            os.kill(os.getpid(), signum)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


def assert_stopped_at(run, step: int, err: str, what: str = "SIGTERM") -> None:
    ckpts = [p.name for p in completed(run / "checkpoints")]
    assert ckpts == [f"step_{step:06d}"], ckpts  # the signal's checkpoint, though none was due
    assert (run / "checkpoints" / "latest").read_text() == f"step_{step:06d}\n"
    assert [r["step"] for r in metrics(run)][-1] == step
    assert err.count("\n") == 1, err  # one line, no traceback
    assert f"{what} received: stopped after step {step} of {TOTAL}, checkpoint" in err
    assert "--resume auto" in err


# ----------------------------------------------------------------------------------------------
# sft, rm, dpo, simpo: the fixed-data-set loop
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "simpo"])
def test_a_stopped_fixed_data_run_resumes_to_the_uninterrupted_run(
    command, base, tmp_path, monkeypatch, capsys
):
    from proximal.train import fixed

    data = write_rows(command, tmp_path / "d.jsonl", 16)  # 2 batches of 8 a pass, 2 passes
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    assert main(fixed_argv(command, base, data, full, save_every=0)) == 0
    argv = fixed_argv(command, base, data, stopped, "--resume", "auto", save_every=0)
    capsys.readouterr()
    with monkeypatch.context() as mp:
        signal_during(mp, fixed, "accumulate", STOP)
        assert main(argv) == 75
    assert_stopped_at(stopped, STOP, capsys.readouterr().err)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back

    assert main(argv) == 0, capsys.readouterr().err  # the same command line continues it
    assert f"--resume auto: continuing from step_{STOP:06d}" in capsys.readouterr().out
    assert [r["step"] for r in metrics(stopped)] == list(range(TOTAL + 1))
    assert measured_out(metrics(stopped)) == measured_out(metrics(full))
    assert metrics(stopped)[-1]["train/epoch"] == 2.0  # the second pass was trained
    assert_same_weights(full, stopped)


@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGUSR1, 75), (signal.SIGINT, 130)], ids=["USR1", "INT"]
)
def test_sigusr1_and_sigint_stop_the_same_way(signum, status, base, tmp_path, monkeypatch, capsys):
    from proximal.train import fixed

    run = tmp_path / "run"
    argv = fixed_argv("sft", base, write_rows("sft", tmp_path / "d.jsonl", 16), run, save_every=0)
    with monkeypatch.context() as mp:
        signal_during(mp, fixed, "accumulate", 3, signum)
        assert main(argv) == status
    assert_stopped_at(run, 3, capsys.readouterr().err, signal.Signals(signum).name)


def test_a_second_signal_during_the_save_leaves_the_previous_checkpoint_latest(
    base, tmp_path, monkeypatch, capsys
):
    """The first SIGTERM in step 3; the second (a real second request, not the first delivered
    twice) while step 3's checkpoint is being written: exit at once, nothing of step 3 left."""
    from proximal.train import checkpoint, fixed

    data = write_rows("sft", tmp_path / "d.jsonl", 16)
    full, run = tmp_path / "full", tmp_path / "run"
    assert main(fixed_argv("sft", base, data, full, save_every=2)) == 0
    argv = fixed_argv("sft", base, data, run, "--resume", "auto", save_every=2)
    export = checkpoint.export_pretrained

    def export_then_signal(module, tokenizer, directory, **kw):
        export(module, tokenizer, directory, **kw)
        if "step_000003" in str(directory):
            os.kill(os.getpid(), signal.SIGTERM)

    capsys.readouterr()
    with monkeypatch.context() as mp:
        mp.setattr(signals, "REPEAT_S", 0.0)
        signal_during(mp, fixed, "accumulate", 3)
        mp.setattr(checkpoint, "export_pretrained", export_then_signal)
        assert main(argv) == 75
    err = capsys.readouterr().err
    assert "stopped at once by a second stop signal (SIGTERM after SIGTERM)" in err
    assert err.count("\n") == 1, err
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    # no step_000003, no half-written .step_000003.tmp
    assert ckpts == ["latest", "newest", "step_000002"]
    assert (run / "checkpoints" / "latest").read_text() == "step_000002\n"
    assert main(argv) == 0, capsys.readouterr().err
    assert measured_out(metrics(run)) == measured_out(metrics(full))
    assert_same_weights(full, run)


def test_a_signal_before_the_first_step_stops_with_nothing_written(
    base, tmp_path, monkeypatch, capsys
):
    from proximal.trainers import sft

    run = tmp_path / "run"
    argv = fixed_argv("sft", base, write_rows("sft", tmp_path / "d.jsonl", 16), run)
    load = sft.load_causal_lm

    def load_then_signal(*a, **k):  # as if the signal came while the model loads
        os.kill(os.getpid(), signal.SIGTERM)
        return load(*a, **k)

    monkeypatch.setattr(sft, "load_causal_lm", load_then_signal)
    assert main(argv) == 75
    assert "SIGTERM received before the first step: stopped; nothing was written" in (
        capsys.readouterr().err
    )
    assert not run.exists() or not any(run.iterdir())


# ----------------------------------------------------------------------------------------------
# ppo and grpo: the online loops
# ----------------------------------------------------------------------------------------------


def _online(command: str, assets, tmp_path, name: str) -> dict:
    prompts = tmp_path / "prompts.jsonl"  # a pass over the prompts is 2 steps
    if command == "ppo":
        write_jsonl(prompts, [{"prompt": p} for p in prompt_texts(8)])
        return tiny_config(
            assets.policy("llama"),
            prompts,
            tmp_path / name,
            optim={"warmup_steps": 3, "schedule": "linear"},
            kl={"controller": "adaptive", "target": 0.05},
            train={"steps": TOTAL, "save_every": 0},
        )
    write_jsonl(prompts, [{"prompt": p} for p in prompt_texts(4)])
    return grpo_config(
        assets.policy("llama"),
        prompts,
        tmp_path / name,
        model={"reward_functions": ["ppo_support:length"]},
        optim={"warmup_steps": 3},
        train={"steps": TOTAL, "save_every": 0},
    )


@pytest.mark.parametrize("command", ["ppo", "grpo"])
def test_a_stopped_online_run_resumes_to_the_uninterrupted_run(
    command, assets, tmp_path, monkeypatch, capsys
):
    import importlib

    trainer = importlib.import_module(f"proximal.trainers.{command}")
    full, stopped = (_online(command, assets, tmp_path, n) for n in ("full", "stopped"))
    assert command_main(command, full) == 0, capsys.readouterr().err
    capsys.readouterr()
    with monkeypatch.context() as mp:
        signal_during(mp, trainer, "collect_step", STOP)  # during the step's rollout
        assert command_main(command, stopped, "--resume", "auto") == 75
    run = tmp_path / "stopped"
    assert_stopped_at(run, STOP, capsys.readouterr().err)
    assert command_main(command, stopped, "--resume", "auto") == 0, capsys.readouterr().err

    a, b = read_jsonl(tmp_path / "full" / "metrics.jsonl"), read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, TOTAL + 1))
    assert measured_out(b) == measured_out(a)
    assert b[-1]["data/epoch"] == 1  # the second pass over the prompts was trained
    assert read_jsonl(tmp_path / "full" / "samples.jsonl") == read_jsonl(run / "samples.jsonl")
    last = f"checkpoints/step_{TOTAL:06d}"
    for sub in ("policy", "critic") if command == "ppo" else ("policy",):
        assert_same_weights(tmp_path / "full" / last / sub, run / last / sub)


# ----------------------------------------------------------------------------------------------
# The handlers themselves
# ----------------------------------------------------------------------------------------------


def test_the_handlers_record_the_first_signal_and_are_put_back():
    before = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}
    assert signals.install()
    try:
        assert signals.received() == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # the same request delivered twice: not a second one
        assert signals.received() == signal.SIGUSR1
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # another signal: a second request, at once
    finally:
        signals.restore()
    assert {s: signal.getsignal(s) for s in signals.STOP_SIGNALS} == before
    assert signals.received() == 0


def test_outside_the_main_thread_nothing_is_installed():
    done = []
    t = threading.Thread(target=lambda: done.append(signals.install()))
    t.start()
    t.join()
    assert done == [False] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
