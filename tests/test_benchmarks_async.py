"""benchmarks/async.py (issue 43): the phase seconds read from a run's metrics, the ratios to the
synchronous baseline and the bounds, on hand-written metrics; and its smoke mode end to end. A
benchmark is not a test: nothing here asserts a time."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

# ``async`` is a keyword: the script is loaded by its path
_spec = importlib.util.spec_from_file_location("async_bench", BENCH / "async.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_phases_are_read_per_step_and_their_medians_leave_out_the_warm_steps():
    rows = [
        # 8 rows × 4 tokens at 16 tokens/s: 2 s of generation
        {"time/wall_s": 10.0, "time/step_s": 9.0, "time/wait_s": 8.0,
         "response/length_mean": 4.0, "speed/gen_tokens_per_s": 16.0, "rollout/staleness": 0},
        {"time/wall_s": 13.0, "time/step_s": 2.5, "time/wait_s": 0.5,
         "response/length_mean": 4.0, "speed/gen_tokens_per_s": 32.0, "rollout/staleness": 1},
        {"time/wall_s": 15.0, "time/step_s": 1.75, "time/wait_s": 0.25,
         "response/length_mean": 4.0, "speed/gen_tokens_per_s": 16.0, "rollout/staleness": 1},
        {"time/wall_s": 19.0, "time/step_s": 3.5, "time/wait_s": 1.0,
         "response/length_mean": 4.0, "speed/gen_tokens_per_s": 10.0, "rollout/staleness": 1},
    ]  # fmt: skip
    p = bench.phases(rows, rows_per_step=8, warm=1)
    assert p["period_s"] == [10.0, 3.0, 2.0, 4.0]  # wall-clock differences; step 1 from the start
    assert p["gen_s"] == [2.0, 1.0, 2.0, 3.2]
    assert p["busy_s"] == [1.0, 2.0, 1.5, 2.5]
    assert p["staleness"] == [0, 1, 1, 1]
    # steps 2..4 only
    assert (p["median_period_s"], p["median_gen_s"], p["median_busy_s"]) == (3.0, 2.0, 2.0)
    assert p["median_wait_s"] == 0.5
    assert p["gen_share"] == 3.2 / 3.5  # per step 1/2.5, 2/1.75, 3.2/3.5: the middle one
    assert p["wait_share"] == 0.5 / 3.0  # 0.5/3, 0.25/2, 1/4: the middle one


def test_wait_share_is_the_median_of_wait_over_period():
    rows = [
        {"time/wall_s": 3.0, "time/step_s": 3.0, "time/wait_s": 0.5,
         "response/length_mean": 2.0, "speed/gen_tokens_per_s": 4.0},
        {"time/wall_s": 5.0, "time/step_s": 2.0, "time/wait_s": 1.0,
         "response/length_mean": 2.0, "speed/gen_tokens_per_s": 4.0},
        {"time/wall_s": 9.0, "time/step_s": 4.0, "time/wait_s": 3.0,
         "response/length_mean": 2.0, "speed/gen_tokens_per_s": 4.0},
    ]  # fmt: skip
    p = bench.phases(rows, rows_per_step=2, warm=0)
    assert p["wait_share"] == 0.5  # 0.5/3, 1/2, 3/4: the middle one
    assert p["staleness"] == [0, 0, 0]  # a synchronous run logs none


def test_at_staleness_k_the_last_k_steps_are_kept_apart_from_the_steady_ones():
    def row(wall, step, wait):
        return {"time/wall_s": wall, "time/step_s": step, "time/wait_s": wait,
                "response/length_mean": 1.0, "speed/gen_tokens_per_s": 1.0}  # fmt: skip

    # steps 1..6: a first wait, then steady steps of 2 s, then the last two (k = 2) with the
    # generator idle and the trainer faster
    rows = [row(5.0, 5.0, 4.0), row(7.0, 2.0, 0.0), row(9.0, 2.0, 0.5), row(11.0, 2.0, 0.25)]
    rows += [row(12.0, 1.0, 0.0), row(12.75, 0.75, 0.0)]
    p = bench.phases(rows, rows_per_step=1, warm=1, staleness=2)
    assert p["steady_steps"] == [2, 3, 4]
    assert p["median_period_s"] == 2.0 and p["median_busy_s"] == 1.75  # 2, 1.5, 1.75
    assert p["solo_busy_s"] == 0.875  # steps 5 and 6: 1.0 and 0.75
    assert bench.phases(rows, 1, warm=1)["median_busy_s"] == 1.5  # k = 0: steps 2..6
    # too few steps for a steady part: all of them
    assert bench.phases(rows[:3], 1, warm=1, staleness=2)["steady_steps"] == [1, 2, 3]


def _run(case: str, k: int, period: float, *, gen=1.0, busy=1.0, wait=0.0, step=None, rc=0):
    r = {"work": "tiny", "method": "grpo", "case": case, "round": k, "rc": rc}
    if rc:
        return r
    return r | {
        "median_period_s": period,
        "median_step_s": period if step is None else step,
        "median_gen_s": gen,
        "median_busy_s": busy,
        "median_wait_s": wait,
        "gen_share": gen / (period if step is None else step),
        "wait_share": wait / period,
        "solo_busy_s": None,
        "loadavg_before": 0.5,
    }


def test_ratios_are_per_round_and_the_bounds_follow_the_phase_shares():
    runs = [
        _run("sync-2t", 1, 2.0, gen=0.5),  # g = 0.25
        _run("k1", 1, 1.0, gen=0.75, busy=1.25, wait=0.125),  # ratio 0.5
        _run("sync-2t", 2, 4.0, gen=1.2),  # g = 0.3
        _run("k1", 2, 3.5, gen=0.8, busy=1.5, wait=0.25),  # 0.875
        _run("sync-2t", 3, 8.0, gen=1.6),  # g = 0.2
        _run("k1", 3, 6.0, gen=0.5, busy=1.0, wait=0.5),  # 0.75
        _run("k2", 3, 2.0),  # 0.25
        _run("k2", 1, 9.0, rc=1),  # failed: no ratio
    ]
    rows = {r["case"]: r for r in bench.summarize(runs)}
    assert rows["k1"]["ratios"] == [0.5, 0.875, 0.75]
    assert rows["k1"]["ratio"] == 0.75  # not the ratio of the medians, 3.5 / 4.0
    assert rows["k1"]["period_s"] == 3.5 and rows["k1"]["wait_s"] == 0.25
    assert rows["k2"]["ratios"] == [0.25] and rows["k2"]["rounds"] == 1
    s = rows["sync-2t"]
    assert s["ratio"] == 1.0 and s["period_s"] == 4.0
    assert s["gen_share"] == 0.25 and s["gpu_bound"] == 1.0 / 0.75  # 1 / max(g, 1 − g)
    # this CPU's bound: sync-2t's median period over max(median gen, median busy) of k1
    assert rows["k1"]["overlap_s"] == 1.25 and rows["k1"]["cpu_bound"] == 4.0 / 1.25
    assert "sync-1t" not in rows


def test_the_gpu_bound_is_two_at_an_even_split_and_falls_to_one_at_either_end():
    def bound(g):
        (row,) = bench.summarize([_run("sync-2t", 1, 1.0, gen=g)])
        return row["gpu_bound"]

    assert bound(0.5) == 2.0
    assert bound(0.9) == pytest.approx(1 / 0.9, rel=1e-12)
    assert bound(0.1) == pytest.approx(1 / 0.9, rel=1e-12)


def test_results_keep_the_learning_section_written_after_the_mark(tmp_path):
    out = tmp_path / "r.md"
    data = {
        "meta": {
            "date": "d",
            "command": "c",
            "rounds": 1,
            "steps": 3,
            "warm": 1,
            "ppo_epochs": 1,
            "versions": {"proximal": "abc", "torch": "2"},
            "machine": {"cpu": "x", "cores": 2},
            "loadavg_start": [0.1, 0.1, 0.1],
            "loadavg_end": [0.2, 0.2, 0.2],
            "wall_s": 1.0,
        },
        "runs": [_run("sync-2t", 1, 2.0)],
    }
    data["summary"] = bench.summarize(data["runs"])
    out.write_text(f"old\n{bench.APPENDIX_MARK}\n## Learning\n\n| a |\n")
    bench.write_results(out, data)
    text = out.read_text()
    assert "old" not in text.split(bench.APPENDIX_MARK)[0]
    assert text.endswith(f"{bench.APPENDIX_MARK}\n## Learning\n\n| a |\n")
    assert "| tiny | grpo | sync-2t | 2 |" in text
    assert "appendix" not in json.loads(out.with_suffix(".json").read_text())


@pytest.mark.slow
def test_async_smoke_mode_runs_the_synchronous_and_the_staleness_one_loop(tmp_path):
    """CI's run of the harness: the mini work, GRPO at staleness 0 and 1, 3 steps."""
    out = tmp_path / "a.md"
    r = subprocess.run(
        [
            sys.executable,
            str(BENCH / "async.py"),
            "--smoke",
            "--workdir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(ROOT),
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["smoke"] is True
    sync, k1 = data["runs"]
    assert (sync["case"], k1["case"]) == ("sync-2t", "k1")
    assert sync["staleness"] == [0, 0, 0] and k1["staleness"] == [0, 1, 1]
    assert sync["wait_s"] == [0.0, 0.0, 0.0]  # the synchronous loop never waits for a generator
    assert all(w >= 0 for w in k1["wait_s"]) and len(k1["period_s"]) == 3
    assert sync["length_mean"] == k1["length_mean"] == [8.0] * 3  # exactly R tokens
    cases = [row["case"] for row in data["summary"]]
    assert cases == ["sync-2t", "k1"] and "gpu_bound" in data["summary"][0]
    assert "| mini | grpo | k1 |" in out.read_text()


def _compare_run(root: Path, name: str, seed: int, staleness: int, correction, gold, exact):
    run = root / "runs" / f"{name}-seed{seed}"
    run.mkdir(parents=True)
    (run / "compare_run.json").write_text(
        json.dumps({"method": "grpo", "seed": seed, "status": "ok"})
    )
    (run / "eval.json").write_text(
        json.dumps({"final": {"mean": {"gold": gold, "verifier": exact, "kl": 1.0}}})
    )
    (run / "config.yaml").write_text(
        f"rollout:\n  staleness: {staleness}\n  correction: {correction}\n"
    )
    rows = [
        {"time/step_s": 1.0, "time/wall_s": 1.0, "rollout/mismatch_k3": 0.25,
         "rollout/correction_truncated_frac": 0.0, "rollout/staleness": 0},
        {"time/step_s": 1.0, "time/wall_s": 2.0, "rollout/mismatch_k3": 0.75,
         "rollout/correction_truncated_frac": 0.5, "rollout/staleness": staleness},
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_learning_table_is_mean_and_sample_std_over_seeds_per_staleness_and_correction(
    tmp_path,
):
    k0, k1, k1off = tmp_path / "k0", tmp_path / "k1", tmp_path / "k1-off"
    for seed, gold in enumerate([0.5, 0.75]):
        _compare_run(k0, "grpo@verifier", seed, 0, "null", gold, 0.25)
    for seed, gold in enumerate([0.25, 0.5, 0.75]):
        _compare_run(k1, "grpo@verifier", seed, 1, "null", gold, 0.5)
        _compare_run(k1off, "grpo@verifier", seed, 1, "'off'", gold / 2, 0.5)
    (k0 / "runs" / "grpo@verifier-seed9").mkdir()  # running: no compare_run.json yet, left out
    (k0 / "sft_eval.json").write_text(json.dumps({"mean": {"gold": 0.125, "verifier": 0.0625}}))
    runs = bench.learning_runs(k0, "digits") + bench.learning_runs(k1, "digits")
    runs += bench.learning_runs(k1off, "digits")
    modes = {(r["staleness"], r["correction"], r["mode"]) for r in runs}
    assert modes == {(0, "default", "none"), (1, "default", "tis"), (1, "off", "none")}
    assert {r["mismatch_k3"] for r in runs} == {0.5} and runs[-1]["staleness_logged"] == 1
    out = tmp_path / "r.md"
    out.write_text("speed tables\n")
    bench.write_learning(out, [f"digits={k0},{k1},{k1off}"], "a note")
    text = out.read_text()
    assert text.startswith("speed tables\n\n" + bench.APPENDIX_MARK)
    assert "| digits | grpo | 0 | default (none) | 0,1 | 0.625 ± 0.177 | 0.250 ± 0.000 |" in text
    assert "| digits | grpo | 1 | default (tis) | 0,1,2 | 0.500 ± 0.250 | 0.500 ± 0.000 |" in text
    assert "| 0.500 ± 0.000 | -0.250 -0.250 |" in text  # paired with staleness 0's seeds 0 and 1
    assert "| digits | grpo | 1 | off (none) | 0,1,2 | 0.250 ± 0.125 |" in text
    assert "gold 0.125, exact match 0.062" in text
    bench.write_learning(out, [f"digits={k0}"], "")  # written again: the section replaced
    assert out.read_text().count(bench.APPENDIX_MARK) == 1 and "(tis)" not in out.read_text()
