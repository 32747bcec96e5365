"""Rollout correction math (proximal/core/correction.py): the μ-vs-π_old mismatch statistics and the
weights of TIS, IcePop's token mask and the geometric-mean sequence mask — hand-worked float64 values
(expected numbers from plain Python arithmetic on the chosen ratios), band edges, garbage at masked
positions, and the no-op at μ = π_old."""

import math

import pytest
import torch
from f64 import F64, INF, NAN, b, close, t  # tests/core/f64.py

from proximal.core import (
    correction_weights,
    grpo_policy_loss,
    mismatch_stats,
    sequence_correction_weights,
    sequence_mask_weights,
    tis_weights,
    token_mask_weights,
)

# Three rows of T = 4. The ratios ρ = π_old/μ chosen per valid token; log μ arbitrary; log π_old =
# log μ + log ρ. Row 1 has two valid tokens, row 2 none; masked positions hold garbage in both.
RATIOS = [[0.25, 1.5, 3.0, 1.0], [0.6, 2.5, NAN, NAN], [NAN] * 4]
MU = [[-1.0, -2.0, -0.5, -3.0], [-0.7, -1.2, INF, -INF], [NAN, INF, 0.0, -1.0]]
MASK = [[True] * 4, [True, True, False, False], [False] * 4]
VALID = [0.25, 1.5, 3.0, 1.0, 0.6, 2.5]  # the valid ratios, row by row


def batch():
    mu = t(MU)
    old = torch.where(b(MASK), mu + t(RATIOS).log(), t(NAN))  # garbage where masked
    return old, mu, b(MASK)


def test_mismatch_stats_by_hand():
    old, mu, mask = batch()
    st = mismatch_stats(old, mu, mask, band=(0.5, 2.0))
    n = len(VALID)
    log_sum = sum(math.log(r) for r in VALID)  # log 1.6875
    close(st["mismatch_k1"], -log_sum / n)
    close(st["mismatch_k3"], (sum(VALID) - n - log_sum) / n)
    close(st["ratio_max"], 3.0)
    close(st["ratio_min"], 0.25)
    # sorted 0.25, 0.6, 1, 1.5, 2.5, 3: position (n − 1)·0.99 = 4.95 → 2.5 + 0.95·(3 − 2.5)
    close(st["ratio_p99"], 2.975)
    close(st["outside_band_frac"], 3 / 6)  # 0.25, 2.5, 3.0
    close(mismatch_stats(old, mu, mask, band=(0.2, 4.0))["outside_band_frac"], 0.0)


def test_tis_weights_by_hand():
    old, mu, mask = batch()
    w, st = tis_weights(old, mu, mask, cap=2.0)
    close(w, [[0.25, 1.5, 2.0, 1.0], [0.6, 2.0, 0.0, 0.0], [0.0] * 4])
    close(st["truncated_frac"], 2 / 6)
    close(st["weight_mean"], (0.25 + 1.5 + 2 + 1 + 0.6 + 2) / 6)
    w3, st3 = tis_weights(old, mu, mask, cap=3.5)  # no ratio above it: w = ρ
    close(w3, [[0.25, 1.5, 3.0, 1.0], [0.6, 2.5, 0.0, 0.0], [0.0] * 4])
    close(st3["truncated_frac"], 0.0)
    assert not w.requires_grad


def test_token_mask_weights_by_hand():
    old, mu, mask = batch()
    w, st = token_mask_weights(old, mu, mask, band=(0.5, 2.0))
    # IcePop: ρ inside [0.5, 2] kept with its weight, outside 0
    close(w, [[0.0, 1.5, 0.0, 1.0], [0.6, 0.0, 0.0, 0.0], [0.0] * 4])
    close(st["masked_frac"], 3 / 6)
    close(st["weight_mean"], (1.5 + 1.0 + 0.6) / 6)
    w2, _ = token_mask_weights(old, mu, mask, band=(0.7, 3.5))
    close(w2, [[0.0, 1.5, 3.0, 1.0], [0.0, 2.5, 0.0, 0.0], [0.0] * 4])


