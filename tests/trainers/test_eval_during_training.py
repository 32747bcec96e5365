"""Evaluation during training (issue 24, deliverables 3 and 4), through the real command line.

* ``eval.prompts`` of ppo, grpo and simpo: ``eval/*`` rows at step 0, every ``eval.every`` steps and
  after the last, each equal to a separate :func:`proximal.evaluation.evaluate_policy` call on that
  step's exported checkpoint with the same sampling seed;
* ``output.keep_best``: the checkpoint of the best logged value is kept beside the newest one,
  ``checkpoints/best`` opens with ``from_pretrained``, and the best survives ``--resume`` (a run
  stopped and resumed keeps the same best as the run straight through);
* every online command exports its final model into the run directory (PPO: the critic in
  ``critic/``), which loads, generates, and serves as the next stage's ``model.path``.

Expected values come from evaluate_policy, loaded from disk afresh: a different code path over the
same weights (the training run samples through its own engine on its live modules).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from grpo_support import grpo_config, grpo_main  # noqa: E402  (tests/trainers on sys.path)
from ppo_support import TIMING_PREFIXES, command_main, read_jsonl, tiny_config  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from proximal.evaluation import METRIC_NAMES, evaluate_policy
from proximal.train.checkpoint import step_name

# PPO's runs reward frac_a and also log the length; GRPO's reward the length (which varies within a
# group from the start, so the policy moves) and also log frac_a.
PPO_SCORES = {"ppo_support:frac_a": "ppo_support:frac_a", "len": "ppo_support:length"}
GRPO_SCORES = {"ppo_support:length": "ppo_support:length", "a": "ppo_support:frac_a"}


def _eval_rows(run: Path) -> dict[int, dict]:
    return {
        r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")}
        for r in read_jsonl(run / "metrics.jsonl")
        if any(k.startswith("eval/") for k in r)
    }


def _expected(policy, reference, prompts, *, scores, weights, seed, spp, max_new_tokens) -> dict:
    ev = evaluate_policy(
        policy,
        reference=reference,
        prompts_file=prompts,
        scores=scores,
        weights=weights,
        samples_per_prompt=spp,
        max_new_tokens=max_new_tokens,
        seed=seed,
        max_prompt_length=16,
    )
    return {METRIC_NAMES.get(k, f"eval/{k}"): v for k, v in ev["mean"].items()}


def _eval_section(assets, **more) -> dict:
    return {
        "prompts": str(assets.prompts),
        "every": 2,
        "samples_per_prompt": 2,
        "seed": 11,
        "batch_size": 5,  # batches that cut across a prompt's samples
        "scores": {"a": "ppo_support:frac_a"},
        **more,
    }


def _grpo(assets, run, **sections) -> dict:
    return grpo_config(
        assets.policy("llama"),
        assets.prompts,
        run,
        model={"reward_functions": ["ppo_support:length"]},
        **sections,
    )


def test_grpo_eval_rows_equal_evaluate_policy_on_each_checkpoint(assets, tmp_path):
    run = tmp_path / "grpo"
    policy = assets.policy("llama")
    cfg = _grpo(
        assets,
        run,
        eval=_eval_section(assets),
        train={"steps": 3, "save_every": 1, "keep_checkpoints": 5},
    )
    assert grpo_main(cfg) == 0
    rows = _eval_rows(run)
    assert sorted(rows) == [0, 2, 3]  # before training, every 2 steps, after the last
    for step, got in rows.items():
        ckpt = policy if step == 0 else run / "checkpoints" / f"step_{step:06d}" / "policy"
        want = _expected(
            ckpt,
            policy,
            assets.prompts,
            scores=GRPO_SCORES,
            weights={"ppo_support:length": 1.0},
            seed=11,
            spp=2,
            max_new_tokens=8,
        )
        assert (
            set(got)
            == set(want)
            == {
                "eval/ppo_support:length",
                "eval/a",
                "eval/score",
                "eval/kl_ref",
                "eval/length_mean",
                "eval/eos_frac",
            }
        )
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-7), (step, k)
    assert rows[0]["eval/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # the start is the reference
    assert rows[3]["eval/kl_ref"] > 1e-6  # three steps at lr 1e-3 moved it


def test_ppo_eval_scores_the_reward_model_and_exports_policy_and_critic(assets, tmp_path):
    run = tmp_path / "ppo"
    policy, rm = assets.policy("llama"), assets.reward_model("llama")
    cfg = tiny_config(
        policy,
        assets.prompts,
        run,
        model={"reward_model": str(rm), "reward_model_weight": 0.5},
        eval=_eval_section(assets, every=0, greedy=True, scores={"len": "ppo_support:length"}),
    )
    assert command_main("ppo", cfg) == 0
    rows = _eval_rows(run)
    assert sorted(rows) == [0, 2]
    ev = evaluate_policy(
        run,  # the final policy, exported into the run directory
        reference=policy,
        prompts_file=assets.prompts,
        reward_model=rm,
        scores=PPO_SCORES,
        weights={"proxy": 0.5, "ppo_support:frac_a": 1.0},
        samples_per_prompt=2,
        max_new_tokens=8,
        seed=11,
        max_prompt_length=16,
        greedy=True,
    )
    for k, v in ev["mean"].items():
        assert rows[2][METRIC_NAMES.get(k, f"eval/{k}")] == pytest.approx(v, rel=1e-6, abs=1e-7)
    # Greedy: both samples of a prompt are the same response.
    pairs = ev["rows"][0::2], ev["rows"][1::2]
    assert all(a["response"] == b["response"] for a, b in zip(*pairs))
    # The final exports: the run directory is the policy, critic/ the critic; both equal the last
    # checkpoint's, load with plain from_pretrained, and the policy generates.
    last = run / "checkpoints" / "step_000002"
    for exported, in_ckpt in ((run, last / "policy"), (run / "critic", last / "critic")):
        assert (exported / "model.safetensors").read_bytes() == (
            in_ckpt / "model.safetensors"
        ).read_bytes()
    lm = AutoModelForCausalLM.from_pretrained(run)
    tok = AutoTokenizer.from_pretrained(run)
    ids = tok("ab 1", return_tensors="pt").input_ids
    out = lm.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    critic = AutoModelForSequenceClassification.from_pretrained(run / "critic")
    assert critic.config.num_labels == 1
    # --model.path runs/ppo: the next stage (GRPO) starts from the PPO run directory.
    nxt = tmp_path / "grpo_from_ppo"
    assert grpo_main(grpo_config(run, assets.prompts, nxt, train={"steps": 1})) == 0
    assert json.loads((nxt / "models.json").read_text())["actor"]["parameters"] > 0
    assert (nxt / "model.safetensors").is_file()


def _keep_best_config(assets, run, steps, **train):
    return _grpo(
        assets,
        run,
        eval=_eval_section(assets, every=1, samples_per_prompt=1),
        train={"steps": steps, "save_every": 0, "keep_checkpoints": 1, **train},
        output={"keep_best": "eval/kl_ref", "keep_best_mode": "min"},
        optim={"lr": 3e-3},
    )


def test_keep_best_keeps_the_best_checkpoint_also_across_a_resume(assets, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert grpo_main(_keep_best_config(assets, straight, 5)) == 0
    rows = _eval_rows(straight)
    values = {s: r["eval/kl_ref"] for s, r in rows.items() if s > 0}  # step 0: the starting model
    best = min(values, key=lambda s: (values[s], s))  # the first of equal values
    # The KL to the reference grows as the policy trains: the best is an early step, not the newest,
    # so keeping it is keep_best's doing, not keep_checkpoints'.
    assert best < 5
    root = straight / "checkpoints"
    assert (root / "best").resolve().parent.name == step_name(best)  # best -> step_X/<export>
    # The newest (keep_checkpoints 1) and the best: nothing else.
    assert sorted(p.name for p in root.glob("step_*")) == sorted(
        {f"step_{best:06d}", "step_000005"}
    )
    model = AutoModelForCausalLM.from_pretrained(root / "best")
    assert (root / "best").resolve() == (root / f"step_{best:06d}" / "policy").resolve()
    assert sum(p.numel() for p in model.parameters()) > 0
    state = torch.load(root / "step_000005" / "trainer_state.pt", weights_only=False)
    assert state["counters"]["best"] == {
        "metric": "eval/kl_ref",
        "value": values[best],
        "step": best,
    }

    # Stopped after step 3 (its checkpoint is the last), then resumed to 5: the same best.
    assert grpo_main(_keep_best_config(assets, resumed, 3)) == 0
    assert grpo_main(None, "--resume", str(resumed), "--train.steps", "5") == 0
    assert (resumed / "checkpoints" / "best").resolve().parent.name == step_name(best)
    again = torch.load(
        resumed / "checkpoints" / "step_000005" / "trainer_state.pt", weights_only=False
    )
    assert again["counters"]["best"] == state["counters"]["best"]
    strip = [
        {k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)}
        for r in read_jsonl(resumed / "metrics.jsonl")
    ]
    assert strip == [
        {k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)}
        for r in read_jsonl(straight / "metrics.jsonl")
    ]


def test_simpo_eval_on_prompts_equals_evaluate_policy(assets, tmp_path):
    from test_dpo_cli import write_yaml  # noqa: E402  (tests/trainers on sys.path)

    from proximal.cli import main

    policy = assets.policy("llama")
    config = write_yaml(
        tmp_path / "simpo.yaml",
        policy,
        tmp_path,
        "simpo",
        eval=_eval_section(assets, every=0, max_new_tokens=6, scores=PPO_SCORES),
        output={"keep_best": "eval/len"},
    )
    assert main(["simpo", "--config", config]) == 0
    rows = _eval_rows(tmp_path / "run")
    assert 0 in rows and 2 in rows
    want = _expected(
        tmp_path / "run",
        policy,
        assets.prompts,
        scores=PPO_SCORES,
        weights=None,
        seed=11,
        spp=2,
        max_new_tokens=6,
    )
    for k, v in want.items():
        assert rows[2][k] == pytest.approx(v, rel=1e-6, abs=1e-7), k
    assert "eval/accuracy" in rows[2]  # the pairs' held-out metrics still come with them
    assert math.isfinite(rows[2]["eval/kl_ref"])


@pytest.mark.parametrize(
    "output, message",
    [
        (
            {"keep_best": "eval/score"},
            "output.keep_best = 'eval/score' needs a held-out evaluation",
        ),
        ({"keep_best": "score/mean"}, "output.keep_best = 'score/mean': give a held-out metric"),
        ({"keep_best_mode": "best"}, "output.keep_best_mode"),
    ],
)
def test_keep_best_config_errors_are_one_line(assets, tmp_path, capsys, output, message):
    cfg = grpo_config(assets.policy("llama"), assets.prompts, tmp_path / "r", output=output)
    assert grpo_main(cfg) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_keep_best_of_a_metric_the_run_does_not_log_names_the_ones_it_does(
    assets, tmp_path, capsys
):
    cfg = grpo_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / "r",
        eval=_eval_section(assets),
        output={"keep_best": "eval/gold"},
    )
    assert grpo_main(cfg) == 2
    err = capsys.readouterr().err
    assert "output.keep_best = 'eval/gold': this run logs no such metric" in err
    assert "eval/a" in err and "Traceback" not in err


def _pass_by_hand(rows: list[dict], n: int, ks, threshold: float) -> dict:
    """pass@k (the closed form 1 − C(n−c, k)/C(n, k) in exact fractions), mean@n and maj@n (a vote
    over the stripped responses, a tie to the answer sampled first) of evaluate_policy's rows."""
    from collections import Counter
    from fractions import Fraction

    groups = [rows[i : i + n] for i in range(0, len(rows), n)]
    out = {}
    for k in ks:
        per = [
            1 - Fraction(math.comb(n - c, k), math.comb(n, k))
            for c in (sum(r["a"] >= threshold for r in g) for g in groups)
        ]
        out[f"eval/pass@{k}"] = float(sum(per) / len(per))
    out["eval/mean@n"] = sum(sum(r["a"] for r in g) / n for g in groups) / len(groups)
    maj = 0
    for g in groups:
        answers = [r["response"].strip() for r in g]
        most = max(Counter(answers).values())
        winner = next(a for a in answers if answers.count(a) == most)  # the first of the tied
        maj += g[answers.index(winner)]["a"] >= threshold
    out["eval/maj@n"] = maj / len(groups)
    return out


