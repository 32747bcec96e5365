"""Credit across observation spans: GAE over the agent's tokens only, rewards on the right tokens.

The MDP of a multi-turn trajectory has the agent's tokens as its steps; an observation span is
not a step. :func:`proximal.core.advantages.gae` with the agent mask as ``response_mask`` carries
the next agent token's value and advantage across the span — the same numbers as single-turn GAE
over the agent tokens alone, concatenated.
"""

from __future__ import annotations

import pytest
import torch

from proximal.agents.trajectory import Trajectory, Turn, to_rollout, turn_rewards
from proximal.core.advantages import gae, shape_rewards

F64 = torch.float64
GAMMA, LAM = 0.9, 0.8

# Two turns: agent tokens at 0, 1 (turn 1) and 4, 5 (turn 2); 2, 3 are an observation.
MASK = torch.tensor([[True, True, False, False, True, True]])
AGENT = [0, 1, 4, 5]
R = torch.tensor([[0.0, 0.5, 7.0, -3.0, 0.0, 1.0]], dtype=F64)  # 7, -3 at the hole: never read
V = torch.tensor([[0.2, 0.4, 9.0, 5.0, 0.1, 0.3]], dtype=F64)


def test_two_turn_gae_by_hand():
    """γ = 0.9, λ = 0.8 (γλ = 0.72), on the agent steps 0, 1, 4, 5 in order:
    t=5: δ = 1.0 − 0.3 = 0.7                      Â = 0.7
    t=4: δ = 0 + 0.9·0.3 − 0.1 = 0.17             Â = 0.17 + 0.72·0.7 = 0.674
    t=1: δ = 0.5 + 0.9·0.1 − 0.4 = 0.19           Â = 0.19 + 0.72·0.674 = 0.67528
    t=0: δ = 0 + 0.9·0.4 − 0.2 = 0.16             Â = 0.16 + 0.72·0.67528 = 0.6462016
    (t=1 bootstraps from V at t=4, the next agent token, across the observation.)"""
    adv, ret = gae(R, V, MASK, GAMMA, LAM)
    expected = torch.tensor([[0.6462016, 0.67528, 0.0, 0.0, 0.674, 0.7]], dtype=F64)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    returns = torch.tensor([[0.8462016, 1.07528, 0.0, 0.0, 0.774, 1.0]], dtype=F64)
    torch.testing.assert_close(ret, returns, rtol=0, atol=1e-12)


def test_equals_single_turn_gae_on_the_agent_tokens_concatenated():
    adv, ret = gae(R, V, MASK, GAMMA, LAM)
    compact = torch.ones(1, len(AGENT), dtype=torch.bool)
    adv1, ret1 = gae(R[:, AGENT], V[:, AGENT], compact, GAMMA, LAM)
    assert torch.equal(adv[:, AGENT], adv1) and torch.equal(ret[:, AGENT], ret1)
    assert torch.equal(adv[:, [2, 3]], torch.zeros(1, 2, dtype=F64))


def test_values_and_rewards_at_observations_change_nothing():
    g = torch.Generator().manual_seed(0)
    adv, ret = gae(R, V, MASK, GAMMA, LAM)
    hole = ~MASK
    R2 = torch.where(hole, torch.randn(R.shape, generator=g, dtype=F64) * 100, R)
    V2 = torch.where(hole, torch.randn(V.shape, generator=g, dtype=F64) * 100, V)
    adv2, ret2 = gae(R2, V2, MASK, GAMMA, LAM)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    # Control: with the mask off (every position a step) the same change moves the advantages —
    # the test above could fail.
    on = torch.ones_like(MASK)
    assert not torch.equal(gae(R, V, on, GAMMA, LAM)[0], gae(R2, V2, on, GAMMA, LAM)[0])


def test_zeroing_the_span_instead_cuts_the_chain():
    """The alternatives docs/agents.md sets aside: running the recursion through the span with
    zero value and reward there (OpenRLHF's way) gives other advantages before the span."""
    through = torch.ones_like(MASK)
    zeroed = gae(torch.where(MASK, R, 0.0), torch.where(MASK, V, 0.0), through, GAMMA, LAM)[0]
    ours = gae(R, V, MASK, GAMMA, LAM)[0]
    assert torch.equal(zeroed[:, 4:], ours[:, 4:])  # after the last span: the same
    # before it, the span's zeros enter the chain: Â_3 = 0.9·0.1 + 0.72·0.674 = 0.57528,
    # Â_2 = 0 + 0.72·0.57528 = 0.4142016, and δ_1 = 0.5 + 0.9·0 − 0.4 = 0.1 (the span's value is 0),
    # Â_1 = 0.1 + 0.72·0.4142016 = 0.398225152 (ours: 0.67528)
    assert zeroed[0, 1].item() == pytest.approx(0.398225152, abs=1e-12)
    assert not torch.equal(zeroed[:, :2], ours[:, :2])


def _two_turn_trajectories() -> list[Trajectory]:
    # Row 0: agent 10 11 | obs 50 51 | agent 12 13; turn rewards 0.25 and 0.5.
    a = Trajectory(
        [1, 2, 3],
        ids=[10, 11, 50, 51, 12, 13],
        agent_mask=[True, True, False, False, True, True],
        turns=[
            Turn(0, 2, "ab", 0.25, [{"role": "user", "content": "x"}], 4),
            Turn(4, 6, "cd", 0.5),
        ],
        ended=True,
        stop="done",
    )
    # Row 1: one turn of three agent tokens, no turn reward, shorter prompt.
    b = Trajectory([4], ids=[14, 15, 16], agent_mask=[True] * 3, turns=[Turn(0, 3, "e")])
    return [a, b]


def test_to_rollout_masks_and_attention():
    r = to_rollout(_two_turn_trajectories(), pad_id=0)
    assert r.prompt_ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert r.response_ids.tolist() == [[10, 11, 50, 51, 12, 13], [14, 15, 16, 0, 0, 0]]
    assert r.response_mask.tolist() == [
        [True, True, False, False, True, True],
        [True, True, True, False, False, False],
    ]
    # the observation tokens are attended to (later agent tokens read them); padding is not
    assert r.attention_mask.tolist() == [[1] * 9, [0, 0, 1, 1, 1, 1, 0, 0, 0]]
    assert r.ended.tolist() == [True, False]
    one = r.select(torch.tensor([1]))  # trimmed to its last real token, not its agent count
    assert one.response_ids.tolist() == [[14, 15, 16]] and one.prompt_ids.tolist() == [[4]]


def test_rewards_land_on_the_last_agent_token_of_their_turn():
    trajs = _two_turn_trajectories()
    r = to_rollout(trajs, pad_id=0)
    T = r.response_ids.shape[1]
    per_turn = turn_rewards(trajs, T, dtype=F64)
    assert per_turn.tolist() == [[0, 0.25, 0, 0, 0, 0.5], [0] * 6]
    zeros = torch.zeros(2, T, dtype=F64)
    shaped, _ = shape_rewards(
        torch.tensor([2.0, 3.0], dtype=F64), zeros, zeros, r.response_mask, 0.1
    )
    # the outcome score on the last agent token: column 5 of row 0, column 2 of row 1
    assert shaped.tolist() == [[0, 0, 0, 0, 0, 2.0], [0, 0, 3.0, 0, 0, 0]]
