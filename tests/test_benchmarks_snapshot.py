"""The comparison of two behaviour snapshots (``benchmarks/behaviour_snapshot.py``, issue 40) on
hand-built snapshots: nothing here runs a training run.

Equal snapshots pass; a float that differs in its last bit, a metric only one side has, other
weights or a run only one side has fail; a metric renamed by design passes with ``--renamed`` and
only with it; clock-bound metrics are compared by name only."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import behaviour_snapshot as bs  # noqa: E402


def _snapshot() -> dict:
    return {
        "format": 1,
        "commit": "0" * 40,
        "runs": {
            "ppo/single_turn": {
                "seconds": 1.0,
                "metrics": [
                    {"step": 1, "loss/policy": -0.25, "policy/clipfrac": 0.0, "time/wall_s": 0.5},
                    {"step": 2, "loss/policy": 0.1, "policy/clipfrac": 0.125, "time/wall_s": 1.1},
                ],
                "weights": {"policy": "a" * 64, "critic": "b" * 64},
            },
            "evaluate_policy/single_turn": {
                "seconds": 0.1,
                "metrics": [{"a": math.nan, "response": "ab", "eos": False}],
                "weights": {},
            },
        },
    }


def _row(rows, name):
    [result] = [r for n, r in rows if n == name]
    return result


def test_equal_snapshots_compare_equal():
    before, after = _snapshot(), _snapshot()
    after["runs"]["ppo/single_turn"]["metrics"][1]["time/wall_s"] = 9.9  # the clock: names only
    after["runs"]["ppo/single_turn"]["seconds"] = 7.0
    rows, ok = bs.compare(before, after)
    assert ok
    r = _row(rows, "ppo/single_turn")
    # step, loss/policy, policy/clipfrac on 2 lines; time/wall_s by name
    assert (r["equal"], r["clock"], r["differing"], r["weights_equal"]) == (6, 2, {}, True)
    assert _row(rows, "evaluate_policy/single_turn")["equal"] == 3  # NaN equals NaN


def test_a_float_one_ulp_apart_differs_with_its_difference():
    before, after = _snapshot(), _snapshot()
    x = before["runs"]["ppo/single_turn"]["metrics"][1]["loss/policy"]
    after["runs"]["ppo/single_turn"]["metrics"][1]["loss/policy"] = math.nextafter(x, 1.0)
    after["runs"]["ppo/single_turn"]["metrics"][0]["policy/clipfrac"] = -0.0  # 0.0 bitwise ≠ −0.0
    rows, ok = bs.compare(before, after)
    assert not ok
    r = _row(rows, "ppo/single_turn")
    assert r["differing"] == {"loss/policy": math.nextafter(x, 1.0) - x, "policy/clipfrac": 0.0}
    assert r["equal"] == 4 and r["weights_equal"] and not r["missing"] and not r["new"]
    table = bs.format_table(rows)
    assert "loss/policy (1.39e-17)" in table and "policy/clipfrac (0)" in table


def test_a_renamed_metric_passes_only_when_named():
    before, after = _snapshot(), _snapshot()
    for line in after["runs"]["ppo/single_turn"]["metrics"]:
        line["policy/clipfrac_low"] = line.pop("policy/clipfrac")
    rows, ok = bs.compare(before, after)
    assert not ok
    r = _row(rows, "ppo/single_turn")
    assert (r["missing"], r["new"]) == (["policy/clipfrac"], ["policy/clipfrac_low"])

    renamed = bs.parse_renamed("policy/clipfrac=policy/clipfrac_low, x/unused=x/other")
    rows, ok = bs.compare(before, after, renamed)
    assert ok
    r = _row(rows, "ppo/single_turn")
    assert (r["equal"], r["missing"], r["new"]) == (6, [], [])
    assert r["renamed"] == ["policy/clipfrac"]
    # a rename does not excuse a changed value
    after["runs"]["ppo/single_turn"]["metrics"][1]["policy/clipfrac_low"] = 0.25
    rows, ok = bs.compare(before, after, renamed)
    assert not ok and _row(rows, "ppo/single_turn")["differing"] == {"policy/clipfrac_low": 0.125}


def test_a_missing_metric_weights_run_or_line_fail():
    before = _snapshot()
    after = copy.deepcopy(before)
    del after["runs"]["ppo/single_turn"]["metrics"][0]["policy/clipfrac"]
    rows, ok = bs.compare(before, after)
    assert not ok and _row(rows, "ppo/single_turn")["missing"] == ["policy/clipfrac"]

    after = copy.deepcopy(before)
    after["runs"]["ppo/single_turn"]["weights"]["critic"] = "c" * 64
    rows, ok = bs.compare(before, after)
    assert not ok and not _row(rows, "ppo/single_turn")["weights_equal"]
    assert "| no |" in bs.format_table(rows)

    after = copy.deepcopy(before)
    after["runs"]["ppo/single_turn"]["metrics"].pop()
    rows, ok = bs.compare(before, after)
    assert not ok and _row(rows, "ppo/single_turn")["lines"] == (2, 1)

    after = copy.deepcopy(before)
    del after["runs"]["evaluate_policy/single_turn"]
    after["runs"]["grpo/new"] = before["runs"]["evaluate_policy/single_turn"]
    rows, ok = bs.compare(before, after)
    assert not ok
    assert _row(rows, "evaluate_policy/single_turn") == {"absent": "after", "ok": False}
    assert _row(rows, "grpo/new") == {"absent": "before", "ok": False}


def test_command_line_compare_exit_codes(tmp_path, capsys):
    before, after = _snapshot(), _snapshot()
    for line in after["runs"]["ppo/single_turn"]["metrics"]:
        line["policy/clipfrac_low"] = line.pop("policy/clipfrac")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(before))
    b.write_text(json.dumps(after))
    assert bs.main(["--compare", str(a), str(a)]) == 0
    assert bs.main(["--compare", str(a), str(b)]) == 1
    assert "DIFFERENT" in capsys.readouterr().out
    assert (
        bs.main(["--compare", str(a), str(b), "--renamed", "policy/clipfrac=policy/clipfrac_low"])
        == 0
    )
    with pytest.raises(SystemExit) as e:
        bs.main(["--compare", str(a), str(b), "--renamed", "policy/clipfrac"])
    assert e.value.code == 2
    assert "expected old=new" in capsys.readouterr().err