def test_grpo_logs_pass_at_k_and_keeps_the_best_checkpoint_by_it(assets, tmp_path):
    """eval.pass_k: eval/pass@k per k, eval/mean@n and eval/maj@n in metrics.jsonl, each equal to
    the estimator computed by hand from a separate evaluate_policy's responses on that step's
    checkpoint; output.keep_best eval/pass@1 (auto: larger is better) keeps the step that had most."""
    run = tmp_path / "grpo"
    policy = assets.policy("llama")
    n, ks, threshold = 4, [1, 2, 4], 0.1
    cfg = _grpo(
        assets,
        run,
        eval=_eval_section(
            assets,
            every=1,
            samples_per_prompt=n,
            pass_k=ks,
            pass_score="a",  # eval.scores' frac_a: fractional, so the threshold matters
            pass_threshold=threshold,
        ),
        train={"steps": 3, "save_every": 1, "keep_checkpoints": 5},
        output={"keep_best": "eval/pass@1"},
        optim={"lr": 3e-3},
    )
    assert grpo_main(cfg) == 0
    rows = _eval_rows(run)
    assert sorted(rows) == [0, 1, 2, 3]
    for step, got in rows.items():
        ckpt = policy if step == 0 else run / "checkpoints" / f"step_{step:06d}" / "policy"
        ev = evaluate_policy(
            ckpt,
            reference=policy,
            prompts_file=assets.prompts,
            scores=GRPO_SCORES,
            samples_per_prompt=n,
            max_new_tokens=8,
            seed=11,
            max_prompt_length=16,
        )
        want = _pass_by_hand(ev["rows"], n, ks, threshold)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), (step, key)
    values = [rows[s]["eval/pass@1"] for s in range(4)]
    assert 0 < min(values) and max(values) < 1  # some responses pass, some do not
    assert rows[0]["eval/pass@4"] > rows[0]["eval/pass@1"]
    best = max((s for s in (1, 2, 3)), key=lambda s: (values[s], -s))  # the first of equal values
    root = run / "checkpoints"
    assert (root / "best").resolve().parent.name == step_name(best)


