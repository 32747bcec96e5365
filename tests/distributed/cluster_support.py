"""Helpers for the cluster tests (``test_cluster.py``): a reward function that can kill its own
process, and ``torchrun`` command lines.

The reward function is the test-only hook that makes "a worker killed mid-step" happen at a chosen
step: ``PROXIMAL_TEST_KILL`` = ``"RANK:STEP"`` makes the process of that global rank send itself
SIGKILL when it scores its STEP-th rollout (PPO scores each rollout once per step, so the STEP-th
call is step STEP) — but only in torchrun's first attempt (``TORCHELASTIC_RESTART_COUNT`` = 0), so
the restarted group runs through; ``PROXIMAL_TEST_KILL_MARK`` names a file it writes first. Without
the variable it is ``ppo_support.frac_a``, so the uninterrupted reference run uses the same config.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

from ppo_support import frac_a

HERE = Path(__file__).resolve().parent
KILL_VAR = "PROXIMAL_TEST_KILL"
MARK_VAR = "PROXIMAL_TEST_KILL_MARK"  # a file written just before the kill

_calls = 0


def frac_a_or_die(prompts: list[str], completions: list[str]) -> list[float]:
    """``frac_a``; SIGKILL of this very process at the step ``PROXIMAL_TEST_KILL`` names."""
    global _calls
    _calls += 1
    spec = os.environ.get(KILL_VAR)
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        rank, step = (int(x) for x in spec.split(":"))
        if int(os.environ.get("RANK", "0")) == rank and _calls == step:
            if os.environ.get(MARK_VAR):  # proof for the test that the kill happened, and when
                Path(os.environ[MARK_VAR]).write_text(f"rank {rank} killed at step {step}\n")
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: rollout sampled, nothing logged yet
    return frac_a(prompts, completions)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(**extra: str) -> dict[str, str]:
    """The environment of a torchrun launch: this folder and ``tests/trainers/ppo`` importable (the
    reward functions), one thread per process."""
    path = [str(HERE), str(HERE.parent / "trainers" / "ppo"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1", **extra}


def torchrun(*flags: str) -> list[str]:
    """``torchrun FLAGS -m proximal`` with this interpreter (the command's arguments go after)."""
    return [sys.executable, "-m", "torch.distributed.run", *flags, "-m", "proximal"]
