"""The GRPO update as the real trainer runs it: micro-batch accumulation and 1-vs-2 processes compute
the same step (the normaliser is the whole mini-batch's), tokens after a stop never reach a gradient,
π_old is the policy that sampled for every one of μ iterations, and the first on-policy update has
ratio 1."""

from __future__ import annotations

import pytest
import torch
from grpo_support import grpo_config, read_jsonl, record_gradients, train_config
from ppo_support import TIMING_PREFIXES, without_timing

from proximal.rollout.sampling import Rollout, stop_mask

T = 6


# An untrained policy rarely writes EOS, so most responses would run to T and every aggregation would
# weigh tokens alike; stopping at two common letters gives responses of many lengths.
VARIED_LENGTHS = {"stop_strings": ["a", "b"]}


def _one_step(
    assets,
    tmp_path,
    monkeypatch,
    name: str,
    rollout: dict | None = None,
    model: dict | None = None,
    **sections,
):
    """One GRPO step (8 responses: 2 prompts × G = 4); returns the recorded gradients and the metrics row."""
    from proximal.trainers import grpo

    grads = record_gradients(monkeypatch)
    cfg = grpo_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / name,
        train={"steps": 1},
        rollout={"max_new_tokens": T, **(rollout or {})},
        model=model or {},
        **sections,
    )
    grpo.train(train_config(cfg, tmp_path / f"{name}.yaml"))
    [row] = read_jsonl(tmp_path / name / "metrics.jsonl")
    return grads, without_timing(row)


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo"])
def test_micro_batch_accumulation_gives_the_whole_batch_gradient(
    loss, assets, tmp_path, monkeypatch
):
    """Micro-batches of 1 response vs the whole batch at once: the same optimiser steps (two
    mini-batches of 4) up to float32 round-off — the loss of a micro-batch is normalised by the
    aggregation's count over its whole mini-batch, not its own (huggingface/trl#3938)."""
    runs = {}
    for micro in (1, 4):
        with pytest.MonkeyPatch.context() as mp:
            runs[micro] = _one_step(
                assets,
                tmp_path,
                mp,
                f"{loss}-{micro}",
                rollout=VARIED_LENGTHS,
                model={"reward_functions": ["ppo_support:length"]},
                grpo={"loss": loss, "mini_batch_size": 4, "micro_batch_size": micro, "beta": 0.1},
            )
    (g1, row1), (g4, row4) = runs[1], runs[4]
    assert len(g1) == len(g4) == 2
    for step1, step4 in zip(g1, g4):
        norm = torch.sqrt(sum((g**2).sum() for g in step4))
        assert norm > 1e-3  # a real gradient to compare
        for a, b in zip(step1, step4):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for k in (
        "loss/total",
        "loss/policy",
        "loss/kl",
        "policy/clipfrac_high",
        "kl/ref_k3",
        "grad_norm/actor",
    ):
        assert row1[k] == pytest.approx(row4[k], rel=1e-4, abs=1e-7), k


# ----------------------------------------------------------------------------------------------
# Tokens after a stop never influence a gradient
# ----------------------------------------------------------------------------------------------


def _fixed_rollout(tok, variant: str):
    """A ``sample`` replacement: fixed responses whose EOS sits at t = 1, none, 3, 0, … by row; after the
    stop, pad ("pad", what ``sample`` gives) or other tokens ("junk"); "pre" changes one token before
    a stop (the control: that must change the gradients)."""
    letters = tok("abcdefgh", add_special_tokens=False).input_ids

    def fake_sample(engine, tokenizer, prompt_ids, prompt_mask, **kwargs):
        g = torch.Generator().manual_seed(123)
        B = prompt_ids.shape[0]
        resp = torch.tensor(letters)[torch.randint(len(letters), (B, T), generator=g)]
        for b in range(B):
            stop = [1, T, 3, 0][b % 4]
            if stop < T:
                resp[b, stop] = tok.eos_token_id
        mask, ended = stop_mask(resp, [tok.eos_token_id])
        if variant == "junk":
            junk = torch.tensor(letters + [tok.eos_token_id])[
                torch.randint(len(letters) + 1, (B, T), generator=g)
            ]
            resp = torch.where(mask, resp, junk)
        else:
            resp = torch.where(mask, resp, tok.pad_token_id)
        if variant == "pre":
            resp[2, 0] = letters[0] if resp[2, 0] != letters[0] else letters[1]
        return Rollout(prompt_ids, prompt_mask, resp, mask, ended)

    return fake_sample


