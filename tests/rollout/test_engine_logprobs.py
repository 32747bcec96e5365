"""The engine's log-probabilities of the tokens it samples (log μ) and its sampling precision.

In float32 with the policy's own weights, μ is π_old — the trainer's recomputation of the same
tokens — up to the decode path's tested tolerance: the lean step's logits match the model's own to
2e-5 (tests/rollout/test_lean_decode.py) and |Δ log softmax(z/τ)| ≤ 2·max|Δz|/τ, so the log-probabilities
agree to 4e-5/τ on every path (lean, the model's own forward, the restart after a failed lean step),
and every rollout correction is then the identity within that. Sampled in bfloat16 (``bf16-mixed``
autocast, or the ``bf16-true`` engine-held copy) against float32 training the gap is clearly not 0.
"""

from __future__ import annotations

import math

import pytest
import torch
from lean_support import prompts, tiny_lm

from proximal.config import ConfigError
from proximal.core import correction_weights, grpo_policy_loss, mismatch_stats
from proximal.rollout import decode
from proximal.rollout.engine import HFEngine, SamplingParams, bfloat16_copy
from proximal.rollout.sampling import Rollout, response_logprobs, stop_mask

TAU = 0.8
PARAMS = SamplingParams(max_new_tokens=12, stop_token_ids=(1,), temperature=TAU)
SEEDS = list(range(6))
TOL = 2 * 2e-5 / TAU  # the decode path's logit tolerance through log softmax(z / τ)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_lm("llama", tmp_path_factory.mktemp("lm"))


def _rollout(engine: HFEngine, params: SamplingParams = PARAMS) -> Rollout:
    ids, mask = prompts()
    resp, mu = engine.generate(ids, mask, SEEDS, params, logprobs=True)
    response_mask, ended = stop_mask(resp, [1])
    assert mu.dtype == torch.float32 and mu.shape == resp.shape
    return Rollout(ids, mask, torch.where(response_mask, resp, 0), response_mask, ended, mu)


def _old(model, r: Rollout, path: str = "fused") -> torch.Tensor:
    with torch.no_grad():
        return response_logprobs(model, r, TAU, path=path).logprobs


@pytest.mark.parametrize("lean", [True, False])
def test_float32_engine_logprobs_are_pi_old(model, lean, lean_steps):
    engine = HFEngine(model, 0, lean_decode=lean)
    r = _rollout(engine)
    assert (lean_steps[0] > 0) == lean
    # the plain call gives the same ids, and only the ids
    ids, mask = prompts()
    assert torch.equal(
        torch.where(r.response_mask, engine.generate(ids, mask, SEEDS, PARAMS), 0), r.response_ids
    )
    m = r.response_mask
    assert int(m.sum()) > 30 and not bool(r.ended.all())  # some rows stop, some run to T
    for path in ("fused", "logits"):
        old = _old(model, r, path)
        torch.testing.assert_close(old[m], r.behaviour_logprobs[m], rtol=0, atol=TOL)
    st = mismatch_stats(old, r.behaviour_logprobs, m)
    assert float(st["ratio_max"]) < math.exp(TOL) and float(st["ratio_min"]) > math.exp(-TOL)
    assert (r.behaviour_logprobs[~m] == 0).all()
    # every correction is then the identity within the tolerance: the weights are 1 ± TOL, and the
    # weighted loss is the plain one within TOL·Σ|Â|/N
    adv = torch.linspace(-1, 1, len(m))
    plain, _ = grpo_policy_loss(old, old, None, adv, m, beta=0.0, aggregation="token-mean")
    for mode in ("tis", "token_mask", "seq_mask"):
        band = (math.exp(-2 * TOL), math.exp(2 * TOL)) if mode == "seq_mask" else None
        w, _ = correction_weights(mode, old, r.behaviour_logprobs, m, band=band)
        torch.testing.assert_close(w[m], torch.ones_like(w[m]), rtol=0, atol=2 * TOL)
        loss, _ = grpo_policy_loss(
            old, old, None, adv, m, beta=0.0, aggregation="token-mean", is_weights=w
        )
        assert abs(float(loss - plain)) <= 2 * TOL * float(adv.abs().max())