def test_sequence_mask_weights_by_hand():
    old, mu, mask = batch()
    # geometric means: row 0 (0.25·1.5·3·1)^(1/4) = 1.125^(1/4) ≈ 1.0299; row 1 (0.6·2.5)^(1/2) ≈ 1.2247
    assert 1.0 < 1.125**0.25 < 1.1 < 1.5**0.5 < 1.3
    w, st = sequence_mask_weights(old, mu, mask, band=(1.0, 1.1))
    close(w, [[1.0] * 4, [0.0] * 4, [0.0] * 4])
    close(st["masked_seq_frac"], 1 / 2)  # of the two rows with a valid token
    w, st = sequence_mask_weights(old, mu, mask, band=(0.9, 1.3))
    close(w, [[1.0] * 4, [1.0, 1.0, 0.0, 0.0], [0.0] * 4])
    close(st["masked_seq_frac"], 0.0)
    w, st = sequence_mask_weights(old, mu, mask)  # verl's Geo-RS default [0.999, 1.001]
    close(st["masked_seq_frac"], 1.0)


def test_sequence_level_weights_for_gspo_by_hand():
    old, mu, mask = batch()
    g0, g1 = 1.125**0.25, 1.5**0.5  # the rows' geometric-mean ratios; row 2 has no valid token
    close(sequence_correction_weights("tis", old, mu, mask, cap=1.2), [g0, 1.2, 0.0])
    close(sequence_correction_weights("tis", old, mu, mask, cap=2.0), [g0, g1, 0.0])
    close(sequence_correction_weights("token_mask", old, mu, mask, band=(0.9, 1.1)), [g0, 0.0, 0.0])
    close(sequence_correction_weights("token_mask", old, mu, mask), [g0, g1, 0.0])  # [0.5, 2]
    close(sequence_correction_weights("seq_mask", old, mu, mask, band=(1.0, 1.1)), [1.0, 0.0, 0.0])
    close(sequence_correction_weights("seq_mask", old, mu, mask), [0.0, 0.0, 0.0])
    assert sequence_correction_weights("none", old, mu, mask) is None
    assert sequence_correction_weights("bypass", old, mu, mask) is None


def test_band_edges_are_inside():
    # log μ = 0 and log π_old = log ρ exactly, so ρ is exactly the band's end
    mask = b([[True, True, True, True]])
    mu = t([[0.0, 0.0, 0.0, 0.0]])
    old = t([[math.log(0.5), math.log(2.0), math.log(0.5) - 1e-9, math.log(2.0) + 1e-9]])
    w, _ = token_mask_weights(old, mu, mask, band=(0.5, 2.0))
    close(w, [[0.5, 2.0, 0.0, 0.0]])
    st = mismatch_stats(old, mu, mask, band=(0.5, 2.0))
    close(st["outside_band_frac"], 0.5)
    w, st = tis_weights(old[:, :2], mu[:, :2], mask[:, :2], cap=2.0)
    close(w, [[0.5, 2.0]])
    close(st["truncated_frac"], 0.0)  # ρ = C is not truncated


def test_on_policy_every_correction_is_the_identity():
    # μ = π_old: every ratio 1, so every weight is 1 and nothing is masked
    torch.manual_seed(0)
    lp = -torch.rand(3, 5, dtype=F64) * 4
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    for mode in ("tis", "token_mask", "seq_mask"):
        w, _ = correction_weights(mode, lp, lp.clone(), mask)
        close(w, torch.where(mask, 1.0, 0.0).tolist())
    for mode in ("none", "bypass"):
        assert correction_weights(mode, lp, lp, mask)[0] is None
    st = mismatch_stats(lp, lp, mask)
    for key in ("mismatch_k1", "mismatch_k3", "outside_band_frac"):
        close(st[key], 0.0)
    for key in ("ratio_max", "ratio_min", "ratio_p99"):
        close(st[key], 1.0)


