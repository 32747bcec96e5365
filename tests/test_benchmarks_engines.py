"""benchmarks/engines.py's summaries (issue 41): the per-round ratios and the crossover rule, on
hand-written rounds. No engine runs here (the harness itself: tests/rollout/test_vllm_benchmark.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import engines  # noqa: E402


def _res(size: str, rounds: dict[tuple[int, str, int], float]) -> dict:
    return {
        "shape": {"name": size},
        "runs": [
            {"round": k, "engine": e, "batch": b, "tokens_per_s": v, "loadavg_before": 1.0}
            for (k, e, b), v in rounds.items()
        ],
    }


def test_vllm_over_hf_is_the_median_of_per_round_ratios():
    res = _res(
        "small",
        {
            (1, "hf", 4): 100.0,
            (1, "vllm", 4): 50.0,  # 0.5
            (2, "hf", 4): 200.0,
            (2, "vllm", 4): 300.0,  # 1.5
            (3, "hf", 4): 50.0,
            (3, "vllm", 4): 40.0,  # 0.8
        },
    )
    (row,) = engines.summarize_gen(res)
    assert row["ratios"] == [0.5, 1.5, 0.8]
    assert row["ratio"] == 0.8  # not 150 / 100 = 1.5, the ratio of the medians
    assert (row["hf_tokens_per_s"], row["vllm_tokens_per_s"]) == (100.0, 50.0)


def test_crossover_is_the_smallest_batch_from_which_vllm_wins_at_every_larger_one():
    table = [
        {"size": "a", "batch": 4, "ratio": 0.5},
        {"size": "a", "batch": 16, "ratio": 1.2},
        {"size": "a", "batch": 64, "ratio": 2.0},
        {"size": "b", "batch": 4, "ratio": 1.1},  # wins at 4, loses at 16: no crossover from 4
        {"size": "b", "batch": 16, "ratio": 0.9},
        {"size": "b", "batch": 64, "ratio": 1.3},
        {"size": "c", "batch": 64, "ratio": 0.7},
        {"size": "c", "batch": 4, "ratio": 0.2},
    ]
    assert engines.crossover(table, ["a", "b", "c"]) == {"a": 16, "b": 64, "c": None}


def _meta(commit: str, threads: int = 1, torch: str = "2.13.0") -> dict:
    return {
        "machine": {"cpu": "x"},
        "threads": threads,
        "versions": {"proximal": commit, "torch": torch},
        "cpu_detail": "family 1 model 2, avx2",
    }


def test_merge_takes_each_part_from_the_last_invocation_that_measured_it():
    first = {"meta": _meta("aaa"), "gen": "g1", "gen_table": "t1", "crossover": "c1", "steps": "s1"}
    rerun = {"meta": _meta("bbb"), "steps": "s2"}
    out = engines.merge([first, rerun])
    assert (out["gen"], out["gen_table"], out["crossover"], out["steps"]) == (
        "g1",
        "t1",
        "c1",
        "s2",
    )
    assert [(m["versions"]["proximal"], m["parts"]) for m in out["meta"]["merged"]] == [
        ("aaa", ["gen", "steps"]),
        ("bbb", ["steps"]),
    ]


def test_merge_refuses_results_of_other_packages_or_threads():
    for other in (_meta("aaa", threads=2), _meta("aaa", torch="2.12.0")):
        with pytest.raises(SystemExit, match="differs"):
            engines.merge([{"meta": _meta("aaa")}, {"meta": other}])