@pytest.mark.parametrize(
    "more, message",
    [
        (
            {"pass_k": [1, 8]},
            "eval.pass_k = [1, 8]: k = 8 is more than eval.samples_per_prompt = 2 (pass@k draws k "
            "of the n responses sampled per prompt); raise eval.samples_per_prompt to at least 8",
        ),
        ({"pass_k": [0, 1]}, "eval.pass_k = [0, 1]: k = 0 must be ≥ 1"),
        ({"pass_k": [1, 1]}, "eval.pass_k = [1, 1] lists a k twice"),
        ({"pass_k": [1], "pass_threshold": "nan"}, "eval.pass_threshold = nan must be a finite"),
        ({"pass_k": [1], "answer": "strip"}, "eval.answer = 'strip': expected 'module:function'"),
        # found at the first evaluation (step 0), before any training
        (
            {"pass_k": [1], "pass_score": "gold"},
            "eval.pass_score = 'gold': the held-out evaluation has no such score; it has: "
            "ppo_support:length, a, score",
        ),
    ],
)
def test_pass_k_config_errors_are_one_line(assets, tmp_path, capsys, more, message):
    cfg = _grpo(assets, tmp_path / "r", eval=_eval_section(assets, **more))
    assert grpo_main(cfg) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_dpo_pass_k_needs_a_named_score():
    """dpo and simpo train on no score: eval.pass_k with eval.pass_score null is refused by name."""
    from proximal.trainers.dpo_config import PreferenceEvalSection

    got = PreferenceEvalSection(prompts=None, samples_per_prompt=4, pass_k=[1, 4]).problems()
    assert got == [
        "eval.pass_k = [1, 4] needs eval.pass_score: dpo and simpo train on no score, so name the "
        "one pass@k reads (a name of eval.scores, or proxy with eval.reward_model)"
    ]
    assert (
        PreferenceEvalSection(samples_per_prompt=4, pass_k=[1], pass_score="gold").problems() == []
    )