def test_the_weights_change_the_grpo_loss_as_the_formula_says():
    # On policy (π_θ = π_old, ρ_θ = 1) the surrogate's token loss is −Â_i, so with weights w the
    # token-mean loss is −Σ w_{i,t}·Â_i / N: here Â = (1.5, −0.5, 0) and N = 6.
    old, mu, mask = batch()
    adv = t([1.5, -0.5, 0.0])
    policy = torch.where(mask, old, 0.0).requires_grad_()
    want = {
        "tis": -(1.5 * (0.25 + 1.5 + 2 + 1) - 0.5 * (0.6 + 2)) / 6,
        "token_mask": -(1.5 * (1.5 + 1.0) - 0.5 * 0.6) / 6,
        "seq_mask": -(1.5 * 4) / 6,  # band (1.0, 1.1): row 0 only
    }
    bands = {"tis": None, "token_mask": (0.5, 2.0), "seq_mask": (1.0, 1.1)}
    for mode, value in want.items():
        w, _ = correction_weights(mode, old, mu, mask, cap=2.0, band=bands[mode])
        loss, _ = grpo_policy_loss(
            policy, old, None, adv, mask, beta=0.0, aggregation="token-mean", is_weights=w
        )
        close(loss, value)
    plain, _ = grpo_policy_loss(policy, old, None, adv, mask, beta=0.0, aggregation="token-mean")
    close(plain, -(1.5 * 4 - 0.5 * 2) / 6)


def test_float32_inputs_give_float32_weights():
    old, mu, mask = batch()
    w, _ = tis_weights(old.float(), mu.float(), mask)
    assert w.dtype == torch.float32
    torch.testing.assert_close(
        w, t([[0.25, 1.5, 2.0, 1.0], [0.6, 2.0, 0.0, 0.0], [0.0] * 4]).float()
    )


def test_bad_arguments():
    old, mu, mask = batch()
    with pytest.raises(ValueError, match="correction_cap"):
        tis_weights(old, mu, mask, cap=0.5)
    with pytest.raises(ValueError, match="correction_band_low"):
        token_mask_weights(old, mu, mask, band=(1.2, 2.0))
    with pytest.raises(ValueError, match="correction_band_high"):
        sequence_mask_weights(old, mu, mask, band=(0.5, 0.9))
    with pytest.raises(ValueError, match="two numbers"):
        mismatch_stats(old, mu, mask, band=(0.5,))
    with pytest.raises(ValueError, match="expected one of"):
        correction_weights("icepop", old, mu, mask)
    with pytest.raises(ValueError, match="behaviour_logprobs shape"):
        tis_weights(old, mu[:, :3], mask)
    with pytest.raises(ValueError, match="bool"):
        tis_weights(old, mu, mask.double())


def test_empty_mask_gives_nan_stats():
    old, mu, mask = batch()
    st = mismatch_stats(old, mu, torch.zeros_like(mask))
    assert all(math.isnan(float(v)) for v in st.values())


# verl's rejection sampling, written here as verl writes it (verl/trainer/ppo/rollout_corr_helper.py
# at b178a3c: compute_rollout_rejection_mask; log_ratio = old_log_prob − rollout_log_prob, :779), so
# the band's orientation is held against verl's own rule, not against proximal's.
VERL_SAFETY_BOUND = 20.0  # rollout_corr_helper.SAFETY_BOUND


def verl_k1_keep(log_ratio, response_mask, option: str, threshold: str):
    """verl's ``rollout_rs`` ``token_k1`` / ``seq_mean_k1`` with ``rollout_rs_threshold`` ``'lo_hi'``
    (a single number is the upper bound, the lower its reciprocal: _parse_rollout_rs_thresholds).
    The statistic is k1 = −log ρ (token_k1 = −log_ratio_safe, :222), kept when
    log(lo) ≤ stat ≤ log(hi) (:275, :308). Returns the modified response mask, (B, T) bool."""
    lower_str, upper_str = threshold.split("_", 1) if "_" in threshold else (None, threshold)
    upper = float(upper_str)
    lower = float(lower_str) if lower_str is not None else 1.0 / upper
    lower_log, upper_log = math.log(lower), math.log(upper)
    token_k1 = -torch.clamp(log_ratio, min=-VERL_SAFETY_BOUND, max=VERL_SAFETY_BOUND)
    m = response_mask.to(log_ratio.dtype)
    if option == "token_k1":
        keep = (token_k1 >= lower_log) & (token_k1 <= upper_log)
    elif option == "seq_mean_k1":  # verl_F.masked_mean(values, response_mask, axis=-1)
        stat = (torch.where(response_mask, token_k1, 0.0) * m).sum(-1) / (m.sum(-1) + 1e-8)
        keep = ((stat >= lower_log) & (stat <= upper_log))[:, None].expand_as(response_mask)
    else:
        raise ValueError(option)
    return keep & response_mask


