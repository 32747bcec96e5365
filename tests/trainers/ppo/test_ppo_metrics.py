"""What the logged metrics mean: identities between them, and diagnostics that stay defined."""

from __future__ import annotations

import math

import pytest
import torch
from ppo_support import read_jsonl, tiny_config, write_yaml

from proximal.config import load_config
from proximal.rollout import collect
from proximal.rollout.sampling import Rollout, stop_mask
from proximal.trainers import ppo


def test_reward_total_is_score_minus_beta_times_kl(llama_run):
    """Σ_t R_t = r_ψ − β·Σ_t KL_t (Ziegler et al. 2019; docs/formulas.md,
    "Per-token KL shaping and the KL controllers"), so the batch means obey the same identity."""
    rows = read_jsonl(llama_run.dir / "metrics.jsonl")
    assert rows[0]["kl/seq_mean"] == 0.0  # step 1: π_θ is still π_ref, bitwise
    # Both sides are float32 sums of at most 9 terms of magnitude below 0.2 (8 response tokens and
    # the score): rounding leaves them ~1e-7 apart at most (measured 5e-9). |β·KL| is 1.8e-3 and
    # 9.1e-3 at steps 2 and 3, so a dropped or sign-flipped KL term is far outside the tolerance.
    tol = 1e-6
    for r in rows:
        beta_kl = r["kl/beta"] * r["kl/seq_mean"]
        if r["step"] > 1:
            assert abs(beta_kl) > 1000 * tol, (r["step"], beta_kl)
        expected = r["score/mean"] - beta_kl
        assert r["reward/total_mean"] == pytest.approx(expected, abs=tol), r["step"]


def test_explained_variance_is_defined_with_one_token_responses(assets, tmp_path, monkeypatch):
    """A batch whose returns vary has a finite explained variance, even when one response is a lone
    EOS (its micro-batch alone has constant returns) and micro-batches hold one sequence."""
    tok = assets.tokenizer
    letters = tok("abcdefgh", add_special_tokens=False).input_ids

    def fake_sample(policy, tokenizer, prompt_ids, prompt_mask, **kwargs):
        B = prompt_ids.shape[0]
        resp = torch.tensor([letters[:6]] * B)
        resp[0, 0] = tok.eos_token_id  # row 0: EOS first, a one-token response
        resp[1, 3] = tok.eos_token_id
        mask, ended = stop_mask(resp, [tok.eos_token_id])
        return Rollout(
            prompt_ids, prompt_mask, torch.where(mask, resp, tok.pad_token_id), mask, ended
        )

    monkeypatch.setattr(collect, "sample", fake_sample)
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / "run",
        rollout={"max_new_tokens": 6},
        ppo={"mini_batch_size": 4, "micro_batch_size": 1},
        train={"steps": 1},
    )
    ppo.train(load_config(ppo.PPOConfig, write_yaml(tmp_path / "run.yaml", cfg)))
    [row] = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    ev = row["value/explained_variance"]
    assert ev is not None and math.isfinite(ev), f"value/explained_variance logged as {ev}"