def test_pass_metrics_groups_rows_by_prompt_and_reads_the_answer_function():
    """Rows p·n … p·n + n − 1 are prompt p's; eval.answer's function gives maj@n's answers."""
    from proximal.evaluation import pass_metrics

    def row(response, score):
        return {"prompt": "q", "response": response, "score": score, "length": 3}

    rows = [row(" 12=3", 1.0), row("4=3 ", 0.0), row("9=5", 0.0)]  # prompt 0
    rows += [row("1=2", 0.0), row("1=2", 0.0), row("0=7", 1.0)]  # prompt 1
    # the stripped texts all differ for prompt 0 (the first wins: a pass); prompt 1's "1=2" fails
    plain = pass_metrics(rows, 3, ks=[1, 3], threshold=1.0)
    want = {"pass@1": 1 / 3, "pass@3": 1.0, "mean@n": 1 / 3, "maj@n": 0.5}
    assert plain == pytest.approx(want, rel=0, abs=1e-15)
    # answers after "=": prompt 0 votes "3" twice (its first, a pass); prompt 1 "2" (fails)
    after = pass_metrics(rows, 3, ks=[1], threshold=1.0, answer=lambda t: t.split("=")[-1].strip())
    assert after["maj@n"] == 0.5
    rows[0]["score"] = 0.0
    rows[1]["score"] = 1.0  # now "3"'s first response fails: maj@n counts the first that gave it
    assert (
        pass_metrics(rows, 3, ks=[1], threshold=1.0, answer=lambda t: t[-2:].strip())["maj@n"]
        == 0.0
    )