def test_correction_band_is_verls_k1_threshold_inverted():
    """rollout.correction_band [lo, hi] bounds ρ = π_old/μ; verl's k1 threshold 'lo_hi' bounds
    −log ρ, so it keeps ρ ∈ [1/hi, 1/lo]: verl's 'lo_hi' is proximal's [1/hi, 1/lo] (and the
    default [0.999, 1.001] is verl's '0.999_1.001' only to 1e-6 at each edge). Held on a
    log-asymmetric threshold, '0.5_1.5' = proximal's [2/3, 2], where the unconverted [0.5, 1.5]
    keeps other responses and tokens."""
    # Seven rows of T = 4, their geometric-mean ratios ρ̄ = 0.4, 0.55, 0.8, 1, 1.2, 1.7, 2.5 on both
    # sides of every edge involved (0.5, 2/3, 1.5, 2), spread over tokens whose own ratios cross
    # them; row lengths vary; masked positions hold garbage.
    ratios = [
        [0.4 * 1.3, 0.4 / 1.3, NAN, NAN],
        [0.55 * 1.5, 0.55 / 1.5, NAN, NAN],
        [0.8 * 1.1, 0.8, 0.8 / 1.1, NAN],
        [1.0, NAN, NAN, NAN],
        [1.2 * 2.0, 1.2 / 2.0, 1.2, 1.2],
        [1.7, 1.7, NAN, NAN],
        [2.5 * 0.7, 2.5 / 0.7, 2.5, NAN],
    ]
    mask = b([[not math.isnan(r) for r in row] for row in ratios])
    mu = torch.linspace(-3.0, -0.5, 28, dtype=F64).reshape(7, 4)
    old = torch.where(mask, mu + t(ratios).log(), t(NAN))
    log_ratio = torch.where(mask, old - mu, 0.0)  # verl's log_ratio; its masked tokens never count

    lo, hi = 0.5, 1.5  # verl's rollout_rs_threshold "0.5_1.5"
    verl_seq = verl_k1_keep(log_ratio, mask, "seq_mean_k1", f"{lo}_{hi}")
    # verl keeps ρ̄ ∈ [2/3, 2]: the rows of 0.8, 1.0, 1.2 and 1.7
    assert verl_seq.any(1).tolist() == [False, False, True, True, True, True, False]
    converted, _ = sequence_mask_weights(old, mu, mask, band=(1 / hi, 1 / lo))
    assert torch.equal(converted.bool(), verl_seq)
    unconverted, _ = sequence_mask_weights(old, mu, mask, band=(lo, hi))
    # [0.5, 1.5] keeps 0.55 and drops 1.7 instead
    assert unconverted.bool().any(1).tolist() == [False, True, True, True, True, False, False]
    assert not torch.equal(unconverted.bool(), verl_seq)
    # the weights of a GSPO objective and correction_weights' seq_mask follow the same band
    seq_w = sequence_correction_weights("seq_mask", old, mu, mask, band=(1 / hi, 1 / lo))
    assert seq_w.bool().tolist() == verl_seq.any(1).tolist()
    w, _ = correction_weights("seq_mask", old, mu, mask, band=(1 / hi, 1 / lo))
    assert torch.equal(w.bool(), verl_seq)

    # token_mask against verl's token_k1, the same orientation, token by token
    verl_tok = verl_k1_keep(log_ratio, mask, "token_k1", f"{lo}_{hi}")
    # verl keeps the tokens of ρ ∈ [2/3, 2]: not 0.52, 0.31, 0.37, 0.6, 2.4, 3.57, 2.5
    assert verl_tok.sum() == mask.sum() - 7
    tok, _ = token_mask_weights(old, mu, mask, band=(1 / hi, 1 / lo))
    assert torch.equal(tok > 0, verl_tok)
    tok_unconverted, _ = token_mask_weights(old, mu, mask, band=(lo, hi))
    assert not torch.equal(tok_unconverted > 0, verl_tok)

    # verl's single-number form 'hi' is the band [1/hi, hi], symmetric in log ρ: no conversion
    w_sym, _ = sequence_mask_weights(old, mu, mask, band=(1 / 1.6, 1.6))
    assert torch.equal(w_sym.bool(), verl_k1_keep(log_ratio, mask, "seq_mean_k1", "1.6"))
