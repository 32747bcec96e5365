"""The optimiser, its schedule, one optimiser step and seeding (``proximal.train.optim``).

Every expected number is worked out by hand from the update rules: AdamW's first step moves each
parameter by lr·g/(|g| + ε) after the decoupled decay p·(1 − lr·λ); a clipped step scales the
gradient by max_norm/(‖g‖ + 1e-6) (``torch.nn.utils.clip_grad_norm_``'s rule).
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
import torch

from proximal.train.optim import (
    at_step,
    build_optimizer,
    build_scheduler,
    clip_and_step,
    optimizer_and_scheduler,
    resync_schedule,
    seed_everything,
    trainable_parameters,
)
from proximal.train.sections import OptimSection


class Tiny(torch.nn.Module):
    """A matrix, a bias, a norm gain and a frozen matrix: every kind of parameter the groups split."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([[1.0, -2.0], [0.5, 3.0]]))
        self.bias = torch.nn.Parameter(torch.tensor([0.25, -1.0]))
        self.gain = torch.nn.Parameter(torch.tensor([2.0, 2.0]))
        self.frozen = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)


def set_grads(model: Tiny, weight, bias, gain) -> None:
    model.weight.grad = torch.tensor(weight)
    model.bias.grad = torch.tensor(bias)
    model.gain.grad = torch.tensor(gain)


# ----------------------------------------------------------------------------------------------
# The optimiser
# ----------------------------------------------------------------------------------------------


def test_trainable_parameters_leave_out_the_frozen_ones():
    m = Tiny()
    assert [id(p) for p in trainable_parameters(m)] == [id(m.weight), id(m.bias), id(m.gain)]


def test_weight_decay_goes_to_matrices_only():
    m = Tiny()
    opt = build_optimizer(m, lr=0.1, weight_decay=0.5)
    decay, no_decay = opt.param_groups
    assert [id(p) for p in decay["params"]] == [id(m.weight)] and decay["weight_decay"] == 0.5
    assert [id(p) for p in no_decay["params"]] == [id(m.bias), id(m.gain)]
    assert no_decay["weight_decay"] == 0.0
    assert all(g["fused"] for g in opt.param_groups)  # CPU float32 has torch's fused AdamW
    # A model with no vectors gets one group, not an empty second one
    assert len(build_optimizer(torch.nn.Linear(2, 2, bias=False), lr=0.1).param_groups) == 1


def test_first_adamw_step_by_hand():
    """Step 1 of AdamW: m̂ = g, v̂ = g², so p ← p·(1 − lr·λ) − lr·g/(|g| + ε); λ on the matrix only."""
    lr, wd, eps = 0.1, 0.5, 1e-8
    m = Tiny()
    w0, b0, g0 = m.weight.detach().clone(), m.bias.detach().clone(), m.gain.detach().clone()
    opt = build_optimizer(m, lr=lr, weight_decay=wd, betas=(0.8, 0.99), eps=eps)
    gw, gb, gg = [[2.0, -0.5], [0.0, 4.0]], [-3.0, 1e-3], [0.5, -0.5]
    set_grads(m, gw, gb, gg)
    opt.step()

    def moved(p0, g, decay):
        g = torch.tensor(g)
        return p0 * (1 - lr * decay) - lr * g / (g.abs() + eps)

    torch.testing.assert_close(m.weight.detach(), moved(w0, gw, wd), rtol=0, atol=1e-6)
    torch.testing.assert_close(m.bias.detach(), moved(b0, gb, 0.0), rtol=0, atol=1e-6)
    torch.testing.assert_close(m.gain.detach(), moved(g0, gg, 0.0), rtol=0, atol=1e-6)
    assert torch.equal(m.frozen, torch.ones(2, 2))
    # The weight entry with a zero gradient only decayed: 0.5·(1 − 0.05)
    assert float(m.weight.detach()[1, 0]) == pytest.approx(0.475, abs=1e-7)


def test_optimizer_and_scheduler_read_the_optim_section():
    o = dataclasses.replace(
        OptimSection(),
        lr=0.2,
        weight_decay=0.3,
        adam_beta1=0.7,
        adam_beta2=0.95,
        adam_eps=1e-5,
        warmup_steps=2,
        schedule="linear",
    )
    opt, sched = optimizer_and_scheduler(Tiny(), o, total_steps=6)
    decay = opt.param_groups[0]
    assert (decay["weight_decay"], decay["betas"], decay["eps"]) == (0.3, (0.7, 0.95), 1e-5)
    assert sched.base_lrs == [0.2, 0.2]
    rates = []
    for _ in range(6):
        rates.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert rates == pytest.approx([0.0, 0.1, 0.2, 0.15, 0.1, 0.05], abs=1e-12)
    # ``lr`` overrides the section's (PPO's critic has its own rate)
    opt, sched = optimizer_and_scheduler(Tiny(), o, lr=0.5, total_steps=6)
    assert sched.base_lrs == [0.5, 0.5]


# ----------------------------------------------------------------------------------------------
# The schedule
# ----------------------------------------------------------------------------------------------


def _lrs(peak, schedule, warmup, total):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    sched = build_scheduler(opt, schedule=schedule, warmup_steps=warmup, total_steps=total)
    out = []
    for _ in range(total):
        out.append(sched.get_last_lr()[0])  # the rate optimiser step k runs at
        opt.step()
        sched.step()
    return out


