"""The benchmark harness keeps working (issue 12): its smoke mode end to end, and the pieces whose
mistakes would silently skew a comparison — step spans, ratios, the unreachable special tokens, the
prompts' ids. A benchmark is not a test: nothing here asserts a time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

from harness import report  # noqa: E402
from harness.proximal_side import median_from_step2, read_steps  # noqa: E402
from harness.works import MINI, SPECIALS, build_tokenizer, write_models, write_prompts  # noqa: E402


def test_step_spans_come_from_wall_clock_differences(tmp_path):
    rows = [
        {"step": 1, "time/step_s": 5.0, "time/wall_s": 5.5},
        {"step": 2, "time/step_s": 1.0, "time/wall_s": 7.0},
        {"step": 3, "time/step_s": 2.0, "time/wall_s": 9.5},
        {"step": 4, "time/step_s": 1.5, "time/wall_s": 11.25},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = read_steps(tmp_path)
    assert got["period_s"] == [5.5, 1.5, 2.5, 1.75]
    assert got["step_s"] == [5.0, 1.0, 2.0, 1.5]
    assert median_from_step2(got["period_s"]) == 1.75  # steps 2-4: 1.5, 2.5, 1.75; step 1 left out
    assert median_from_step2([3.0]) == 3.0  # one step: that step


def test_ratios_are_per_round_pairs_and_failed_runs_drop_their_pair():
    def run(side, k, step, wall, rss, rc=0):
        return {
            "work": "tiny",
            "side": side,
            "round": k,
            "median_step_s": step,
            "wall_s": wall,
            "peak_rss_mib": rss,
            "rc": rc,
        }

    runs = [
        run("proximal", 1, 1.0, 10.0, 100.0),
        run("trl", 1, 4.0, 20.0, 200.0),
        run("proximal", 2, 3.0, 30.0, 300.0),
        run("trl", 2, 4.0, 40.0, 300.0),
        run("proximal", 3, 2.0, 20.0, 100.0),
        run("trl", 3, 1.0, 10.0, 50.0, rc=1),
    ]
    s = report.summarize(runs, ["tiny"])["tiny"]
    assert s["ratio_median_step_s_all"] == [0.25, 0.75]  # round 3's anchor failed: no pair
    assert s["ratio_median_step_s"] == 0.5
    assert s["ratio_peak_rss_mib_all"] == [0.5, 1.0]
    assert s["proximal_median_step_s"] == 2.0  # 1, 3, 2
    assert s["anchor_median_step_s"] == 4.0  # 4, 4 (the failed run left out)
    assert s["failed_runs"] == 1


def test_more_rounds_for_some_works_keep_the_rounds_interleaved():
    import compare_trl

    a = compare_trl.parse_args(
        ["--works", "tiny,wide,grpo", "--rounds", "3", "--more-rounds", "tiny=5,grpo=4"]
    )
    assert a.rounds_of == {"tiny": 5, "wide": 3, "grpo": 4}
    order = compare_trl.schedule(a.works, a.rounds_of)
    assert order[:3] == [(1, "tiny"), (1, "wide"), (1, "grpo")]
    assert order[9:] == [(4, "tiny"), (4, "grpo"), (5, "tiny")]
    assert sorted(order) == sorted(
        {(k, w) for w, n in a.rounds_of.items() for k in range(1, n + 1)}
    )
    for bad in (
        "tiny=2",
        "wide-bf16=5",
        "tiny",
        "tiny=x",
    ):  # fewer than --rounds, not a chosen work, no N
        with pytest.raises(SystemExit):
            compare_trl.parse_args(["--works", "tiny,wide", "--more-rounds", bad])
    assert report._rounds({"rounds": 3, "rounds_of": a.rounds_of}) == "3 rounds (grpo: 4; tiny: 5)"
    assert report._rounds({"rounds": 3, "rounds_of": {"tiny": 3}}) == "3 rounds"


def test_steps_of_gives_some_works_fewer_steps_and_the_results_say_so():
    import compare_trl

    a = compare_trl.parse_args(["--works", "tiny,wide,grpo", "--steps-of", "wide=3"])
    assert a.steps_of == {"tiny": 10, "wide": 3, "grpo": 10}
    a = compare_trl.parse_args(["--works", "tiny,wide", "--steps", "5", "--steps-of", "wide=3"])
    assert a.steps_of == {"tiny": 5, "wide": 3}
    # --steps given and one work differing: the phrase names the exception, not "5 steps a run"
    assert report._steps({"steps": a.steps, "steps_of": a.steps_of}) == "5 steps a run (wide: 3)"
    assert report._steps({"steps": 5, "steps_of": {"tiny": 5, "wide": 5}}) == "5 steps a run"
    for bad in ("wide=1", "grpo=3", "wide", "wide=x"):  # N < 2, not a chosen work, no N
        with pytest.raises(SystemExit):
            compare_trl.parse_args(["--works", "tiny,wide", "--steps-of", bad])
    # --smoke keeps its one round of --steps (or 1) for every work
    a = compare_trl.parse_args(["--works", "tiny,wide", "--smoke", "--steps-of", "wide=3"])
    assert a.steps_of == {"tiny": 1, "wide": 1}


def test_benchmark_policy_cannot_sample_a_special_token_and_prompts_round_trip(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    m = write_models(MINI, tmp_path)
    tok = build_tokenizer(MINI.vocab)
    assert len(tok) == MINI.vocab
    assert m["special_ids"] == [tok.convert_tokens_to_ids(s) for s in SPECIALS] == [0, 1, 2, 3]
    model = AutoModelForCausalLM.from_pretrained(m["policy"])
    ids = torch.randint(4, MINI.vocab, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
    # exp(-200) underflows to 0 in float32 and bfloat16: both sides' samplers give such a token probability 0
    assert bool((logp[..., m["special_ids"]] < -200).all())
    p = write_prompts(MINI, tmp_path, 6, m["policy"])
    texts = [json.loads(line)["prompt"] for line in Path(p["jsonl"]).read_text().splitlines()]
    ids_json = json.loads(Path(p["ids"]).read_text())
    assert all(len(x) == MINI.prompt_len for x in ids_json)
    from proximal.data.chat import encode_prompt
    from proximal.models.loading import load_tokenizer

    loaded = load_tokenizer(m["policy"])
    assert [
        encode_prompt(t, loaded) for t in texts
    ] == ids_json  # TRL gets exactly what proximal tokenises


@pytest.mark.slow
def test_compare_trl_smoke_mode_writes_its_results(tmp_path):
    """CI's run of the harness: 1 step, proximal only, no anchor installed, a minuscule model."""
    out = tmp_path / "results.md"
    r = subprocess.run(
        [
            sys.executable,
            str(BENCH / "compare_trl.py"),
            "--smoke",
            "--works",
            "mini",
            "--threads",
            "1",
            "--workdir",
            str(tmp_path / "work"),
            "--results",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(ROOT),
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["smoke"] is True and data["meta"]["steps"] == 1
    (run,) = data["runs"]
    assert run["side"] == "proximal" and run["rc"] == 0 and "error" not in run
    assert len(run["period_s"]) == 1 and run["median_step_s"] > 0
    assert run["peak_rss_mib"] > 0 and run["wall_s"] > 0
    assert run["response_length_mean"] == [
        float(MINI.response_len)
    ]  # exactly R tokens, no early stop
    assert "| mini |" in out.read_text()
    assert "[anchors]" not in r.stdout  # nothing installed


def test_proximal_mfu_is_read_and_reported_beside_its_step_time(tmp_path):
    rows = [
        {"step": 1, "time/step_s": 5.0, "time/wall_s": 5.0, "perf/mfu": 0.001},
        {"step": 2, "time/step_s": 1.0, "time/wall_s": 6.0, "perf/mfu": 0.004},
        {"step": 3, "time/step_s": 1.0, "time/wall_s": 7.0, "perf/mfu": 0.006},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_steps(tmp_path)["mfu"] == [0.001, 0.004, 0.006]

    def run(side, k, mfu=None):
        r = {"work": "tiny", "side": side, "round": k, "rc": 0}
        r |= {"median_step_s": 1.0, "wall_s": 1.0, "peak_rss_mib": 1.0}
        return r | ({"median_mfu": mfu} if mfu is not None else {})

    runs = [run("proximal", 1, 0.005), run("trl", 1), run("proximal", 2, 0.007)]
    runs += [run("trl", 2), run("proximal", 3, 0.002), run("trl", 3)]
    assert report.summarize(runs, ["tiny"])["tiny"]["proximal_median_mfu"] == 0.005
    assert report._with_mfu(1.25, 0.0041) == "1.25 (MFU 0.41 %)"
    assert report._with_mfu(1.25, None) == "1.25"


def test_every_mfu_cell_is_on_the_invocations_one_probed_peak(tmp_path):
    """Beside each s/step, results.md's MFU is the work's model FLOPs / that step / the peak probed
    once in the invocation — not the run's own ``perf/mfu``, whose peak its run probed in its first
    second (benchmarks/results-zen3.json: a baseline run read 107 % that way). Without a probe, the
    run's own figure stands."""
    data = json.loads((ROOT / "benchmarks" / "results-zen3.json").read_text())
    measured = data["meta"]["mfu"]["works"]["tiny"]
    flops, peak = measured["flops"]["total"], measured["peak"]["peak_flops_per_s"]
    odd = next(r for r in data["runs"] if (r.get("median_mfu") or 0) > 1)
    report.write(tmp_path / "r.md", data, "")
    row = next(
        line
        for line in (tmp_path / "r.md").read_text().splitlines()
        if line.startswith(f"| tiny | {odd['round']} | {odd['side']} |")
    )
    want = 100 * flops / odd["median_step_s"] / peak  # 76 %
    assert f"(MFU {want:.2g} %)" in row and 0.5 < want / 100 < 1
    assert report._mfu(odd, "mfu_probe", "median_mfu") == odd["mfu_probe"]
    assert report._mfu({"median_mfu": 0.4}, "mfu_probe", "median_mfu") == 0.4
