"""One update computes the same thing on 1, 2 and 4 processes (FSDP2 over gloo): PPO for every loss
aggregation, SFT and the reward model — with SGD, whose update is linear in the gradient, so the
only difference left is float32 summation order (observed ≤ 1e-7; asserted at 1e-6, the issue's
bound). The ranks' shares hold unequal token counts (responses of 1 to 8 tokens), so a per-rank
normaliser would be caught: it is off by more than 1e-2 here.

Micro-batch accumulation is checked the same way, in one process: micro-batches of 1 and of the
whole mini-batch give the same update.
"""

from __future__ import annotations

import pytest
from dist_support import ppo_update_once, rm_step_once, sft_step_once
from multiproc import run_ranks

ATOL = 1e-6


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize(
    "aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_ppo_update_is_the_same_on_1_2_and_4_processes(aggregation, assets):
    args = (str(assets.policy("llama")), str(assets.reward_model("llama")), aggregation)
    one, two, four = (run_ranks(w, ppo_update_once, *args)[0] for w in (1, 2, 4))
    initial = run_ranks(1, ppo_update_once, *args, mini_batch_size=8, micro_batch_size=8)[0]
    for name in ("actor", "critic"):
        assert _max_diff(one[name], initial[name]) > 1e-3, (
            "the update moved nothing (the test could not fail)"
        )
        assert _max_diff(one[name], two[name]) <= ATOL, f"{name}: W=2 differs from W=1"
        assert _max_diff(one[name], four[name]) <= ATOL, f"{name}: W=4 differs from W=1"
    for key in ("loss/policy", "loss/value", "policy/clipfrac", "policy/entropy"):
        assert two["stats"][key] == pytest.approx(one["stats"][key], abs=1e-6), key
        assert four["stats"][key] == pytest.approx(one["stats"][key], abs=1e-6), key
    assert (
        one["stats"]["policy/clipfrac"] > 0
    )  # the perturbed π_old puts some ratios outside [1 − ε, 1 + ε]


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_ppo_micro_batches_accumulate_to_the_mini_batch(aggregation, assets):
    args = (str(assets.policy("llama")), str(assets.reward_model("llama")), aggregation)
    whole = run_ranks(1, ppo_update_once, *args, micro_batch_size=4)[0]
    split = run_ranks(1, ppo_update_once, *args, micro_batch_size=1)[0]
    for name in ("actor", "critic"):
        assert _max_diff(whole[name], split[name]) <= ATOL, name


SFT_ROWS = [
    {"prompt": p, "response": r}
    for p, r in [
        ("ab 1", "abc"),
        ("c", "a"),
        ("dd 3", "cdefgh"),
        ("hhhhhhh 4", "hh"),
        ("e 5", "b"),
        ("fg", "abcdefg"),
        ("a", "gg"),
        ("bbbbb 8", "defg"),
    ]
]
PAIRS = [
    {"prompt": p, "chosen": r, "rejected": r[::-1] + "a"}
    for p, r in [
        ("ab 1", "abc"),
        ("c", "ab"),
        ("dd 3", "cdefgh"),
        ("hhhhhhh 4", "hhe"),
        ("e 5", "bd"),
        ("fg", "abcdefg"),
        ("a", "gg"),
        ("bbbbb 8", "defg"),
    ]
]


def test_sft_step_is_the_same_on_1_2_and_4_processes_and_micro_batches(assets):
    policy = str(assets.policy("llama"))
    one = run_ranks(1, sft_step_once, policy, SFT_ROWS, 8)[0]
    for w, micro in ((1, 1), (2, 1), (2, 4), (4, 2)):
        other = run_ranks(w, sft_step_once, policy, SFT_ROWS, micro)[0]
        assert _max_diff(one["params"], other["params"]) <= ATOL, (w, micro)
        assert other["loss"] == pytest.approx(one["loss"], abs=1e-6)


def test_rm_step_is_the_same_on_1_2_and_4_processes_and_micro_batches(assets):
    policy = str(assets.policy("llama"))
    one = run_ranks(1, rm_step_once, policy, PAIRS, 8)[0]
    for w, micro in ((1, 1), (2, 1), (2, 4), (4, 2)):
        other = run_ranks(w, rm_step_once, policy, PAIRS, micro)[0]
        assert _max_diff(one["params"], other["params"]) <= ATOL, (w, micro)
        assert other["loss"] == pytest.approx(one["loss"], abs=1e-6)


def test_a_per_rank_normaliser_would_be_caught(assets):
    """The control for the tests above: normalising each rank's loss by its own token count (what
    the trainer must not do) moves the result by far more than the tolerance."""
    import proximal.trainers.ppo as ppo

    args = (str(assets.policy("llama")), str(assets.reward_model("llama")), "token-mean")
    one = run_ranks(1, ppo_update_once, *args)[0]
    original = ppo.aggregation_units

    def per_rank_units(mask, aggregation):  # the count of this rank's share only, times W
        from proximal import dist

        share = mask[
            dist.rank() * (len(mask) // dist.world_size()) : (dist.rank() + 1)
            * (len(mask) // dist.world_size())
        ]
        return original(share, aggregation) * dist.world_size()

    def wrong(*a):
        ppo.aggregation_units = per_rank_units
        return ppo_update_once(*a)

    two_wrong = run_ranks(2, wrong, *args)[0]
    ppo.aggregation_units = original
    assert _max_diff(one["actor"], two_wrong["actor"]) > 100 * ATOL
