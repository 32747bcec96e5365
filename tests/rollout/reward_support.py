"""Reward functions for the tests of reward functions that see the data (issue 24), named in configs
as ``reward_support:<name>`` (this folder is on the import path: pytest puts it there for its tests,
and the subprocess runs get it through ``PYTHONPATH``).

``record_answer`` appends what it was given to ``$PROXIMAL_TEST_RECORD/rank<R>.jsonl``, so a test can
check it against the prompt rows after a run (several processes included: each rank its own file).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

ENV = "PROXIMAL_TEST_RECORD"


def answer_of(prompt: str) -> str:
    """The reference answer a test writes beside each prompt: the prompt reversed, in brackets — one to
    one, so a row given another prompt's answer shows."""
    return f"<{prompt[::-1]}>"


def record_answer(prompts, completions, answer, completion_ids, step, trainer_state, **kwargs):
    """TRL's signature with a column by name: records its arguments, scores 1 when the completion holds
    the prompt's last character (so scores vary)."""
    record = {
        "pid": os.getpid(),
        "prompts": prompts,
        "completions": completions,
        "answer": answer,
        "completion_ids": completion_ids,
        "step": step,
        "global_step": trainer_state.global_step,
        "other": sorted(kwargs),
    }
    path = Path(os.environ[ENV]) / f"rank{os.environ.get('RANK', '0')}.jsonl"
    with path.open("a") as fh:
        fh.write(json.dumps(record) + "\n")
    return [float(a[1] in c) for a, c in zip(answer, completions)]


def sleep_at_step_2(prompts, completions, **kwargs):
    """A verifier that hangs at step 2: it notes when it started, then sleeps far past any limit."""
    if kwargs["step"] == 2:
        (Path(os.environ[ENV]) / "hang_started").write_text(repr(time.time()))
        time.sleep(120)
    return [0.0 for _ in completions]


def math_reward(prompts, completions, task, **kwargs):
    """TRL's multi-task pattern: scores the ``task: math`` rows (1 when the completion holds an 'a'),
    None on the others — it does not apply to them."""
    return [float("a" in c) if t == "math" else None for c, t in zip(completions, task)]


def code_reward(prompts, completions, task, **kwargs):
    """The other task's function: scores the ``task: code`` rows (the completion's length), None on
    the math rows."""
    return [float(len(c)) if t == "code" else None for c, t in zip(completions, task)]
