"""Tools and environments for the agent tests: importable by name, so worker processes load them
(this directory is on ``sys.path`` under pytest, and workers inherit the parent's path)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

#: A chat template that shows which tools a prompt is offered: their names after "7 ", then each
#: message as "8 <content> " (an assistant's "9 <content><eos>"), then "9 " for the generation
#: prompt (the tiny tokenizers' characters).
TOOLS_TEMPLATE = (
    "{% if tools %}7 {% for t in tools %}{{ t['function']['name'] ~ ' ' }}{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '9 ' ~ m['content'] ~ eos_token }}"  # EOS ends a turn
    "{% else %}{{ '8 ' ~ m['content'] ~ ' ' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}9 {% endif %}"
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def shout(text: str) -> str:
    """The text in capitals.

    Args:
        text: anything.
    """
    return text.upper()


def table(n: int) -> dict:
    """A non-text result: a dict.

    Args:
        n: a number.
    """
    return {"n": n, "square": n * n}


def fail(x: int) -> int:
    """Always raises.

    Args:
        x: ignored.
    """
    raise ValueError(f"no good: {x}")


def hang(x: int) -> int:
    """Never returns (sleeps for a minute).

    Args:
        x: ignored.
    """
    time.sleep(60)
    return x


class Echo:
    """The step form: each turn's observation is the fixed text ``reply`` (in the tiny alphabet),
    with reward 0.5 per turn; done after ``turns`` turns; outcome reward = the number of steps."""

    reply = "ab"

    def reset(self, turns: int = 3, **row):
        self.left = int(turns)
        self.steps = 0
        return None

    def step(self, text: str):
        self.steps += 1
        self.left -= 1
        return self.reply, 0.5, self.left <= 0

    def get_reward(self) -> float:
        return float(self.steps)


class OneTurn:
    """The step form, done after the first turn with no reward: a single-turn rollout."""

    def reset(self, **row):
        return None

    def step(self, text: str):
        return None, 0.0, True


class Counter:
    """The tool form: one tool, a counter, and the outcome reward = how often it was called."""

    def reset(self, **row):
        self.calls = 0

    def bump(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much.
        """
        self.calls += 1
        return self.calls * by

    def stall(self, x: int) -> int:
        """Never returns.

        Args:
            x: ignored.
        """
        time.sleep(60)
        return x

    def get_reward(self) -> float:
        return float(self.calls)


class Greeter:
    """``reset`` gives a first observation (appended to the prompt); done after one turn."""

    def reset(self, **row):
        return "ab"

    def step(self, text: str):
        return None, 0.0, True


def frac_a_text(text: str) -> float:
    """``ppo_support.frac_a`` of a turn's text as the reward functions see it (special tokens left
    out: a random tiny policy samples ``<pad>`` and ``<unk>`` too)."""
    for special in ("<pad>", "<bos>", "<unk>", "<eos>"):
        text = text.replace(special, "")
    return text.count("a") / max(1, len(text))


class FracA:
    """A one-turn environment that scores its turn as the ``ppo_support:frac_a`` verifier would."""

    def reset(self, **row):
        self.text = ""

    def step(self, text: str):
        self.text = text
        return None, 0.0, True

    def get_reward(self) -> float:
        return frac_a_text(self.text)


class Talk:
    """The step form over ``turns`` turns (a row column, default 2): the reply "ab", a per-turn
    reward of 0.1·(the turn's 'a' count); outcome = frac_a of the last turn."""

    def reset(self, turns: int = 2, **row):
        self.left, self.last = int(turns), ""

    def step(self, text: str):
        self.left -= 1
        self.last = text
        return "ab", 0.1 * text.count("a"), self.left <= 0

    def get_reward(self) -> float:
        return frac_a_text(self.last)


def spawn(pid_file: str, hang: bool = True) -> int:
    """Start a child process (``sleep 1234``), write its pid to ``pid_file``, then hang (or return).

    Args:
        pid_file: where the child's pid goes.
        hang: never return.
    """
    child = subprocess.Popen(["sleep", "1234"])
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(child.pid))
    os.replace(pid_file + ".tmp", pid_file)
    if hang:
        time.sleep(60)
    return child.pid


def chatty(n: int) -> int:
    """Print ``n`` bytes to stdout and to stderr, return n.

    Args:
        n: how many.
    """
    print("o" * n, end="", flush=True)
    print("e" * n, end="", file=sys.stderr, flush=True)
    return n


def long_result(n: int) -> str:
    """A result of ``n`` characters.

    Args:
        n: its length.
    """
    return "x" * n


def nodoc(x: int) -> int:
    return x


NOT_CALLABLE = 3


class NoDocTool:
    """The tool form with a method that has no docstring (no schema can be made)."""

    def reset(self, **row):
        pass

    def poke(self, x: int) -> int:
        return x


class Crashy:
    """The step form over ``turns`` turns (a row column, default 1), outcome reward 1.0 — except
    a row with ``crash`` set: at turn ``crash_at`` (default 1) its step kills its worker process
    (``crash: exit``) or hangs (``crash: hang``)."""

    def reset(self, turns: int = 1, crash: str | None = None, crash_at: int = 1, **row):
        self.left, self.crash, self.crash_at, self.turn = int(turns), crash, int(crash_at), 0

    def step(self, text: str):
        self.turn += 1
        if self.crash and self.turn == self.crash_at:
            if self.crash == "exit":
                os._exit(3)
            time.sleep(60)
        self.left -= 1
        return "ab", 0.0, self.left <= 0

    def get_reward(self) -> float:
        return 1.0


class BadReset:
    """An environment whose reset raises."""

    def reset(self, **row):
        raise KeyError("answer")

    def step(self, text: str):
        return None, 0.0, True


class AlwaysOne:
    """One turn, outcome reward 1.0 — but a turn holding the row's ``crash_if`` character kills
    its worker process: a planted crash that depends on what the policy sampled."""

    def reset(self, crash_if: str = "", **row):
        self.crash_if = crash_if

    def step(self, text: str):
        if self.crash_if and self.crash_if in text:
            os._exit(3)
        return None, 0.0, True

    def get_reward(self) -> float:
        return 1.0
