"""The ``proximal`` command line.

``proximal <command> ...``; each command lives in its own module and is imported only when used, so
``proximal --help`` stays instant. Training commands share one shape::

    proximal ppo --config run.yaml [--section.key value ...]
    proximal ppo --resume RUN_DIR
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Callable

# command -> (module, function taking argv, one-line summary)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "ppo": ("proximal.trainers.ppo", "cli", "PPO-based RLHF: actor, reference, reward model and critic (seed §1-§6)"),
    "sft": ("proximal.trainers.sft", "cli", "supervised fine-tuning on prompt/response pairs"),
    "rm": ("proximal.trainers.reward", "cli", "reward-model training with the Bradley-Terry loss"),
    "demo": ("proximal.demo", "cli", "the whole of RLHF offline on a CPU: SFT -> RM -> PPO, with a report"),
    "memory": ("proximal.memory", "cli", "GPU memory planner for the four PPO models (seed §7)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from proximal import __version__
        print(f"proximal {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"proximal: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    _quiet_transformers()
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


def _quiet_transformers() -> None:
    """Our own progress bars say what is happening; the per-file loading bars of transformers are noise."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _usage() -> str:
    lines = ["usage: proximal <command> [options]", "", "commands:"]
    lines += [f"  {n:<8} {summary}" for n, (_, _, summary) in COMMANDS.items()]
    lines += ["", "Run `proximal <command> --help` for a command's options and config fields."]
    return "\n".join(lines)


def config_command(argv: list[str], *, prog: str, description: str, config_cls: type,
                   run: Callable[..., Any], resumable: bool = True) -> int:
    """Shared entry for ``proximal ppo|sft|rm --config FILE [--section.key value ...] [--resume DIR]``.

    ``run(cfg, resume_dir=None)`` is called with the loaded, validated config. Config errors are
    printed as one message and exit with status 2 before any model is loaded.
    """
    from proximal.config import ConfigError, help_text, load_config, parse_overrides

    parser = argparse.ArgumentParser(prog=f"proximal {prog}", description=description,
                                     epilog=help_text(config_cls),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file with the run's config sections")
    if resumable:
        parser.add_argument("--resume", metavar="RUN_DIR",
                            help="continue the run in RUN_DIR from its last checkpoint (its config.yaml is used)")
    args, rest = parser.parse_known_args(argv)
    try:
        overrides = parse_overrides(rest)
        resume_dir = getattr(args, "resume", None)
        config_path = args.config
        if resume_dir is not None:
            from pathlib import Path
            saved = Path(resume_dir) / "config.yaml"
            if not saved.is_file():
                raise ConfigError(f"--resume {resume_dir}: no config.yaml there; is it a run directory?")
            config_path = config_path or saved
        cfg = load_config(config_cls, config_path, overrides)
    except ConfigError as e:
        print(f"proximal {prog}: {e}", file=sys.stderr)
        return 2
    return int(run(cfg, resume_dir=resume_dir) or 0) if resumable else int(run(cfg) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
