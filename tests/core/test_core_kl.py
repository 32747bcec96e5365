"""KL estimators (hand values) and the three β controllers over scripted KL sequences."""

import math

import pytest
import torch
from f64 import NAN, b, close, t  # tests/core/f64.py
from hypothesis import given, settings
from hypothesis import strategies as st

from proximal.core import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    FixedKLController,
    ProportionalKLController,
    kl_penalty,
    make_kl_controller,
    reference_kl_loss,
)

F64 = torch.float64


def test_kl_estimators_hand_values():
    # token 0: π = 0.5, π_ref = 0.25 → r = π_ref/π = 0.5
    # token 1: π = 0.2, π_ref = 0.6  → r = 3
    logp = torch.tensor([math.log(0.5), math.log(0.2)], dtype=F64)
    ref = torch.tensor([math.log(0.25), math.log(0.6)], dtype=F64)
    k1 = [math.log(2.0), -math.log(3.0)]  # −log r
    k2 = [0.5 * math.log(2.0) ** 2, 0.5 * math.log(3.0) ** 2]  # ½(log r)²
    k3 = [(0.5 - 1) + math.log(2.0), (3 - 1) - math.log(3.0)]  # (r − 1) − log r
    for name, want in (("k1", k1), ("k2", k2), ("k3", k3)):
        got = kl_penalty(logp, ref, name).tolist()
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), name


def test_kl_default_is_k1_and_zero_when_equal():
    lp = torch.tensor([-1.0, -2.5], dtype=F64)
    assert kl_penalty(lp, lp - 0.3).tolist() == pytest.approx([0.3, 0.3], abs=1e-15)
    for name in ("k1", "k2", "k3"):
        assert kl_penalty(lp, lp, name).tolist() == [0.0, 0.0]


def test_kl_unknown_estimator_named():
    with pytest.raises(ValueError, match="'k4'"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(-8, 8), min_size=1, max_size=6),
    st.lists(st.floats(-8, 8), min_size=6, max_size=6),
)
def test_kl_estimators_match_scalar_formulas(lps, refs):
    lp = torch.tensor(lps, dtype=F64)
    ref = torch.tensor(refs[: len(lps)], dtype=F64)
    for i, (a, c) in enumerate(zip(lps, refs)):
        r = math.exp(c - a)
        assert kl_penalty(lp, ref, "k1")[i].item() == pytest.approx(a - c, abs=1e-12)
        assert kl_penalty(lp, ref, "k2")[i].item() == pytest.approx(
            0.5 * (a - c) ** 2, rel=1e-12, abs=1e-12
        )
        assert kl_penalty(lp, ref, "k3")[i].item() == pytest.approx(
            (r - 1) - math.log(r), rel=1e-9, abs=1e-12
        )
        assert kl_penalty(lp, ref, "k3")[i].item() >= 0


# ------------------------------------------------------------------------------- controllers


def test_fixed_controller_never_moves():
    c = FixedKLController(0.05)
    for kl in (0.0, 100.0, 0.01):
        assert c.update(kl) == 0.05
    assert c.beta == 0.05
    assert FixedKLController(0.0).beta == 0.0  # β = 0 switches the penalty off


def test_adaptive_controller_scripted_sequence_with_strict_boundaries():
    c = AdaptiveKLController(init_beta=0.1, target=6.0, k_beta=0.1)
    # 1.5·target = 9, target/1.5 = 4 (both exact in binary floating point)
    script = [
        (10.0, 0.1 * 1.1),  # 10 > 9 → ×1.1
        (9.0, 0.1 * 1.1),  # 9 is not > 9 → unchanged
        (3.0, 0.1 * 1.1 * 0.9),  # 3 < 4 → ×0.9
        (4.0, 0.1 * 1.1 * 0.9),  # 4 is not < 4 → unchanged
        (6.0, 0.1 * 1.1 * 0.9),  # on target → unchanged
        (9.000001, 0.1 * 1.1 * 0.9 * 1.1),
        (0.0, 0.1 * 1.1 * 0.9 * 1.1 * 0.9),
    ]
    for kl, want in script:
        assert c.update(kl) == pytest.approx(want, rel=1e-14)
        assert c.beta == pytest.approx(want, rel=1e-14)


def test_adaptive_controller_ignores_n_steps_and_accepts_tensor_kl():
    c = AdaptiveKLController(0.2, 1.0)
    c.update(torch.tensor(2.0), n_steps=1000)
    assert c.beta == pytest.approx(0.2 * 1.1, rel=1e-14)


