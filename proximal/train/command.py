"""The command-line glue every training command shares: config loading, ``--resume``, and one map
from exceptions to exit codes.

``proximal <command> --config FILE [--section.key value ...]``, ``--resume RUN_DIR``, or
``--config FILE --resume auto`` (the same line for the first launch and every relaunch). A user's
mistake (bad config, bad data, a model that cannot load, a damaged checkpoint, a reward function
that fails) is one line on stderr and exit status 2, with no traceback; a training failure (a
non-finite loss or score, a checkpoint the disk had no room for) exit status 1; a run stopped by
SIGTERM or SIGUSR1 after writing its checkpoint (pre-emption, :mod:`proximal.train.signals`) exit
status 75, by Ctrl-C 130; a bug is a traceback, as it should be. ``PROXIMAL_TRACEBACK=1`` prints the
whole traceback (every chained exception) before the one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as td
import yaml

from proximal import dist
from proximal.config import ConfigError, help_text, load_config, missing_path, parse_overrides
from proximal.data.jsonl import DataError
from proximal.models.loading import ModelLoadError
from proximal.rollout.generator import GeneratorError, GeneratorLost
from proximal.rollout.reward_functions import RewardFunctionError, RewardServerLost
from proximal.train import signals
from proximal.train.checkpoint import DISK_FULL, CheckpointError, SaveError, completed
from proximal.train.run import AUTO, RunFinished

#: Exceptions that mean the input was wrong: exit status 2.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    DataError,
    ModelLoadError,
    RewardFunctionError,
    CheckpointError,
    FileNotFoundError,
    FileExistsError,
    ImportError,
)
#: Exceptions that mean training itself failed (e.g. a non-finite loss, a checkpoint that could not
#: be written, a reward server lost for good): exit status 1.
TRAINING_ERRORS: tuple[type[BaseException], ...] = (
    FloatingPointError,
    SaveError,
    RewardServerLost,
    GeneratorError,
)

#: Exit statuses. EXIT_PREEMPTED: stopped by SIGTERM or SIGUSR1 — after the step in progress and its
#: checkpoint, or at once on a second signal with the previous checkpoint intact — so a scheduler
#: requeues the job and the same command line with ``--resume auto`` continues it. 75 is sysexits.h's
#: EX_TEMPFAIL ("a temporary failure; the user is invited to retry"): distinct from 0 (done), 1
#: (training failed), 2 (bad input) and 130 (Ctrl-C, 128 + SIGINT), and not 143 (128 + SIGTERM),
#: which shells and schedulers read as "killed by SIGTERM", a failure.
EXIT_OK, EXIT_TRAINING, EXIT_USER, EXIT_PREEMPTED, EXIT_INTERRUPTED = 0, 1, 2, 75, 130

#: The environment variable that makes a one-line error print its whole traceback first (any value
#: but empty or 0): docs/errors.md, "The whole traceback".
TRACEBACK_ENV = "PROXIMAL_TRACEBACK"


def print_traceback(error: BaseException) -> None:
    """With ``PROXIMAL_TRACEBACK`` set, ``error``'s traceback and its chain on stderr (else nothing)."""
    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        traceback.print_exception(error, file=sys.stderr)
        sys.stderr.flush()


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because another rank died or stalled."""
    if not dist.is_distributed() or not isinstance(error, RuntimeError):
        return False
    if isinstance(error, getattr(td, "DistError", ())):
        return True
    text = str(error)
    return any(
        s in text
        for s in ("Connection closed by peer", "Connection reset by peer", "timed out", "Timed out")
    )


def exit_code(error: BaseException) -> int | None:
    """The exit status for an exception a command reports in one line, or None for a bug."""
    if isinstance(error, GeneratorLost):  # a fresh generator, from the last checkpoint, is the cure
        return EXIT_PREEMPTED
    if lost_peer(error):
        return EXIT_TRAINING
    if isinstance(error, signals.Stopped):
        return EXIT_INTERRUPTED if error.signum == signal.SIGINT else EXIT_PREEMPTED
    if isinstance(error, OSError) and error.errno in DISK_FULL:  # a log line, an export
        return EXIT_TRAINING
    if isinstance(error, USER_ERRORS):
        return EXIT_USER
    if isinstance(error, TRAINING_ERRORS):
        return EXIT_TRAINING
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return None


def say(prog: str, message: str, *, error: bool = True) -> None:
    """One line from ``proximal <prog>``; under torchrun other ranks than 0 prefix their rank."""
    prefix = f"[rank {dist.rank()}] " if dist.rank() > 0 else ""
    print(
        f"{prefix}proximal {prog}: {message}", file=sys.stderr if error else sys.stdout, flush=True
    )


def run_reporting(prog: str, fn: Callable[[], object]) -> tuple[int, object]:
    """``(exit status, result)`` of ``fn()``, with a user mistake or a training failure reported in one line."""
    try:
        return EXIT_OK, fn()
    except BaseException as e:  # noqa: BLE001 - re-raised below unless it is one we report
        code = exit_code(e)
        if code is None:
            raise
        if getattr(e, "everywhere", False) and dist.rank() > 0:
            # every rank met it alike (a stop agreed, a save that failed): rank 0 says it
            return code, None
        if isinstance(e, KeyboardInterrupt):
            message = "interrupted"
        elif isinstance(e, OSError) and e.errno in DISK_FULL:
            message = f"{e.strerror}: {e.filename}" if e.filename else str(e)
        elif lost_peer(e):
            message = (
                f"stopped: another process of the job failed or stalled ({str(e).splitlines()[0][:160]}); "
                "look for that process's own message (a process killed from outside prints none)"
            )
        else:
            message = str(e)
        print_traceback(e)
        say(prog, message)
        return code, None


def check_same_models(saved_config: Path, cfg) -> None:
    """Refuse a resume whose ``model`` section differs from the run's own (another checkpoint, LoRA on
    or off, another reward model): the checkpoint's weights and optimiser states belong to those models.
    The section's ``changeable_on_resume`` fields may differ (a reward's time limit, how a reward
    server is called: what its stopping line tells the user to raise before resuming)."""
    saved = (yaml.safe_load(saved_config.read_text()) or {}).get("model") or {}
    now = (
        dataclasses.asdict(cfg.model)
        if dataclasses.is_dataclass(getattr(cfg, "model", None))
        else {}
    )
    changed = [
        f"model.{k} = {now[k]!r} (the run has {saved[k]!r})"
        for k in now
        if k in saved
        and saved[k] != now[k]
        and k not in getattr(cfg.model, "changeable_on_resume", ())
    ]
    if changed:
        raise ConfigError(
            f"--resume {saved_config.parent}: a resumed run keeps the models it was trained with; "
            f"{'; '.join(changed)}. Train the other model in a new output.dir"
        )


def check_auto(cfg) -> None:
    """``--resume auto``'s checks of the config, before anything loads: ``output.overwrite`` would
    delete the very run it continues; a run in ``output.dir`` with a checkpoint keeps its models
    (:func:`check_same_models`)."""
    output = getattr(cfg, "output", None)
    if output is None:  # pragma: no cover - every training command has an output section
        raise ConfigError("--resume auto: this command has no output.dir to continue")
    if output.overwrite:
        raise ConfigError(
            "--resume auto continues the run in output.dir, and output.overwrite = true would "
            "delete it; give one or the other"
        )
    run_dir = Path(output.dir)
    if (run_dir / "config.yaml").is_file() and completed(run_dir / "checkpoints"):
        check_same_models(run_dir / "config.yaml", cfg)


class _ReportedByRankZero(Exception):
    """A mistake every process of the job met alike; rank 0 has reported it."""

    def __init__(self, code: int):
        super().__init__()
        self.code = code


def config_command(
    argv: list[str],
    *,
    prog: str,
    description: str,
    config_cls: type,
    train: Callable[..., Any],
    summary: Callable[[Any], str | None] | None = None,
    failed: Callable[[Any], str | None] | None = None,
    resume: bool = True,
    config_help: str = "YAML file with the run's config sections",
    reported_once: tuple[type[BaseException], ...] = (),
) -> int:
    """``proximal <prog> --config FILE [--section.key value ...] [--resume RUN_DIR]``.

    ``train(cfg, resume_dir=None)`` (``train(cfg)`` when ``resume`` is false: the command has no
    ``--resume``) gets the loaded, validated config and returns its result, for a training command the
    run directory. When it finishes, ``failed(result)`` may name a failure in one line (exit status 1:
    e.g. some of a comparison's runs failed); otherwise ``summary(result)`` gives the one line printed
    (None: no line; without ``summary``: the run directory). Config errors are one message, exit
    status 2, before any model is loaded (printed once, by rank 0, under torchrun); so are the
    ``reported_once`` exceptions ``train`` raises — mistakes found after loading that every process
    meets alike (the other ranks exit with the same status in silence).
    """
    parser = argparse.ArgumentParser(
        prog=f"proximal {prog}",
        description=description,
        epilog=help_text(config_cls),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help=config_help)
    if resume:
        parser.add_argument(
            "--resume",
            metavar="RUN_DIR|auto",
            help="continue the run in RUN_DIR from its newest intact checkpoint (its config.yaml is "
            "used; overrides such as --train.steps apply on top). 'auto': continue the run in "
            "output.dir (of --config and the overrides) when it has an intact checkpoint, start it "
            "when it has none, and do nothing when it is finished - one command line for the first "
            "launch and every relaunch (a directory named auto: ./auto)",
        )
    args, rest = parser.parse_known_args(argv)
    resume_dir = getattr(args, "resume", None)
    try:
        overrides = parse_overrides(rest)
        config_path = args.config
        if resume_dir == AUTO:
            cfg = load_config(config_cls, config_path, overrides)
            check_auto(cfg)
        elif resume_dir is not None:
            saved = Path(resume_dir) / "config.yaml"
            if not Path(resume_dir).is_dir():
                raise ConfigError(f"--resume {resume_dir}: {missing_path(resume_dir)}")
            if not saved.is_file():
                raise ConfigError(
                    f"--resume {resume_dir}: no config.yaml there; is it a run directory?"
                )
            config_path = config_path or saved
            cfg = load_config(config_cls, config_path, overrides)
            check_same_models(Path(resume_dir) / "config.yaml", cfg)
        else:
            cfg = load_config(config_cls, config_path, overrides)
    except ConfigError as e:
        if dist.launched_rank() == 0:
            print_traceback(e)
            print(f"proximal {prog}: {e}", file=sys.stderr)
        return EXIT_USER

    def attempt():
        try:
            return train(cfg, resume_dir=resume_dir) if resume else train(cfg)
        except RunFinished as e:  # --resume auto of a finished run: nothing was done
            return e
        except reported_once as e:
            if dist.launched_rank() == 0:
                raise
            raise _ReportedByRankZero(exit_code(e)) from e

    try:
        code, result = run_reporting(prog, attempt)
    except _ReportedByRankZero as e:
        return e.code
    finally:
        signals.restore()  # the run's stop-signal handlers (pre-emption), however it ended
    if isinstance(result, RunFinished):
        if dist.is_main():
            print(f"proximal {prog}: {result}", flush=True)
        return EXIT_OK
    why = failed(result) if code == EXIT_OK and failed is not None else None
    if why:
        say(prog, why)
        return EXIT_TRAINING
    if code == EXIT_OK and dist.is_main():
        line = summary(result) if summary is not None else f"done; run directory {result}"
        if line is not None:
            print(f"proximal {prog}: {line}", flush=True)
    return code
