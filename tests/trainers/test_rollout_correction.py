"""Rollout correction through the trainers (issue 25): ``rollout.precision``, ``rollout.correction``
and the ``rollout/*`` metrics through the real ``proximal grpo`` and ``proximal ppo`` commands; the
weights each mode puts on the update's loss on a fixed batch, as its formula says; the config
mistakes ``validate`` refuses, each in one line."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_support import grpo_config, grpo_main, read_jsonl
from ppo_support import ppo_main
from ppo_support import tiny_config as ppo_config
from transformers import AutoModelForCausalLM

from proximal.rollout.engine import HFEngine
from proximal.rollout.experience import Experience, sequence_token_logprobs
from proximal.rollout.sampling import sample
from proximal.train import host
from proximal.train.optim import Trained
from proximal.trainers.grpo import GRPOUpdate, grpo_update

MISMATCH = (
    "rollout/mismatch_k1",
    "rollout/mismatch_k3",
    "rollout/ratio_max",
    "rollout/ratio_min",
    "rollout/ratio_p99",
    "rollout/outside_band_frac",
)
#: each mode's own statistic (none and bypass have none)
OWN = {
    "tis": "rollout/correction_truncated_frac",
    "token_mask": "rollout/correction_masked_frac",
    "seq_mask": "rollout/correction_masked_seq_frac",
}


def _check_rows(rows: list[dict], mode: str, precision: str | None) -> None:
    for r in rows:
        for k in MISMATCH:
            assert isinstance(r.get(k), float) and math.isfinite(r[k]), (k, r.get(k))
        assert r["rollout/ratio_min"] <= r["rollout/ratio_p99"] <= r["rollout/ratio_max"]
        assert r["rollout/mismatch_k3"] >= 0 and 0 <= r["rollout/outside_band_frac"] <= 1
        if precision is None:
            # float32 sampling with the training weights: μ = π_old up to round-off
            assert abs(math.log(r["rollout/ratio_max"])) < 1e-5
            assert abs(math.log(r["rollout/ratio_min"])) < 1e-5
            assert r["rollout/mismatch_k3"] < 1e-12  # measured ~1e-15
        if mode in OWN:
            assert 0 <= r[OWN[mode]] <= 1 and r["rollout/correction_weight_mean"] >= 0
        else:
            assert not any(k.startswith("rollout/correction_") for k in r)
    if precision is not None:
        # bfloat16 sampling against float32 training: clearly off (this small policy's nearly flat
        # logits keep it small: measured k3 ~1e-7, |log ρ| up to ~2e-3)
        assert min(r["rollout/mismatch_k3"] for r in rows) > 1e-9
        assert max(-math.log(r["rollout/ratio_min"]) for r in rows) > 1e-4


GRPO_RUNS = {
    # (mode, precision, more arguments): the one-step path (π_old = the update's forward) and the
    # experience path (grpo.iterations 2), the sequence-level objective, bypass on both
    "none-float32": ("none", None, []),
    "tis-bf16_true-iterations": ("tis", "bf16-true", ["--grpo.iterations", "2"]),
    "token_mask-bf16_mixed": (
        "token_mask",
        "bf16-mixed",
        ["--rollout.correction_band", "[0.995, 1.005]"],
    ),
    "seq_mask-bf16_true-gspo": ("seq_mask", "bf16-true", ["--grpo.objective", "gspo"]),
    "bypass-bf16_true": ("bypass", "bf16-true", []),
    "bypass-bf16_true-iterations": ("bypass", "bf16-true", ["--grpo.iterations", "2"]),
}


@pytest.mark.parametrize("name", list(GRPO_RUNS))
def test_grpo_runs_each_mode(name, assets, tmp_path, capsys):
    mode, precision, more = GRPO_RUNS[name]
    run_dir = tmp_path / "run"
    cfg = grpo_config(assets.policy("llama"), assets.prompts, run_dir)
    args = ["--rollout.correction", mode, *more]
    if precision:
        args += ["--rollout.precision", precision]
    assert grpo_main(cfg, *args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    if precision == "bf16-true":
        assert "(rollout.precision bf16-true)" in out
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    _check_rows(rows, mode, precision)
    models = (run_dir / "models.json").read_text()
    assert (f'"precision": "{precision}"' in models) == (precision is not None)


PPO_RUNS = {
    "none-float32": ("none", None, []),
    "tis-bf16_true": ("tis", "bf16-true", []),
    "token_mask-bf16_mixed-minibatches": (
        "token_mask",
        "bf16-mixed",
        ["--ppo.mini_batch_size", "2", "--ppo.micro_batch_size", "1"],
    ),
    "seq_mask-bf16_true": ("seq_mask", "bf16-true", ["--rollout.correction_band", "[0.9, 1.1]"]),
    "bypass-bf16_true-first_pass": ("bypass", "bf16-true", ["--ppo.micro_batch_size", "4"]),
    "bypass-bf16_true-minibatches": (
        "bypass",
        "bf16-true",
        ["--ppo.mini_batch_size", "2", "--ppo.micro_batch_size", "1"],
    ),
}


@pytest.mark.parametrize("name", list(PPO_RUNS))
def test_ppo_runs_each_mode(name, assets, tmp_path, capsys, monkeypatch):
    """Each mode trains; a bfloat16 decode (rollout.precision) of this float32 run says at its start
    that a CPU without bfloat16 products emulates it (the check stood in for: every CPU runs it)."""
    monkeypatch.setattr(host, "bfloat16_instructions", lambda: False)
    mode, precision, more = PPO_RUNS[name]
    run_dir = tmp_path / "run"
    cfg = ppo_config(assets.policy("llama"), assets.prompts, run_dir)
    args = ["--rollout.correction", mode, *more]
    if precision:
        args += ["--rollout.precision", precision]
    assert ppo_main(cfg, *args) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    said = [
        line for line in (out.out + out.err).splitlines() if "without bfloat16 products" in line
    ]
    assert len(said) == (precision is not None), said
    if said:
        assert f"proximal ppo: rollout.precision = {precision} on a CPU without" in said[0], said
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    _check_rows(rows, mode, precision)


# ----------------------------------------------------------------------------------------------
# rollout.replay_filter: π_old and π_θ on the engine's truncated support
# ----------------------------------------------------------------------------------------------

REPLAY_RUNS = {
    # (command, replay, more arguments): GRPO's one-step path (π_old = the update's forward) with
    # and without the replay; the experience's π_old pass with the KL in the rewards; PPO's first
    # pass and its experience pass
    "grpo-replay": ("grpo", True, []),
    "grpo-no_replay": ("grpo", False, []),
    "grpo-replay-iterations-kl_reward": (
        "grpo",
        True,
        ["--grpo.iterations", "2", "--grpo.kl", "reward"],
    ),
    "ppo-replay-first_pass": ("ppo", True, ["--ppo.micro_batch_size", "4"]),
    "ppo-replay": ("ppo", True, []),
}


@pytest.mark.parametrize("name", list(REPLAY_RUNS))
def test_replay_filter_measures_the_engine_alone(name, assets, tmp_path, capsys):
    """top_p 0.8, float32, the same weights: μ is the truncated distribution's log-probability, so
    with the filter replayed π_old = μ up to round-off (mismatch ~0), and without it π_old/μ
    carries the truncation, −log(kept mass) at every token (clearly > 0)."""
    command, replay, more = REPLAY_RUNS[name]
    make, main = (grpo_config, grpo_main) if command == "grpo" else (ppo_config, ppo_main)
    run_dir = tmp_path / "run"
    cfg = make(assets.policy("llama"), assets.prompts, run_dir)
    args = ["--rollout.top_p", "0.8", "--rollout.replay_filter", str(replay).lower(), *more]
    assert main(cfg, *args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert ("rollout.replay_filter needs whole vocabulary rows" in out) == replay
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        if replay:
            assert abs(r["rollout/mismatch_k1"]) < 1e-6, r["rollout/mismatch_k1"]
            assert r["rollout/mismatch_k3"] < 1e-10
            assert abs(math.log(r["rollout/ratio_min"])) < 1e-5
        else:  # measured ~0.2 nats a token on this nearly flat policy
            assert r["rollout/mismatch_k1"] > 0.05, r["rollout/mismatch_k1"]
            assert r["rollout/ratio_max"] < 1.0  # π_old < μ at every token: mass was dropped
    # The KL to the reference stays on the full softmax: at step 1 the policy is the reference, so
    # it is 0 up to round-off (a filtered π_old or π_θ against the full π_ref would give ~0.2 nats
    # a token: k3 ≈ 0.02, PPO's sequence KL ≈ 1.6).
    if command == "ppo":
        assert abs(rows[0]["kl/seq_mean"]) < 1e-5, rows[0]["kl/seq_mean"]
    elif not more:  # one optimiser step: its π_θ is the reference
        assert rows[0]["kl/ref_k3"] < 1e-10, rows[0]["kl/ref_k3"]


def test_replay_keeps_pi_old_for_the_kl_on_the_full_softmax(assets):
    """compute_experience with a filter: old_logprobs replay it, old_full_logprobs (what the KL
    terms read, Experience.old_unfiltered) are the full softmax's — the unfiltered pass's values."""
    from proximal.rollout.experience import compute_experience

    model = AutoModelForCausalLM.from_pretrained(assets.policy("llama")).eval()
    tok = assets.tokenizer
    enc = tok(["aab", "ba"], return_tensors="pt", padding=True, padding_side="left")
    r = sample(
        HFEngine(model, tok.pad_token_id),
        tok,
        enc.input_ids,
        enc.attention_mask.bool(),
        seeds=[1, 2],
        max_new_tokens=6,
        temperature=0.9,
        top_p=0.8,
        logprobs=True,
    )
    args = dict(actor=model, temperature=0.9, micro_batch_size=1)
    plain = compute_experience(r, torch.zeros(2), torch.ones(2, dtype=torch.bool), **args)
    replay = compute_experience(
        r, torch.zeros(2), torch.ones(2, dtype=torch.bool), filter=(0, 0.8), **args
    )
    m = r.response_mask
    assert plain.old_full_logprobs is None and plain.old_unfiltered is plain.old_logprobs
    torch.testing.assert_close(replay.old_full_logprobs, plain.old_logprobs, rtol=0, atol=1e-6)
    assert replay.old_unfiltered is replay.old_full_logprobs
    torch.testing.assert_close(replay.old_logprobs[m], r.behaviour_logprobs[m], rtol=0, atol=1e-5)
    assert float((replay.old_logprobs - plain.old_logprobs)[m].min()) > 1e-3


# ----------------------------------------------------------------------------------------------
# The weights on the update's loss, on a fixed batch
# ----------------------------------------------------------------------------------------------

# the ratio π_old/μ planted on each valid token, by position: away from every band edge and cap
RATIOS = [0.3, 0.97, 1.0, 1.4, 2.6, 1.003, 0.6, 1.9]


@pytest.fixture(scope="module")
def fixed(assets):
    """A real rollout of the tiny policy (float32), its π_old, advantages, and μ = π_old − log ρ
    with ρ planted per token."""
    tok = assets.tokenizer
    model = AutoModelForCausalLM.from_pretrained(assets.policy("llama")).eval()
    enc = [tok(p, add_special_tokens=False).input_ids for p in ["ab 1", "c 2", "dd 3", "e 4"]]
    P = max(map(len, enc))
    ids = torch.tensor([[tok.pad_token_id] * (P - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (P - len(e)) + [1] * len(e) for e in enc])
    r = sample(
        HFEngine(model, tok.pad_token_id), tok, ids, mask, seeds=[0, 1, 2, 3], max_new_tokens=8
    )
    old = sequence_token_logprobs(model, r, 1.0, 4)
    m = r.response_mask
    rho = torch.tensor(RATIOS)[: m.shape[1]].expand_as(old)
    mu = torch.where(m, old - rho.log(), 0.0)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    return model, r, old, mu, rho, adv


def _update(model, r, old, mu, adv, mode, band, *, given_old: bool):
    """grpo_update as the trainer calls it: π_old in the experience (``given_old``) or not (one
    optimiser step); bypass replaces it by μ (and the first forward is recorded)."""
    if mode == "bypass":
        logprobs, given_old = mu, False
    else:
        logprobs = old if given_old else None
    exp = Experience(
        r,
        torch.zeros(len(r)),
        torch.ones(len(r), dtype=torch.bool),
        old_logprobs=logprobs,
        behaviour_logprobs=mu,
        advantages=adv,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return grpo_update(
        exp,
        GRPOUpdate(
            aggregation="token-mean",
            iterations=1,
            mini_batch_size=len(r),
            micro_batch_size=2,
            clip_eps=0.2,
            clip_eps_high=None,
            beta=0.0,
            temperature=1.0,
            max_length=r.response_ids.shape[1],
            max_grad_norm=1.0,
            correction=mode,
            correction_cap=2.0,
            correction_band=band,
        ),
        actor=Trained(model, opt, sched),
        shuffle_seed=0,
        record_first_step=not given_old,
    )


@pytest.mark.parametrize("given_old", [True, False], ids=["pi_old_in_experience", "one_step"])
def test_each_mode_weights_the_loss_as_its_formula_says(fixed, given_old):
    """At the first step π_θ = π_old, so the token-mean loss is −Σ w_{i,t}·Â_i / N with each mode's
    w from the planted ratios, written out here by hand in plain Python."""
    model, r, old, mu, rho, adv = fixed
    m = r.response_mask
    cells = [
        (i, float(rho[i, t]), float(adv[i]))
        for i in range(len(r))
        for t in range(m.shape[1])
        if m[i, t]
    ]
    N = len(cells)
    assert N > 10 and len({x for _, x, _ in cells}) > 4

    def geo(i):  # row i's geometric-mean ratio
        logs = [math.log(x) for j, x, _ in cells if j == i]
        return math.exp(sum(logs) / len(logs))

    weight = {
        "none": lambda i, x: 1.0,
        "bypass": None,  # the ratio is π_θ/μ = ρ: the surrogate's clip binds
        "tis": lambda i, x: min(x, 2.0),
        "token_mask": lambda i, x: x if 0.5 <= x <= 2.0 else 0.0,
        "seq_mask": lambda i, x: 1.0 if 0.9 <= geo(i) <= 1.1 else 0.0,
    }
    bands = {"seq_mask": [0.9, 1.1]}
    for mode, w in weight.items():
        update = _update(model, r, old, mu, adv, mode, bands.get(mode), given_old=given_old)
        if w is None:  # −min(ρ·Â, clip(ρ, 0.8, 1.2)·Â)
            want = -sum(min(x * a, min(max(x, 0.8), 1.2) * a) for _, x, a in cells) / N
        else:
            want = -sum(w(i, x) * a for i, x, a in cells) / N
        got = update["stats"]["loss/policy"]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), mode
        if not given_old or mode == "bypass":  # the update's first forward is π_old on every row
            first, rows = update["first_step"]
            assert bool(rows.all())
            torch.testing.assert_close(first[m], old[m], rtol=0, atol=1e-5)
    # the sequence mode keeps some rows and drops others here
    assert 0 < sum(0.9 <= geo(i) <= 1.1 for i in range(len(r))) < len(r)


# ----------------------------------------------------------------------------------------------
# Config mistakes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--rollout.correction", "icepop"],
            "rollout.correction: 'icepop' is not one of None, 'off', 'tis'",
        ),
        (["--rollout.precision", "fp8"], "rollout.precision: 'fp8' is not one of"),
        (["--rollout.correction_cap", "0.5"], "rollout.correction_cap = 0.5 must lie in [1, ∞)"),
        (
            ["--rollout.correction_band", "[1.2, 2]"],
            "rollout.correction_band = [1.2, 2.0]: correction_band_low = 1.2 must lie in (0, 1]",
        ),
        (["--rollout.correction_band", "[0.5]"], "two numbers [lo, hi]"),
        (
            ["--rollout.engine", "vllm", "--rollout.top_p", "0.9"],
            "rollout.engine = vllm with rollout.top_p = 0.9, rollout.top_k = 0: vLLM's "
            "log-probabilities μ are those of the truncated distribution; set "
            "rollout.replay_filter: true, or rollout.top_p: 1 and rollout.top_k: 0",
        ),
        (
            ["--rollout.precision", "bf16-mixed", "--train.precision", "bf16-true"],
            "rollout.precision = bf16-mixed with train.precision = bf16-true: the weights are "
            "bfloat16 already",
        ),
    ],
)
@pytest.mark.parametrize("command", ["grpo", "ppo"])
def test_bad_correction_config_is_one_line_and_exit_2(
    command, args, message, assets, tmp_path, capsys
):
    make, main = (grpo_config, grpo_main) if command == "grpo" else (ppo_config, ppo_main)
    cfg = make(assets.policy("llama"), assets.prompts, tmp_path / "run")
    assert main(cfg, *args) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_vllm_with_a_filter_needs_the_replay():
    """vLLM's μ is the truncated distribution's: with top-p/top-k its π_old must replay the
    filter (or sample unfiltered); the hf engine may sample filtered without it (the gap then shows
    in rollout/mismatch_*)."""
    from proximal.trainers.grpo_config import GRPOConfig

    def said(**rollout) -> list[str]:
        cfg = GRPOConfig()
        for k, v in rollout.items():
            setattr(cfg.rollout, k, v)
        return [p for p in cfg.validate() if "replay_filter" in p]

    assert len(said(engine="vllm", top_k=5)) == 1
    assert said(engine="vllm", top_k=5)[0].startswith(
        "rollout.engine = vllm with rollout.top_p = 1.0, rollout.top_k = 5"
    )
    assert not said(engine="vllm", top_k=5, replay_filter=True)
    assert not said(engine="vllm")
    assert not said(engine="hf", top_p=0.9)


def test_bf16_true_with_several_processes_is_refused(monkeypatch):
    from proximal import dist
    from proximal.trainers.grpo_config import GRPOConfig

    cfg = GRPOConfig()
    cfg.rollout.precision = "bf16-true"
    monkeypatch.setattr(dist, "launched_world_size", lambda: 2)
    assert any("rollout.precision = bf16-true needs one process" in p for p in cfg.validate()), (
        cfg.validate()
    )
    cfg.rollout.precision = "bf16-mixed"
    assert not any("rollout.precision" in p for p in cfg.validate())


def test_bf16_true_resume_samples_from_the_restored_weights(assets, tmp_path, capsys):
    """The engine's bfloat16 copy is built before the checkpoint is restored: the resumed run's first
    rollout must come from the restored policy, so the run after the checkpoint matches the
    uninterrupted one (CPU, float32 training: bitwise)."""
    from ppo_support import without_timing

    def run(name: str, steps: int) -> list[dict]:
        cfg = grpo_config(
            assets.policy("llama"),
            assets.prompts,
            tmp_path / name,
            rollout={"precision": "bf16-true", "correction": "tis"},
            train={"steps": steps, "save_every": 1},
            optim={"lr": 1e-2},
        )
        assert grpo_main(cfg) == 0, capsys.readouterr().err
        return read_jsonl(tmp_path / name / "metrics.jsonl")

    full = run("full", 2)
    run("part", 1)
    cfg = grpo_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / "part",
        rollout={"precision": "bf16-true", "correction": "tis"},
        train={"steps": 2, "save_every": 1},
        optim={"lr": 1e-2},
    )
    assert grpo_main(cfg, "--resume", str(tmp_path / "part")) == 0, capsys.readouterr().err
    resumed = read_jsonl(tmp_path / "part" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2]
    assert without_timing(resumed[1]) == without_timing(full[1])


def _rollout_rows_on_rank(cfg: dict, tmp) -> list[dict]:
    from grpo_support import train_config

    from proximal import dist
    from proximal.trainers import grpo

    grpo.train(train_config(cfg, tmp / f"rank{dist.rank()}.yaml"))
    return read_jsonl(tmp / "run" / "metrics.jsonl") if dist.rank() == 0 else []


def _gather_on_rank() -> tuple:
    import torch

    from proximal import dist
    from proximal.train.correction import FirstStepLogprobs

    rec = FirstStepLogprobs(4, 3, torch.device("cpu"))
    r = dist.rank()  # rank r passes rows r and r + 2, two of their positions (as trimmed)
    rec.put(torch.tensor([r, r + 2]), torch.tensor([[-1.0 - r, -2.0], [-3.0, -4.0 - r]]))
    lp, rows = rec.gathered()
    return lp, rows


def test_first_step_logprobs_are_gathered_over_processes(assets, tmp_path):
    """Each rank writes the rows it passed; every rank gets all of them, exactly. And GRPO's one-step
    path with bypass (the rollout/* metrics read the update's first forward) runs on 2 processes."""
    from multiproc import run_ranks

    want = torch.tensor(
        [[-1.0, -2.0, 0.0], [-2.0, -2.0, 0.0], [-3.0, -4.0, 0.0], [-3.0, -5.0, 0.0]]
    )
    for lp, rows in run_ranks(2, _gather_on_rank):
        assert torch.equal(lp, want) and bool(rows.all())
    [lp, rows] = run_ranks(1, _gather_on_rank)[0]
    assert rows.tolist() == [True, False, True, False]

    cfg = grpo_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / "run",
        rollout={"correction": "bypass", "precision": "bf16-mixed"},
        grpo={"micro_batch_size": 2},
        train={"steps": 1},
    )
    rows = run_ranks(2, _rollout_rows_on_rank, cfg, tmp_path, timeout_s=120)[0]
    _check_rows(rows, "bypass", "bf16-mixed")