def test_proportional_controller_scripted_sequence():
    c = ProportionalKLController(init_beta=0.1, target=6.0, horizon=10_000)
    want = 0.1
    # KL 12: error 12/6 − 1 = 1 clipped to 0.2; 256 samples
    want *= 1 + 0.2 * 256 / 10_000
    assert c.update(12.0, n_steps=256) == pytest.approx(want, rel=1e-14)
    # KL 3: error −0.5 clipped to −0.2
    want *= 1 - 0.2 * 256 / 10_000
    assert c.update(3.0, n_steps=256) == pytest.approx(want, rel=1e-14)
    # KL 6.6: error 0.1 (inside the clip); 512 samples
    want *= 1 + (6.6 / 6.0 - 1) * 512 / 10_000
    assert c.update(6.6, n_steps=512) == pytest.approx(want, rel=1e-14)
    # on target: unchanged
    assert c.update(6.0, n_steps=512) == pytest.approx(want, rel=1e-14)
    # n_steps defaults to 1
    want *= 1 + 0.2 * 1 / 10_000
    assert c.update(100.0) == pytest.approx(want, rel=1e-14)


@pytest.mark.parametrize(
    "make",
    [
        lambda: FixedKLController(0.3),
        lambda: AdaptiveKLController(0.3, 2.0, 0.1),
        lambda: ProportionalKLController(0.3, 2.0, 100),
    ],
)
def test_controller_state_dict_resumes_with_same_beta(make):
    script = [5.0, 0.1, 7.0, 2.0, 0.5]
    full = make()
    for kl in script:
        full.update(kl, n_steps=8)
    first = make()
    for kl in script[:2]:
        first.update(kl, n_steps=8)
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.beta == first.beta
    for kl in script[2:]:
        resumed.update(kl, n_steps=8)
    assert resumed.beta == full.beta


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: FixedKLController(-0.1), "beta"),
        (lambda: AdaptiveKLController(0.0, 1.0), "init_beta"),
        (lambda: AdaptiveKLController(0.1, -1.0), "target"),
        (lambda: AdaptiveKLController(0.1, 1.0, k_beta=1.5), "k_beta"),
        (lambda: ProportionalKLController(0.1, 1.0, horizon=0), "horizon"),
        (lambda: AdaptiveKLController(0.1, 1.0).update(math.nan), "observed_kl"),
        (lambda: ProportionalKLController(0.1, 1.0, 10).update(math.inf), "observed_kl"),
        (lambda: ProportionalKLController(0.1, 1.0, 10).update(1.0, n_steps=-1), "n_steps"),
    ],
)
def test_controller_validation(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# ------------------------------------------------------------------------------- the factory

# Each controller's parameters chosen so that one update by hand tells which rule ran with which:
# β = 0.5, target 2, K_β 0.25, horizon 40, and an observed KL of 4 over 8 samples.
FACTORY = {"beta": 0.5, "target": 2.0, "k_beta": 0.25, "horizon": 40}


@pytest.mark.parametrize(
    "name, cls, after",
    [
        ("fixed", FixedKLController, 0.5),  # never moves
        ("adaptive", AdaptiveKLController, 0.5 * (1 + 0.25)),  # 4 > 1.5·2 → β·(1 + K_β)
        # error = clip(4/2 − 1, −0.2, 0.2) = 0.2; β·(1 + 0.2·8/40)
        ("proportional", ProportionalKLController, 0.5 * (1 + 0.2 * 8 / 40)),
    ],
)
def test_make_kl_controller_builds_each_rule_with_its_values(name, cls, after):
    c = make_kl_controller(name, **FACTORY)
    assert type(c) is cls and c.beta == 0.5
    assert c.update(4.0, n_steps=8) == pytest.approx(after, rel=1e-15)


def test_make_kl_controller_knows_every_configurable_name_and_names_them_when_wrong():
    assert KL_CONTROLLERS == ("fixed", "adaptive", "proportional")
    for name in KL_CONTROLLERS:
        make_kl_controller(name, **FACTORY)
    with pytest.raises(ValueError, match=r"unknown KL controller 'pid'.*'fixed', 'adaptive'"):
        make_kl_controller("pid", **FACTORY)
    # the values still go through each controller's own checks
    with pytest.raises(ValueError, match="k_beta"):
        make_kl_controller("adaptive", **{**FACTORY, "k_beta": 1.5})


def test_reference_kl_loss_by_hand():
    lp = t([[math.log(0.5), math.log(0.25)], [math.log(0.1), NAN]], requires_grad=True)
    ref = t([[math.log(0.25), math.log(0.25)], [math.log(0.2), NAN]])
    mask = b([[1, 1], [1, 0]])
    k3 = lambda p, q: q / p - math.log(q / p) - 1  # noqa: E731
    ks = [k3(0.5, 0.25), 0.0, k3(0.1, 0.2)]
    loss, mean = reference_kl_loss(lp, ref, mask, 0.1, "token-mean")
    close(loss, 0.1 * sum(ks) / 3)
    close(mean, sum(ks) / 3)
    seq, _ = reference_kl_loss(lp, ref, mask, 0.1, "seq-mean-token-mean")
    close(seq, 0.1 * ((ks[0] + ks[1]) / 2 + ks[2]) / 2)
    (grad,) = torch.autograd.grad(loss, lp)
    assert not torch.isnan(grad).any()
