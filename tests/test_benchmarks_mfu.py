"""The MFU yardstick of the benchmarks (issue 27, ``benchmarks/harness/mfu.py``): the tiny work's
model FLOPs a step against a count by hand, the probe's product shapes, and how the probe's timings
become the peak (injected times: nothing here is timed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from harness import mfu, report  # noqa: E402
from harness.works import WORKS  # noqa: E402

# The tiny work by hand: Llama, vocab V = 2048, d = 256, L = 4 layers of 4 heads (attention width
# 256), intermediate FF = 1024, tied embeddings; B = 16 sequences of P = 16 prompt and R = 48 response
# tokens (s = 64).
V, D, L, FF, B, P, R = 2048, 256, 4, 1024, 16, 16, 48
N_BODY = L * (4 * D * D + 3 * D * FF)  # q, k, v, o and gate, up, down: 4,194,304
N_HEAD = V * D  # the output layer, counted although tied: 524,288
N_CRITIC = N_BODY + D  # the classifier's body and its d → 1 score
ATT = 4 * L * D  # attention FLOPs per unit of Σ s² in a forward pass
SEQ_SQUARES = B * (P + R) ** 2


def test_tiny_step_flops_by_hand():
    """Each phase of a tiny PPO step, from the formulas of docs/performance.md written out here.

    The issue's own figures (generation 9.7, scoring 8.6, reference 9.4, old values 8.6, epochs 216:
    252 GFLOP) leave out attention (Q·Kᵀ and softmax·V: 0.27 GFLOP a forward, 6.4 in the epochs) and
    count generation as 2·N over all B·(P+R) tokens with the head everywhere (9.66) rather than a
    decode (the prompt's head at its last position only, each token after the first through the
    model once: 9.40). With those two differences the count is the issue's, to 0.1 GFLOP."""
    f = mfu.step_flops(WORKS["tiny"])
    decode_steps = R - 1  # the first token comes from the prompt's forward
    generation = (
        2 * N_BODY * B * P  # the prompt's forward
        + 2 * N_HEAD * B  # its head at the last position
        + ATT * B * P * P  # its attention
        + 2 * (N_BODY + N_HEAD) * B * decode_steps  # each further token through the model
        + ATT * B * (decode_steps * P + decode_steps * (decode_steps + 1) // 2)  # c = P + j
    )
    forward_critic = 2 * N_CRITIC * B * (P + R) + ATT * SEQ_SQUARES
    forward_policy = 2 * N_BODY * B * (P + R) + 2 * N_HEAD * B * R + ATT * SEQ_SQUARES
    train = lambda n_body, n_head: (  # noqa: E731
        6 * n_body * B * (P + R) + 6 * n_head * B * R + 3 * ATT * SEQ_SQUARES
    )
    epochs = 4 * (train(N_BODY, N_HEAD) + train(N_CRITIC, 0))
    assert f == {
        "generation": generation,
        "scoring": forward_critic,
        "reference": forward_policy,
        "old values": forward_critic,
        "epochs": epochs,
        "total": generation + 2 * forward_critic + forward_policy + epochs,
    }
    assert f["total"] == 259_053_322_240  # 259.05 GFLOP
    # the issue's way: no attention, generation as a full forward with the head at every position
    att_total = ATT * SEQ_SQUARES * (3 + 4 * 6)  # three forwards, four epochs of 2 × 3
    issue = f["total"] - att_total - generation + 2 * (N_BODY + N_HEAD) * B * (P + R)
    assert abs(issue - 252.0e9) < 0.1e9
    assert abs((2 * (N_BODY + N_HEAD) * B * (P + R)) - 9.7e9) < 0.05e9  # the issue's generation


def test_grpo_step_flops():
    """GRPO (one iteration, β > 0): the decode, the reference's forward, one training pass."""
    f, t = mfu.step_flops(WORKS["grpo"]), mfu.step_flops(WORKS["tiny"])
    policy_train = 6 * N_BODY * B * (P + R) + 6 * N_HEAD * B * R + 3 * ATT * SEQ_SQUARES
    assert f == {
        "generation": t["generation"],
        "reference": t["reference"],
        "update": policy_train,
        "total": t["generation"] + t["reference"] + policy_train,
    }


def test_the_probe_runs_the_works_own_products():
    """Tiny: the issue's three shapes at B·(P+R) = 1024 rows, as often as a forward pass runs them,
    and the output layer at the B·R = 768 response rows. ppo-vocab: grouped key/value heads."""
    assert mfu.product_shapes(WORKS["tiny"]) == {
        (1024, 256, 256): 4 * 4,  # q, k, v, o in 4 layers
        (1024, 256, 1024): 2 * 4,  # gate, up
        (1024, 1024, 256): 4,  # down
        (768, 256, 2048): 1,
    }
    assert mfu.product_shapes(WORKS["ppo-vocab"]) == {
        (3072, 128, 128): 2 * 2,  # q, o: 4 heads of 32
        (3072, 128, 64): 2 * 2,  # k, v: 2 heads of 32
        (3072, 128, 512): 2 * 2,
        (3072, 512, 128): 2,
        (2048, 128, 151_936): 1,
    }


def test_the_peak_is_the_faster_backends_rate_over_the_mix():
    """Rates by hand: a backend's rate is Σ n·2MKN / Σ n·t, and the peak the larger one — here
    oneDNN's, although F.linear is faster on one shape."""
    counts = {(100, 10, 10): 3, (100, 10, 50): 1}  # 20,000 and 100,000 FLOPs a product
    seconds = {
        "F.linear": {(100, 10, 10): 1e-6, (100, 10, 50): 4e-6},  # 160,000 FLOPs in 3·1 + 4 = 7 µs
        "oneDNN": {(100, 10, 10): 1.5e-6, (100, 10, 50): 1e-6},  # in 3·1.5 + 1 = 5.5 µs
    }
    got = mfu.choose(counts, seconds)
    assert got["backend"] == "oneDNN"
    assert got["rates"]["F.linear"] == pytest.approx(160_000 / 7e-6, rel=1e-12)
    assert got["rates"]["oneDNN"] == pytest.approx(160_000 / 5.5e-6, rel=1e-12)
    assert got["peak_flops_per_s"] == got["rates"]["oneDNN"]
    assert got["shapes"]["100x10->10"]["F.linear"] == pytest.approx(20_000 / 1e-6, rel=1e-12)
    # a backend missing a shape is left out; none timed on every shape is an error
    del seconds["oneDNN"][(100, 10, 50)]
    assert mfu.choose(counts, seconds)["backend"] == "F.linear"
    with pytest.raises(ValueError, match="no backend"):
        mfu.choose(counts, {"oneDNN": seconds["oneDNN"]})


def synthetic_measured() -> dict:
    """The yardstick of a synthetic tiny work: 200 GFLOP a step on a 400 GFLOP/s peak (oneDNN; F.linear
    200). A fresh dict each call (tests/test_benchmarks_baseline.py uses it too)."""
    return {
        "cpu": {"model": "Some CPU", "vector": "AVX-512 (512-bit)"},
        "works": {
            "tiny": {
                "flops": {"generation": 10e9, "epochs": 190e9, "total": 200e9},
                "peak": {
                    "peak_flops_per_s": 400e9,
                    "backend": "oneDNN",
                    "rates": {"F.linear": 200e9, "oneDNN": 400e9},
                    "dtype": "float32",
                    "threads": 2,
                },
            }
        },
    }


def test_mfu_beside_the_ratio_in_the_summary_and_results_md():
    measured = synthetic_measured()
    runs = [
        {"work": "tiny", "round": 1, "side": "proximal", "median_step_s": 1.0},
        {"work": "tiny", "round": 1, "side": "trl", "median_step_s": 2.0},
        {"work": "tiny", "round": 1, "side": "proximal", "error": "x"},
    ]
    summary = {
        "tiny": {
            "proximal_median_step_s": 1.0,
            "anchor_median_step_s": 2.0,
            "ratio_median_step_s": 0.5,
        }
    }
    mfu.annotate(runs, summary, measured)
    assert [r["mfu_probe"] for r in runs] == [0.5, 0.25, None]  # 200 GFLOP / 1 s / 400 GFLOP/s
    assert summary["tiny"]["proximal_mfu_probe"] == 0.5
    assert summary["tiny"]["anchor_mfu_probe"] == 0.25
    lines = mfu.report_lines({"meta": {"mfu": measured}, "summary": summary})
    assert lines[3].startswith("CPU: Some CPU, widest vectors AVX-512 (512-bit); before the probe ")
    assert lines[-1] == (
        "| tiny | 200 | generation 10.0, epochs 190.0 | 400 (float32, 2 threads) | oneDNN | "
        "F.linear 200 | 1 | 50.0 % | 2 | 25.0 % | 0.5 |"
    )
    assert mfu.report_lines({"meta": {}}) == []
    assert report.mfu is mfu  # results.md carries the section


def test_the_cpu_is_named_with_its_vector_width():
    c = mfu.cpu()
    assert c["model"] and c["vector"] in (
        "AVX-512 (512-bit)",
        "AVX2 (256-bit)",
        "NEON (128-bit)",
        "?",
    )


def test_a_runs_line_gives_its_mfu_on_the_invocations_probe():
    """compare_trl's line for each run: the work's FLOPs / the run's s/step / the one probed peak
    (200 GFLOP / 1.25 s / 400 GFLOP/s = 40 %), as results.md shows it — not the run's own perf/mfu
    (here 0.9), which it shows only for a work this invocation did not probe."""
    import compare_trl

    measured = synthetic_measured()
    run = {"work": "tiny", "median_step_s": 1.25, "median_mfu": 0.9}
    assert compare_trl._run_mfu(run, measured) == ", MFU 40.0 %"
    assert compare_trl._run_mfu({**run, "work": "wide"}, measured) == ", MFU 90 % (its own probe)"
    assert compare_trl._run_mfu({"work": "wide", "median_step_s": 1.0}, measured) == ""
