"""``compare_trl.py --baseline REF`` (issue 27): proximal at another commit runs third in each round,
from its own checkout, and the results gain its columns. Synthetic runs and a throw-away repository:
nothing here runs a benchmark work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import compare_trl  # noqa: E402
from harness import mfu, report, sides  # noqa: E402
from test_benchmarks_mfu import synthetic_measured  # noqa: E402

MEASURED = synthetic_measured()  # 200 GFLOP a step on a 400 GFLOP/s peak
RSS = {"proximal": 100.0, "trl": 400.0, "baseline": 200.0}


def _run(side, k, step, rc=0, mfu_=None, busy=0.1):
    r = {"work": "tiny", "side": side, "round": k, "rc": rc, "cpu_busy_before": busy}
    r |= {"median_step_s": step, "wall_s": 10 * step, "peak_rss_mib": RSS[side]}
    r |= {"loadavg_before": [0.5, 0.5, 0.5]}
    return r | ({"median_mfu": mfu_} if mfu_ is not None else {})


def _runs(with_baseline=True):
    """Four rounds of proximal, TRL, baseline; round 3's baseline and round 4's TRL fail."""
    rounds = [
        (1, 1.0, 4.0, 2.0, 0),
        (2, 1.5, 3.0, 2.5, 0),
        (3, 1.2, 4.0, 9.0, 1),
        (4, 1.0, 0.5, 2.0, 0),
    ]
    mfus = {1: 0.01, 2: 0.03, 3: 0.5, 4: 0.02}
    runs = []
    for k, p, t, b, b_rc in rounds:
        runs.append(_run("proximal", k, p))
        runs.append(_run("trl", k, t, rc=1 if k == 4 else 0))
        if with_baseline:
            runs.append(_run("baseline", k, b, rc=b_rc, mfu_=mfus[k], busy=0.9 if k == 2 else 0.1))
    return runs


def _meta(baseline: dict | None) -> dict:
    meta = {
        "date": "2025-01-01T00:00:00+00:00",
        "command": "python benchmarks/compare_trl.py",
        "rounds": 4,
        "rounds_of": {"tiny": 4},
        "steps": None,
        "steps_of": {"tiny": 10},
        "threads": 2,
        "machine": {
            "cpu": "Some CPU",
            "cores": 2,
            "memory": "8 GB",
            "amx_bf16": False,
            "avx512_bf16": False,
            "os": "Linux",
        },
        "proximal": {"commit": "bbbbbbb", "torch": "2.x", "transformers": "5.x"},
        "anchors": {},
        "skipped": {"grpo": "not run"},
        "mfu": MEASURED,
    }
    return meta | ({"baseline": baseline} if baseline else {})


BASE = {
    "ref": "HEAD~1",
    "sha": "a" * 40,
    "commit": "aaaaaaa",
    "tree": "/w/baseline-aaaaaaaaaaaa",
    "proximal_file": "/w/baseline-aaaaaaaaaaaa/proximal/__init__.py",
    "new_commit": "bbbbbbb",
    "new_proximal_file": "/repo/proximal/__init__.py",
}


def test_baseline_summary_ratios_are_per_round_and_failed_runs_drop_their_round():
    runs = _runs()
    s = report.summarize(runs, ["tiny"])["tiny"]
    # proximal / TRL is what it is without the baseline: 1/4, 1.5/3, 1.2/4 (round 4's TRL failed)
    assert s["ratio_median_step_s_all"] == [0.25, 0.5, 0.3]
    assert s["ratio_median_step_s"] == 0.3
    assert s["anchor_median_step_s"] == 4.0  # 4, 3, 4: the baseline is not taken for the anchor
    assert s["proximal_median_step_s"] == pytest.approx(1.1, rel=1e-12)  # 1, 1.5, 1.2, 1
    # baseline / TRL: 2/4 and 2.5/3; round 3's baseline and round 4's TRL failed
    assert s["baseline_ratio_median_step_s_all"] == pytest.approx([0.5, 2.5 / 3], rel=1e-12)
    assert s["baseline_ratio_median_step_s"] == pytest.approx((0.5 + 2.5 / 3) / 2, rel=1e-12)
    # new / baseline: 1/2, 1.5/2.5, 1/2 (round 3's baseline failed)
    assert s["new_over_baseline_median_step_s_all"] == pytest.approx([0.5, 0.6, 0.5], rel=1e-12)
    assert s["new_over_baseline_median_step_s"] == 0.5
    assert s["baseline_median_step_s"] == 2.0  # 2, 2.5, 2 (the failed 9 left out)
    assert s["baseline_wall_s"] == 20.0
    assert s["baseline_ratio_peak_rss_mib_all"] == [0.5, 0.5]  # 200 / 400
    assert s["new_over_baseline_peak_rss_mib_all"] == [0.5, 0.5, 0.5]  # 100 / 200
    assert s["baseline_median_mfu"] == 0.02  # 0.01, 0.03, 0.02 (the failed run's 0.5 left out)
    assert s["failed_runs"] == 2  # round 4's TRL and round 3's baseline
    assert s["max_cpu_busy_before"] == 0.9  # round 2's baseline

    mfu.annotate(runs, {"tiny": s}, MEASURED)
    report.annotate_baseline({"tiny": s}, MEASURED)
    assert s["baseline_mfu_probe"] == pytest.approx(200e9 / 2.0 / 400e9, rel=1e-12)  # 0.25
    assert s["proximal_mfu_probe"] == pytest.approx(200e9 / 1.1 / 400e9, rel=1e-12)


def test_results_md_and_json_gain_the_baseline_columns(tmp_path):
    runs = _runs()
    summary = report.summarize(runs, ["tiny"])
    mfu.annotate(runs, summary, MEASURED)
    report.annotate_baseline(summary, MEASURED)
    out = tmp_path / "results.md"
    report.write(out, {"meta": _meta(BASE), "summary": summary, "runs": runs}, "Notes.")
    lines = out.read_text().splitlines()

    header = next(ln for ln in lines if ln.startswith("| work | rounds |"))
    assert header.endswith(
        "| RSS target | met | s/step baseline | ratio baseline/TRL | per-round ratios "
        "| new/baseline | per-round ratios |"
    )
    assert lines[lines.index(header) + 1] == "|" + "---|" * 21
    row = lines[lines.index(header) + 2]
    cells = row.strip("| ").split(" | ")
    assert len(cells) == 21
    # proximal's column stays where it was; every MFU is on the invocation's one probed peak
    # (200 GFLOP / 1.1 s / 400 GFLOP/s, 200 / 2 / 400), not the runs' own perf/mfu (0.02 here)
    assert cells[2] == "1.1 (MFU 45 %)"
    assert cells[16:] == ["2 (MFU 25 %)", "0.667", "0.500 0.833", "0.5", "0.500 0.600 0.500"]
    skipped = next(ln for ln in lines if ln.startswith("| grpo | skipped"))
    assert skipped.count("|") == 22  # as many columns as the header
    assert (
        "- baseline (`--baseline HEAD~1`): commit aaaaaaa, run third in each round (proximal, TRL, "
        "baseline) from a checkout at `/w/baseline-aaaaaaaaaaaa` with the same Python, configs and "
        "threads; its proximal imported from `/w/baseline-aaaaaaaaaaaa/proximal/__init__.py`, this "
        "tree's from `/repo/proximal/__init__.py`."
    ) in lines
    # every run is listed, the baseline's as their own side (no log-probs path recorded: "—")
    every, section = (
        lines.index("## Every run"),
        lines.index("## Model FLOP utilisation (issue 27)"),
    )
    per_run = [ln for ln in lines[every:section] if ln.startswith("| tiny | ")]
    assert [ln.split(" | ")[2] for ln in per_run] == ["proximal", "trl", "baseline"] * 4
    baseline_rows = [ln for ln in per_run if ln.split(" | ")[2] == "baseline"]
    assert (
        baseline_rows[0]
        == "| tiny | 1 | baseline | 2 (MFU 25 %) | 20 | 200 | 0.1 | 0.50 0.50 0.50 | — |  |"
    )
    assert all(ln.split(" | ")[8] == "—" for ln in baseline_rows)
    # the MFU section: the same FLOPs and peak over the baseline's step, beside this tree's
    i = lines.index(
        "| work | s/step baseline | MFU baseline | s/step proximal | MFU proximal | new/baseline |"
    )
    assert lines[i - 2] == (
        "The baseline, proximal at commit aaaaaaa, on the same FLOPs a step and the same probed peak:"
    )
    assert lines[i + 2] == "| tiny | 2 | 25.0 % | 1.1 | 45.5 % | 0.5 |"  # 200/2/400, 200/1.1/400

    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["baseline"] == BASE
    assert data["summary"]["tiny"]["new_over_baseline_median_step_s"] == 0.5
    assert data["summary"]["tiny"]["baseline_mfu_probe"] == pytest.approx(0.25, rel=1e-12)
    assert [r["side"] for r in data["runs"]].count("baseline") == 4


def test_without_a_baseline_nothing_changes(tmp_path):
    runs = _runs(with_baseline=False)
    summary = report.summarize(runs, ["tiny"])
    assert not [k for k in summary["tiny"] if "baseline" in k]
    assert summary["tiny"]["failed_runs"] == 1
    mfu.annotate(runs, summary, MEASURED)
    report.annotate_baseline(summary, MEASURED)  # nothing to add
    assert "baseline_mfu_probe" not in summary["tiny"]
    out = tmp_path / "results.md"
    report.write(out, {"meta": _meta(None), "summary": summary, "runs": runs}, "Notes.")
    text = out.read_text()
    assert "baseline" not in text
    assert (
        "| work | rounds | s/step proximal | s/step TRL | ratio | per-round ratios | target | met | "
        "process s proximal | process s TRL | ratio | peak RSS MiB proximal | peak RSS MiB TRL | ratio "
        "| RSS target | met |\n|" + "---|" * 16 + "\n"
    ) in text
    assert "| grpo | skipped: not run |" + " |" * 14 + "\n" in text
    assert report.baseline_mfu_lines({"meta": _meta(None)}) == []


def test_baseline_argument_and_the_order_of_the_sides():
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    a = compare_trl.parse_args(["--works", "tiny", "--baseline", "HEAD"])
    assert a.baseline == "HEAD" and a.baseline_commit == head and len(head) == 40
    assert compare_trl.sides_in_order(a) == ["proximal", "trl", "baseline"]
    a = compare_trl.parse_args(["--works", "tiny", "--baseline", head[:9]])
    assert a.baseline_commit == head
    a = compare_trl.parse_args(["--smoke", "--works", "mini", "--baseline", "HEAD"])
    assert compare_trl.sides_in_order(a) == ["proximal", "baseline"] and a.rounds == 1
    a = compare_trl.parse_args(["--smoke", "--with-trl", "--works", "mini", "--baseline", "HEAD"])
    assert compare_trl.sides_in_order(a) == ["proximal", "trl", "baseline"]
    a = compare_trl.parse_args(["--works", "tiny"])
    assert a.baseline is None and a.baseline_commit is None
    assert compare_trl.sides_in_order(a) == ["proximal", "trl"]
    for bad in ("no-such-ref-b27", "HEAD~100000", "HEAD:README.md"):  # not a commit
        with pytest.raises(SystemExit):
            compare_trl.parse_args(["--works", "tiny", "--baseline", bad])


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


def test_the_baseline_checkout_leaves_the_repository_alone_and_its_children_import_it(tmp_path):
    """A throw-away repository with a stand-in ``proximal`` at two commits: the checkout of the
    first is made once, reused, made again when changed; the main tree's files, branch and worktree
    list stay as they were; a child run as the harness runs one imports the checkout's package."""
    repo = tmp_path / "repo"
    (repo / "proximal").mkdir(parents=True)
    _git(tmp_path, "init", "--quiet", "-b", "main", str(repo))
    init = repo / "proximal" / "__init__.py"
    init.write_text('__version__ = "old"\n')
    (repo / "proximal" / "__main__.py").write_text(
        "import sys\nimport proximal\nprint(proximal.__version__, *sys.argv[1:])\n"
    )
    _git(repo, "add", ".")
    _git(repo, "commit", "--quiet", "-m", "old")
    old = _git(repo, "rev-parse", "HEAD")
    init.write_text('__version__ = "new"\n')
    _git(repo, "commit", "--quiet", "-am", "new")
    init.write_text('__version__ = "new, uncommitted"\n')

    work = tmp_path / "work"
    tree = sides.baseline_tree(old, work, root=repo, log=lambda _: None)
    assert tree == work / f"baseline-{old[:12]}"
    assert (tree / "proximal" / "__init__.py").read_text() == '__version__ = "old"\n'
    assert _git(tree, "rev-parse", "HEAD") == old
    assert sides.commit_of(tree) == old[:7]
    # the repository: its files, branch, head and worktree list as they were
    assert init.read_text() == '__version__ = "new, uncommitted"\n'
    assert _git(repo, "symbolic-ref", "HEAD") == "refs/heads/main"
    assert _git(repo, "log", "--format=%s") == "new\nold"
    assert len(_git(repo, "worktree", "list").splitlines()) == 1
    assert _git(repo, "status", "--porcelain") == "M proximal/__init__.py"

    # reused while clean (a file the checkout ignores survives), made again once changed
    (tree / "keep.txt").write_text("x")
    (tree / ".git" / "info" / "exclude").write_text("keep.txt\n")
    assert sides.baseline_tree(old, work, root=repo, log=lambda _: None) == tree
    assert (tree / "keep.txt").exists()
    (tree / "proximal" / "extra.py").write_text("")
    assert sides.baseline_tree(old, work, root=repo, log=lambda _: None) == tree
    assert not (tree / "proximal" / "extra.py").exists() and not (tree / "keep.txt").exists()

    # a child in the harness's environment imports the checkout's proximal, not this project's
    got = sides.tree_proximal(tree)
    assert got["file"] == str(tree / "proximal" / "__init__.py")
    assert got["version"] == "old"
    # the stand-in has no proximal.cli: the editable install's finder must not supply this tree's
    assert got["commands"] is None and got["train_fields"] is None
    assert got["commit"] == old[:7] and got["tree"] == str(tree)
    cmd = sides.proximal_command("ppo", Path("c.yaml"), tree)
    env = sides.child_env(1, pythonpath=sides.source_path(tree))
    ran = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=True)
    assert ran.stdout == "old ppo --config c.yaml\n"  # `python -m proximal` of the checkout
    assert sides.proximal_command("ppo", Path("c.yaml")) == [
        sys.executable,
        "-m",
        "proximal",
        "ppo",
        "--config",
        "c.yaml",
    ]  # this tree's side: the command as before
    assert sides.resolve_commit("HEAD~1", repo) == old
    assert sides.resolve_commit("nope", repo) is None
