"""A failing reward function shows where it failed (issue 37, item 9): the CLI's one line ends with
the user's own frame — ``file:line in function``, the last traceback frame outside proximal (and
outside Python's libraries, when the user's code called one) — and ``PROXIMAL_TRACEBACK=1`` prints
the whole chain before it. The expected file and line are those of the module the test writes."""

from __future__ import annotations

import uuid

from ppo_support import command_main, prompt_texts
from test_reward_functions import _grpo_config

from proximal.data.jsonl import write_jsonl
from proximal.rollout.reward_functions import RewardFunctionError, call_reward_functions

#: The user's module: the KeyError is raised on line 4, the json error inside json, called on line 8.
MODULE = """import json

def lookup(prompts, completions, **kwargs):
    return [{}["x"]] * len(completions)


def parse(prompts, completions):
    return [json.loads("{")] * len(completions)
"""


def _user_module(tmp_path, monkeypatch) -> str:
    name = f"user_rewards_{uuid.uuid4().hex[:8]}"  # a fresh module name: nothing cached
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _failing_run(assets, tmp_path, name: str, capsys) -> tuple[int, str]:
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in prompt_texts(4)])
    cfg = _grpo_config(
        assets.policy("llama"),
        tmp_path / "p.jsonl",
        tmp_path / f"run_{uuid.uuid4().hex[:8]}",
        reward_functions=[f"{name}:lookup"],
    )
    rc = command_main("grpo", cfg)
    return rc, capsys.readouterr().err


def test_the_one_line_names_the_users_file_and_line(assets, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PROXIMAL_TRACEBACK", raising=False)
    name = _user_module(tmp_path, monkeypatch)
    rc, err = _failing_run(assets, tmp_path, name, capsys)
    assert rc == 2, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"proximal grpo: reward function '{name}:lookup' at step 1 raised KeyError: 'x' "
        f"({tmp_path / name}.py:4 in lookup)"
    )


def test_proximal_traceback_prints_the_whole_chain(assets, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PROXIMAL_TRACEBACK", "1")
    name = _user_module(tmp_path, monkeypatch)
    rc, err = _failing_run(assets, tmp_path, name, capsys)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert f'File "{tmp_path / name}.py", line 4, in lookup' in err  # the user's frame
    assert "The above exception was the direct cause of the following exception:" in err
    assert "proximal.rollout.reward_functions.RewardFunctionError: reward function" in err
    assert lines[-1] == (
        f"proximal grpo: reward function '{name}:lookup' at step 1 raised KeyError: 'x' "
        f"({tmp_path / name}.py:4 in lookup)"
    )


def test_a_library_that_raises_is_placed_at_the_users_call(tmp_path, monkeypatch):
    """json raises inside json's own module: the line is the user's call of it, not json's."""
    import importlib

    name = _user_module(tmp_path, monkeypatch)
    parse = importlib.import_module(name).parse
    values = {"prompts": ["p"], "completions": ["c"]}
    try:
        call_reward_functions({"parse": parse}, values, n=1, step=2)
    except RewardFunctionError as e:
        message = str(e)
    else:
        raise AssertionError("the function did not fail")
    assert message.startswith("reward function 'parse' at step 2 raised JSONDecodeError: ")
    assert message.endswith(f" ({tmp_path / name}.py:8 in parse)")