@pytest.fixture(scope="module")
def fixed_rollout_runs(assets, tmp_path_factory):
    from proximal.rollout import collect

    out = {}
    for variant in ("pad", "junk", "pre"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(collect, "sample", _fixed_rollout(assets.tokenizer, variant))
            out[variant] = _one_step(
                assets,
                tmp_path_factory.mktemp("fixed"),
                mp,
                variant,
                grpo={"iterations": 2, "mini_batch_size": 4, "micro_batch_size": 2, "beta": 0.1},
            )
    return out


def test_tokens_after_the_stop_never_change_gradients(fixed_rollout_runs):
    grads_pad, row_pad = fixed_rollout_runs["pad"]
    grads_junk, row_junk = fixed_rollout_runs["junk"]
    assert len(grads_pad) == len(grads_junk) == 4  # μ = 2 iterations × 2 mini-batches
    for i, (a, b) in enumerate(zip(grads_pad, grads_junk)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"optimiser step {i}: gradients differ"
    assert row_pad == row_junk  # scores, advantages, losses, KL, lengths: bitwise the same


def test_a_token_before_the_stop_does_change_gradients(fixed_rollout_runs):
    grads_pad, row_pad = fixed_rollout_runs["pad"]
    grads_pre, row_pre = fixed_rollout_runs["pre"]
    assert not all(torch.equal(x, y) for a, b in zip(grads_pad, grads_pre) for x, y in zip(a, b))
    assert row_pad["loss/total"] != row_pre["loss/total"]


# ----------------------------------------------------------------------------------------------
# π_old over μ iterations; the first on-policy update
# ----------------------------------------------------------------------------------------------


def test_every_iteration_ratios_against_the_policy_that_sampled(assets, tmp_path, monkeypatch):
    """μ = 3 iterations of one optimiser step each on the whole batch: every call sees the same
    log π_old (recorded once, in the experience), the first has ratio 1 (up to the round-off of
    recomputing the same forward), the later ones ratio against the old policy, not the last update."""
    from proximal.trainers import grpo

    calls = []
    loss_fn = grpo.grpo_policy_loss

    def spy(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
        out = loss_fn(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw)
        rows = torch.where(mask, old_logprobs, 0.0).sum(1)
        calls.append((sorted(rows.tolist()), out[1]))
        return out

    monkeypatch.setattr(grpo, "grpo_policy_loss", spy)
    _, row = _one_step(
        assets,
        tmp_path,
        monkeypatch,
        "mu",
        optim={"lr": 1e-2},
        grpo={"iterations": 3, "micro_batch_size": 8, "beta": 0.0},
    )
    assert len(calls) == 3 and row["policy/optimizer_steps"] == 3
    first, *later = calls
    for old_rows, _ in later:
        assert old_rows == pytest.approx(first[0], abs=1e-6)  # the same π_old, not refreshed
    stats = first[1]
    assert float(stats["ratio_min"]) == pytest.approx(1.0, abs=1e-5)
    assert float(stats["ratio_max"]) == pytest.approx(1.0, abs=1e-5)
    assert float(stats["clipfrac_low"]) == float(stats["clipfrac_high"]) == 0.0
    assert (
        float(later[-1][1]["approx_kl"]) > float(later[0][1]["approx_kl"]) > 1e-6
    )  # drifting from π_old


# ----------------------------------------------------------------------------------------------
# 1 process vs 2
# ----------------------------------------------------------------------------------------------


def _train_on_rank(cfg: dict, tmp) -> tuple[list, list]:
    from proximal import dist
    from proximal.trainers import grpo

    grads = grpo.clip_and_step.grads  # the recording wrapper's list, inherited through fork
    grads.clear()
    grpo.train(train_config(cfg, tmp / f"rank{dist.rank()}.yaml"))
    rows = read_jsonl(tmp / "run" / "metrics.jsonl") if dist.rank() == 0 else []
    return [[g.clone() for g in step] for step in grads], rows


def test_one_and_two_processes_compute_the_same_steps(assets, tmp_path, monkeypatch):
    """The same two steps (μ = 2 iterations of 2 mini-batches; DAPO's token-mean, whose normaliser a
    per-rank count would get wrong; the length reward, so the advantages are not zero) on one process
    and on two forked gloo ranks with FSDP2. The rollouts agree exactly (per-row seeded sampling),
    so does every count; gradients and losses agree to float32 round-off of different reduction
    orders. Compared: every optimiser step's full
    gradient (sharper than the weights, which AdamW's 1/√v makes sensitive to round-off on
    near-zero gradients) at rtol 1e-4, and the logged losses and norms at rel 1e-4."""
    from multiproc import run_ranks

    from proximal.trainers import grpo

    grads = record_gradients(monkeypatch)
    grpo.clip_and_step.grads = grads

    def config(name):
        return grpo_config(
            assets.policy("llama"),
            assets.prompts,
            tmp_path / name / "run",
            grpo={
                "loss": "dapo",
                "iterations": 2,
                "mini_batch_size": 4,
                "micro_batch_size": 1,
                "beta": 0.1,
            },
            rollout=VARIED_LENGTHS,
            # scores that differ within a group: under frac_a and these stop strings every group was
            # uniform (every advantage 0) and only the KL term reached the gradient
            model={"reward_functions": ["ppo_support:length"]},
            optim={"lr": 1e-2},
            train={"steps": 2},
        )

    (tmp_path / "one").mkdir()
    one_grads, one_rows = _train_on_rank(config("one"), tmp_path / "one")
    (tmp_path / "two").mkdir()
    [(two_grads, two_rows), (other_grads, _)] = run_ranks(
        2, _train_on_rank, config("two"), tmp_path / "two", timeout_s=180
    )
    assert len(one_grads) == len(two_grads) == len(other_grads) == 2 * 2 * 2
    for i, (a, b, c) in enumerate(zip(one_grads, two_grads, other_grads)):
        for x, y, z in zip(a, b, c):
            assert torch.equal(y, z)  # both ranks hold the same full gradient
            torch.testing.assert_close(
                x, y, rtol=1e-4, atol=1e-6, msg=lambda m: f"optimiser step {i}: {m}"
            )
    assert (
        1.5 < one_rows[0]["response/length_mean"] < 6
    )  # responses of many lengths: the normaliser matters
    # The policy term is in every step's gradient (measured: no uniform group, clipfrac 0.24, 0.43).
    for r in one_rows:
        assert r["data/uniform_group_frac"] < 1 and r["advantage/max"] > 0, r
        assert r["policy/clipfrac"] > 0, r  # the second iteration is off-policy and clips
    for r1, r2 in zip(one_rows, two_rows):
        for k, v in r1.items():
            if k.startswith(TIMING_PREFIXES) or not isinstance(v, (int, float)):
                continue
            if k.startswith(("score/", "data/", "response/")) or k in (
                "step",
                "policy/optimizer_steps",
            ):
                assert r2[k] == pytest.approx(v, abs=1e-6), k  # the same rollouts, the same counts
            else:
                assert r2[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