def test_the_restart_path_records_the_logits_it_sampled_from(model, monkeypatch, lean_steps):
    """A lean step failing mid-rollout: the model's own forward recomputes the cache and goes on;
    the later tokens' log-probabilities come from its logits."""
    step = decode.LeanDecoder.step

    def third_fails(self, *args):
        if lean_steps[0] == 2:
            raise RuntimeError("shape mismatch")
        return step(self, *args)

    monkeypatch.setattr(decode.LeanDecoder, "step", third_fails)
    engine = HFEngine(model, 0)
    r = _rollout(engine)
    assert engine.lean_reason() == "its step failed at token 4 (RuntimeError: shape mismatch)"
    m = r.response_mask
    assert int(m[:, 4:].sum()) > 0
    torch.testing.assert_close(_old(model, r)[m], r.behaviour_logprobs[m], rtol=0, atol=TOL)


def _truncated_f64(logits: torch.Tensor, y: int, tau: float, top_k: int, top_p: float) -> float:
    """log of y's probability under softmax(logits / τ) cut to the top k, then to the shortest
    prefix of the renormalised rest whose mass reaches top_p, and renormalised: a float64 loop."""
    p = torch.softmax(logits.double() / tau, -1).tolist()
    order = sorted(range(len(p)), key=lambda v: -p[v])
    kept = order[:top_k] if top_k else order
    if top_p < 1:
        mass, cum, nucleus = sum(p[v] for v in kept), 0.0, []
        for v in kept:
            if cum >= top_p:
                break
            nucleus.append(v)
            cum += p[v] / mass
        kept = nucleus
    assert y in kept, "a filtered token was sampled"
    return math.log(p[y] / sum(p[v] for v in kept))


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (12, 1.0), (0, 0.8), (12, 0.7)])
def test_mu_is_the_log_probability_of_the_distribution_the_token_was_drawn_from(top_k, top_p):
    """μ = log softmax(filter(z / τ))[y]: the truncated, renormalised distribution (what vLLM's
    processed_logprobs give), against a float64 loop; without a filter, to the bit the tempered
    log softmax(z / τ)[y] the engine recorded before."""
    from proximal.rollout.engine import categorical_sample

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 40, generator=g) * 2
    gens = [torch.Generator().manual_seed(s) for s in range(64)]
    params = SamplingParams(8, (1,), temperature=TAU, top_p=top_p, top_k=top_k)
    token, mu = categorical_sample(logits, gens, params, logprobs=True)
    assert mu.dtype == torch.float32
    want = [_truncated_f64(logits[b], int(token[b]), TAU, top_k, top_p) for b in range(64)]
    torch.testing.assert_close(
        mu.double(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=2e-6
    )
    # the same tokens as the plain call (the same draws)
    again = categorical_sample(
        logits, [torch.Generator().manual_seed(s) for s in range(64)], params
    )
    assert torch.equal(again, token)
    z = logits.float() / TAU
    full = z.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
    if top_k == 0 and top_p == 1.0:
        assert torch.equal(mu, full)
    else:  # higher by −log(kept mass) > 0 at every row (every row's filter drops some mass)
        assert bool((mu - full > 1e-3).all())


def test_top_p_and_top_k_mu_is_what_the_replayed_filter_recomputes(model):
    """Through the engine: μ under top-p / top-k equals π_old computed with the filter replayed on
    the trainer's logits (rollout.replay_filter), within the decode path's tolerance; the full
    softmax's π_old falls short of it by the truncation, −log(kept mass)."""
    params = SamplingParams(
        max_new_tokens=12, stop_token_ids=(1,), temperature=TAU, top_p=0.8, top_k=20
    )
    r = _rollout(HFEngine(model, 0), params)
    m = r.response_mask
    with torch.no_grad():
        scores = response_logprobs(model, r, TAU, path="logits", filter=(20, 0.8))
    torch.testing.assert_close(scores.logprobs[m], r.behaviour_logprobs[m], rtol=0, atol=TOL)
    torch.testing.assert_close(scores.full_logprobs[m], _old(model, r)[m], rtol=0, atol=TOL)
    assert float((r.behaviour_logprobs - scores.full_logprobs)[m].min()) > 1e-3


def _bf16_gap(model, precision: str) -> dict:
    engine = HFEngine(model, 0, precision=precision)
    r = _rollout(engine)
    st = mismatch_stats(_old(model, r), r.behaviour_logprobs, r.response_mask)
    return {k: float(v) for k, v in st.items()}


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_sampling_against_float32_training_is_clearly_off(model, precision):
    st = _bf16_gap(model, precision)
    # float32 against itself: k3 ≤ TOL² (≈ 2.5e-9), every ratio within e^±TOL; bfloat16 (8 bits
    # of mantissa) moves log-probabilities by ~1e-2 here (measured k3 9e-6 mixed, 3e-5 true)
    assert st["mismatch_k3"] > 1e-6 > 100 * TOL**2
    assert max(math.log(st["ratio_max"]), -math.log(st["ratio_min"])) > 100 * TOL


def test_bf16_true_holds_a_bfloat16_copy_and_refreshes_it(model):
    live = [p.detach().clone() for p in model.parameters()]
    engine = HFEngine(model, 0, precision="bf16-true")
    held = engine.decoder
    assert held is not model and engine.model is model
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in held.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the policy untouched
    rotary = dict(held.named_buffers())["model.rotary_emb.inv_freq"]
    assert rotary.dtype == torch.float32  # buffers as loaded
    path = engine.decode_path()
    assert path["precision"] == "bf16-true" and path["path"] == "lean"
    assert path["copy_bytes"] == sum(2 * p.numel() for p in model.parameters())
    assert "bfloat16 copy" in engine.describe_decode()
    ids, mask = prompts()
    try:
        # the policy restored from a checkpoint after the engine was built (the trainers' order):
        # the first rollout samples from the restored weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        engine.generate(ids, mask, SEEDS, PARAMS)
        for h, p in zip(held.parameters(), model.parameters()):
            assert torch.equal(h, p.detach().to(torch.bfloat16))
        # an update: refreshed before the next rollout, not before
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        before = [p.clone() for p in held.parameters()]
        engine.generate(ids, mask, SEEDS, PARAMS)
        assert all(torch.equal(h, b) for h, b in zip(held.parameters(), before))
        engine.after_update()
        engine.generate(ids, mask, SEEDS, PARAMS)
        for h, p, b in zip(held.parameters(), model.parameters(), before):
            assert torch.equal(h, p.detach().to(torch.bfloat16))
            assert not torch.equal(h, b)
    finally:
        with torch.no_grad():
            for p, v in zip(model.parameters(), live):
                p.copy_(v)


def test_the_plain_engine_records_nothing_new(model):
    engine = HFEngine(model, 0)
    assert engine.decoder is model
    assert engine.decode_path() == {"path": "lean", "reason": None}
    mixed = HFEngine(model, 0, precision="bf16-mixed")
    assert mixed.decode_path() == {"path": "lean", "reason": None, "precision": "bf16-mixed"}
    assert mixed.describe_decode().endswith("(rollout.precision bf16-mixed)")
    with pytest.raises(ValueError, match="precision"):
        HFEngine(model, 0, precision="fp8")


def test_a_sharded_policy_has_no_bf16_copy(model, monkeypatch):
    from proximal.rollout import engine as engine_module

    monkeypatch.setattr(engine_module, "is_sharded", lambda m: True)
    with pytest.raises(ConfigError, match="bf16-true needs one process"):
        bfloat16_copy(model)


def test_bf16_true_copies_a_lora_policy_and_refreshes_its_adapters(tmp_path):
    """A LoRA actor: the copy holds the adapters (bfloat16) and decodes the lean way; after an update
    the trained adapters are copied, the frozen base (never changed) is not touched."""
    from proximal.models.policy import lora_config, with_adapters

    lora = with_adapters(
        tiny_lm("llama", tmp_path),
        lora_config("CAUSAL_LM", r=4, alpha=8, target_modules=["all-linear"]),
    ).eval()
    engine = HFEngine(lora, 0, precision="bf16-true")
    assert engine.decode_path()["path"] == "lean"
    held = dict(engine.decoder.named_parameters())
    live = dict(lora.named_parameters())
    assert held.keys() == live.keys() and any("lora_B" in k for k in held)
    with torch.no_grad():
        for name, p in live.items():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    base = next(k for k in held if "base_layer" in k)
    held[base].data.fill_(7.0)  # a frozen weight: the refresh leaves it as it is
    engine.after_update()
    engine.generate(*prompts(), SEEDS, PARAMS)  # the refresh comes before the next rollout
    for name, p in live.items():
        if "lora_" in name:
            assert torch.equal(held[name], p.detach().to(torch.bfloat16)), name
    assert bool((held[base] == 7.0).all())
    held[base].data.copy_(live[base].detach())
    r = _rollout(engine)  # the adapters now matter: μ follows the LoRA policy, in bfloat16
    with torch.no_grad():
        old = response_logprobs(lora, r, TAU).logprobs
    st = mismatch_stats(old, r.behaviour_logprobs, r.response_mask)
    assert 1e-7 < float(st["mismatch_k3"]) < 1e-2
