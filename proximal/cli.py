"""The ``proximal`` command line.

``proximal <command> ...``; each command lives in its own module, named in the one table of
commands (:mod:`proximal.commands`), and is imported only when used, so ``proximal --help`` stays
instant. Training commands share one shape::

    proximal ppo --config run.yaml [--section.key value ...]
    proximal ppo --resume RUN_DIR
    torchrun --nproc_per_node 8 -m proximal ppo --config run.yaml      (several processes)
"""

from __future__ import annotations

import sys

from proximal import __version__
from proximal.commands import COMMANDS, load  # names only: --help stays instant
from proximal.train.host import tune_allocator  # the standard library only: --help stays instant


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"proximal {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"proximal: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    _quiet_transformers()
    if "-h" not in rest and "--help" not in rest:
        tune_allocator()
    return int(load(COMMANDS[name].entry)(rest) or 0)


def entry() -> None:
    """The ``proximal`` console script: :func:`main`, then exit — under torchrun through
    :func:`proximal.dist.shutdown_and_exit`, which leaves the process group cleanly."""
    code = main()
    from proximal import dist  # lazy: torch, which `proximal --help` never loads

    if dist.is_distributed():
        dist.shutdown_and_exit(code)
    sys.exit(code)


def _quiet_transformers() -> None:
    """Our own progress bars say what is happening; the per-file loading bars of transformers are noise."""
    try:
        # lazy: `proximal --help` stays instant
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _usage() -> str:
    lines = ["usage: proximal <command> [options]", "", "commands:"]
    lines += [f"  {n:<8} {c.summary}" for n, c in COMMANDS.items()]
    lines += ["", "Run `proximal <command> --help` for a command's options and config fields."]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    entry()
