"""The KL controller inside the real loop (docs/formulas.md, "Per-token KL shaping and the KL
controllers"): β is updated once per rollout batch from the
batch's mean sequence KL, and the logged β sequence is exactly the rule applied to the logged KL."""

from __future__ import annotations

import pytest
from ppo_support import ppo_main, read_jsonl, tiny_config

BETA0, TARGET, K_BETA, HORIZON = 0.1, 0.05, 0.2, 40


def _adaptive(beta: float, d: float) -> float:
    """The piecewise rule, written out from docs/formulas.md."""
    if d > 1.5 * TARGET:
        return beta * (1 + K_BETA)
    if d < TARGET / 1.5:
        return beta * (1 - K_BETA)
    return beta


def _proportional(beta: float, d: float, n: int = 4) -> float:
    """Ziegler et al. (2019): e = clip(d / d_targ − 1, ±0.2), β ← β·(1 + e·n / horizon), n samples."""
    e = min(max(d / TARGET - 1, -0.2), 0.2)
    return beta * (1 + e * n / HORIZON)


@pytest.mark.parametrize("controller", ["adaptive", "proportional"])
def test_logged_beta_follows_the_controller_rule(controller, assets, tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        run_dir,
        kl={
            "controller": controller,
            "beta": BETA0,
            "target": TARGET,
            "k_beta": K_BETA,
            "horizon": HORIZON,
        },
        optim={"lr": 2e-2},
        train={"steps": 6},
    )
    assert ppo_main(cfg) == 0, capsys.readouterr().err
    rows = read_jsonl(run_dir / "metrics.jsonl")
    rule = _adaptive if controller == "adaptive" else _proportional
    beta = BETA0
    for r in rows:
        assert r["kl/beta"] == beta, (
            f"step {r['step']}: β used {r['kl/beta']}, the rule gives {beta}"
        )
        beta = rule(beta, r["kl/seq_mean"])
        assert r["kl/beta_next"] == beta
    # Both directions happened, so the comparison covered more than one branch of the rule.
    betas = [r["kl/beta"] for r in rows] + [rows[-1]["kl/beta_next"]]
    assert any(b > a for a, b in zip(betas, betas[1:])), betas
    assert any(b < a for a, b in zip(betas, betas[1:])), betas
