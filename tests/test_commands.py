"""One table of commands (proximal/commands.py), read by the command line, the Python API, the
methods of the comparison and the demo, the memory planner and the TRL-names table: each reads its
commands from it, so a command added there is seen by all of them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import proximal
from proximal import api, cli, commands
from proximal.commands import COMMANDS, TRAINING, config_class, trainer
from proximal.memory import METHODS as PLANNED
from proximal.memory.runconfig import COMMAND_OF
from proximal.methods import METHODS
from proximal.train import trl_names

ROOT = Path(__file__).resolve().parents[1]


def test_the_training_commands_are_the_seven_methods_commands():
    assert TRAINING == ("ppo", "grpo", "sft", "rm", "dpo", "simpo", "distill")
    assert [n for n, c in COMMANDS.items() if c.online] == ["ppo", "grpo", "distill"]


def test_the_command_line_runs_and_lists_the_tables_commands(capsys):
    assert cli.COMMANDS is COMMANDS
    assert cli.main(["--help"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line[:2] == "  "]
    assert listed == list(COMMANDS)


@pytest.mark.parametrize("command", TRAINING)
def test_each_training_command_has_its_api_function_config_and_trainer(command):
    cls, train = config_class(command), trainer(command)
    assert cls.__name__ == commands.COMMANDS[command].config.split(":")[1]
    assert getattr(proximal, cls.__name__) is cls  # the package lends the same class
    assert callable(train) and callable(getattr(api, f"train_{command}"))
    assert command in trl_names.COMMANDS


def test_a_command_without_a_config_is_not_a_training_command():
    with pytest.raises(KeyError, match="'demo' is not a training command"):
        config_class("demo")


def test_every_method_and_every_planned_method_is_trained_by_a_command_of_the_table():
    assert {m.command for m in METHODS.values()} <= set(TRAINING)
    assert set(COMMAND_OF) == set(PLANNED)
    # every training command is planned, distill with its teacher (issue 44)
    assert set(COMMAND_OF.values()) == set(TRAINING)
    assert set(trl_names.COMMANDS) == set(TRAINING)


def test_help_loads_no_torch():
    code = (
        "import sys\n"
        "from proximal.cli import main\n"
        "assert main(['--help']) == 0\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert heavy == [], heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