def test_lr_schedule_by_hand():
    # transformers.get_scheduler, 0-based step k: warm-up k/w, then linear (total − k)/(total − w)
    assert _lrs(1.0, "linear", 2, 6) == [0.0, 0.5, 1.0, 0.75, 0.5, 0.25]
    assert _lrs(2.0, "linear", 0, 4) == [2.0, 1.5, 1.0, 0.5]
    assert _lrs(1.0, "constant", 2, 5) == [0.0, 0.5, 1.0, 1.0, 1.0]
    cos = _lrs(1.0, "cosine", 1, 5)  # ½(1 + cos(π·(k − 1)/4)) after one warm-up step
    assert cos == pytest.approx(
        [0.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))],
        abs=1e-12,
    )


def test_an_unknown_schedule_is_refused_naming_the_choices():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="'step'; expected one of constant, linear, cosine"):
        build_scheduler(opt, schedule="step", warmup_steps=0, total_steps=3)


def _trained_to(total: int, steps: int):
    """An SGD optimiser and its linear schedule over ``total`` steps, ``steps`` of them taken."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, schedule="linear", warmup_steps=0, total_steps=total)
    for _ in range(steps):
        opt.step()
        sched.step()
    return opt, sched


def test_resync_continues_an_extended_run_on_the_new_schedule():
    """A run of 4 linear steps ends at rate 0; resumed with 8 steps, its step 5 runs at (8 − 4)/8."""
    old_opt, old_sched = _trained_to(4, 4)
    assert old_opt.param_groups[0]["lr"] == 0.0
    opt, sched = _trained_to(8, 0)
    opt.load_state_dict(old_opt.state_dict())
    sched.load_state_dict(old_sched.state_dict())
    assert opt.param_groups[0]["lr"] == 0.0  # what the checkpoint's optimiser held
    resync_schedule(sched)
    assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0] == 0.5
    rates = []
    for _ in range(4):
        opt.step()
        sched.step()
        rates.append(opt.param_groups[0]["lr"])
    assert rates == [0.375, 0.25, 0.125, 0.0]


def test_resync_of_an_unchanged_schedule_sets_the_rates_it_saved():
    old_opt, old_sched = _trained_to(8, 3)
    opt, sched = _trained_to(8, 0)
    opt.load_state_dict(old_opt.state_dict())
    sched.load_state_dict(old_sched.state_dict())
    resync_schedule(sched)
    assert opt.param_groups[0]["lr"] == old_opt.param_groups[0]["lr"] == 5 / 8


# ----------------------------------------------------------------------------------------------
# One optimiser step
# ----------------------------------------------------------------------------------------------


def _sgd_on(values):
    p = torch.nn.Parameter(torch.zeros(len(values)))
    p.grad = torch.tensor(values)
    model = torch.nn.Module()
    model.p = p
    opt = torch.optim.SGD([p], lr=1.0)
    return model, opt, build_scheduler(opt, schedule="constant", warmup_steps=0, total_steps=10)


def test_clip_and_step_clips_the_global_norm_and_returns_it_unclipped():
    model, opt, sched = _sgd_on([3.0, 4.0])
    assert clip_and_step(model, opt, sched, max_grad_norm=1.0) == pytest.approx(5.0, abs=1e-6)
    # SGD at rate 1 with the gradient scaled by 1/(5 + 1e-6): p = −(0.6, 0.8)
    torch.testing.assert_close(model.p.detach(), torch.tensor([-0.6, -0.8]), rtol=0, atol=1e-6)
    assert model.p.grad is None and sched.last_epoch == 1  # cleared, and the schedule advanced


def test_clip_and_step_with_zero_max_norm_does_not_clip():
    model, opt, sched = _sgd_on([3.0, 4.0])
    assert clip_and_step(model, opt, sched, max_grad_norm=0.0) == pytest.approx(5.0, abs=1e-6)
    assert torch.equal(model.p.detach(), torch.tensor([-3.0, -4.0]))
    # A norm below the limit is not scaled either
    model, opt, sched = _sgd_on([0.3, 0.4])
    clip_and_step(model, opt, sched, max_grad_norm=1.0)
    assert torch.equal(model.p.detach(), torch.tensor([-0.3, -0.4]))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_gradient_is_never_applied(bad):
    model, opt, sched = _sgd_on([bad, 1.0])
    with pytest.raises(FloatingPointError, match=f"the gradient norm of the critic is {bad}"):
        clip_and_step(model, opt, sched, max_grad_norm=1.0, what="critic")
    assert torch.equal(model.p.detach(), torch.zeros(2))
    assert model.p.grad is None and sched.last_epoch == 0  # cleared; the schedule did not move


def test_at_step_names_the_step_once():
    with pytest.raises(FloatingPointError, match=r"^step 7: the gradient norm is nan$"):
        with at_step(7):
            raise FloatingPointError("the gradient norm is nan")
    with pytest.raises(FloatingPointError, match=r"^step 3: boom$"):  # nested: the inner step
        with at_step(9), at_step(3):
            raise FloatingPointError("boom")
    with pytest.raises(KeyError):  # anything else passes unchanged
        with at_step(1):
            raise KeyError("x")


# ----------------------------------------------------------------------------------------------
# Seeding
# ----------------------------------------------------------------------------------------------


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_seed_everything_repeats_python_numpy_and_torch():
    seed_everything(123)
    first = _draws()
    seed_everything(123)
    assert _draws() == first
    seed_everything(124)
    other = _draws()
    assert all(a != b for a, b in zip(first, other))


def test_a_seed_beyond_numpys_range_is_taken_modulo_2_to_the_32():
    seed_everything(2**32 + 5)  # numpy accepts seeds below 2^32 only
    big = float(np.random.rand())
    seed_everything(5)
    assert float(np.random.rand()) == big
