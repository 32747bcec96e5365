"""``proximal ppo --train.compile blocks`` end to end: every model's blocks compiled (the start line and
models.json say so), and the run's numbers those of the eager run up to float32 round-off."""

from __future__ import annotations

import json

import pytest
from ppo_support import ppo_main, read_jsonl, tiny_config, without_timing

# Losses and statistics of step 1 (before any update the two runs' weights are the same): round-off only.
COMPARED = ("loss/policy", "loss/value", "policy/approx_kl", "policy/entropy", "score/mean")


@pytest.mark.slow
def test_a_compiled_run_matches_the_eager_run(assets, tmp_path, capsys):
    rows = {}
    for mode in ("eager", "blocks"):
        run = tmp_path / mode
        cfg = tiny_config(
            assets.policy("llama"),
            assets.prompts,
            run,
            model={"reward_model": str(assets.reward_model("llama")), "critic": "reward_model"},
            train={"steps": 1, "compile": mode},
        )
        assert ppo_main(cfg) == 0
        said = capsys.readouterr().out
        models = json.loads((run / "models.json").read_text())
        records = {name: entry["compile"] for name, entry in models.items()}
        assert set(records) == {"actor", "reference", "critic", "reward_model"}
        if mode == "blocks":
            assert all(
                r == {"blocks": 2, "why": "train.compile = blocks"} for r in records.values()
            )
            assert (
                "compile: actor, reference, critic, reward_model: 2 blocks compiled "
                "(train.compile = blocks)" in said
            )
        else:
            assert all(r["blocks"] == 0 for r in records.values()) and "compile:" not in said
        rows[mode] = read_jsonl(run / "metrics.jsonl")[-1]
    assert rows["eager"]["step"] == rows["blocks"]["step"] == 1
    for key in COMPARED:
        want, got = rows["eager"][key], rows["blocks"][key]
        assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (key, got, want)
    # the same tokens were sampled: the response lengths agree exactly
    assert rows["eager"]["response/length_mean"] == rows["blocks"]["response/length_mean"]


@pytest.mark.slow
def test_a_compiled_run_resumed_is_the_uninterrupted_compiled_run(assets, tmp_path, capsys):
    """Compiled kernels are deterministic on the same threads: a compiled run stopped after step 1 and
    resumed to step 2 logs exactly the metrics of the one that ran 2 steps, and samples the same."""

    def cfg(name: str, steps: int) -> dict:
        return tiny_config(
            assets.policy("llama"),
            assets.prompts,
            tmp_path / name,
            train={"steps": steps, "compile": "blocks"},
        )

    assert ppo_main(cfg("full", 2)) == 0
    assert ppo_main(cfg("short", 1)) == 0
    assert ppo_main(None, "--resume", str(tmp_path / "short"), "--train.steps", "2") == 0
    capsys.readouterr()
    full, resumed = (read_jsonl(tmp_path / n / "metrics.jsonl") for n in ("full", "short"))
    assert [r["step"] for r in resumed] == [1, 2]
    for a, b in zip(full, resumed):
        assert without_timing(a) == without_timing(b), a["step"]
    assert read_jsonl(tmp_path / "full" / "samples.jsonl") == read_jsonl(
        tmp_path / "short" / "samples.jsonl"
    )
    models = json.loads((tmp_path / "short" / "models.json").read_text())
    assert models["actor"]["compile"]["blocks"] == 2  # the resumed run compiled too
