"""Stop handling (the MDP of Ziegler et al. 2019: the episode ends at EOS, a stop token or a stop
string) and the guarantee that tokens after the stop never influence any loss."""

from __future__ import annotations

import pytest
import torch
from ppo_support import Spy, read_jsonl, tiny_config, without_timing, write_yaml

from proximal.rollout.sampling import Rollout, _stop_string_lengths, sample, stop_mask

EOS, STOP = 1, 7


# ----------------------------------------------------------------------------------------------
# stop_mask
# ----------------------------------------------------------------------------------------------


def test_stop_mask_includes_the_stop_and_excludes_everything_after():
    ids = torch.tensor(
        [
            [5, 6, EOS, 8, EOS],  # EOS mid-row: kept, the rest masked
            [EOS, 5, 6, 7, 8],  # EOS first: a one-token response
            [5, 6, 8, 9, 10],  # no stop: all valid, not ended
            [5, 6, 8, 9, EOS],
        ]
    )  # EOS in the last slot: ended
    mask, ended = stop_mask(ids, [EOS])
    assert mask.dtype == torch.bool
    assert mask.tolist() == [
        [True, True, True, False, False],
        [True, False, False, False, False],
        [True, True, True, True, True],
        [True, True, True, True, True],
    ]
    assert ended.tolist() == [True, True, False, True]


def test_stop_mask_with_several_stop_ids_stops_at_the_first():
    ids = torch.tensor([[5, STOP, 6, EOS, 8], [5, 6, EOS, STOP, 8], [5, 6, 8, 9, 10]])
    mask, ended = stop_mask(ids, [EOS, STOP])
    assert mask.sum(1).tolist() == [2, 3, 5]
    assert ended.tolist() == [True, True, False]
    mask_eos_only, _ = stop_mask(ids, [EOS])
    assert mask_eos_only.sum(1).tolist() == [4, 3, 5]


def test_stop_mask_generated_len_caps_rows():
    ids = torch.tensor([[5, 6, 8, EOS, 9], [5, 6, 8, 9, 10], [5, EOS, 8, 9, 10]])
    mask, ended = stop_mask(ids, [EOS], generated_len=torch.tensor([2, 5, 4]))
    assert mask.sum(1).tolist() == [
        2,
        5,
        2,
    ]  # a cap before the EOS wins; an EOS before the cap wins
    assert ended.tolist() == [True, False, True]


# ----------------------------------------------------------------------------------------------
# sample(): stop strings and stop tokens, with a policy whose "generation" is fixed
# ----------------------------------------------------------------------------------------------


class FixedPolicy:
    """Stands in for the rollout engine in :func:`sample`: ``generate`` returns fixed rows."""

    def __init__(self, continuations: list[list[int]]):
        self.continuations = torch.tensor(continuations)

    def generate(self, prompt_ids, prompt_mask, seeds, params):
        return self.continuations[:, : params.max_new_tokens]


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def _sample(tok, rows: list[str], **kw) -> Rollout:
    conts = [_ids(tok, r) for r in rows]
    prompt = torch.tensor([_ids(tok, "ab")] * len(rows))
    return sample(
        FixedPolicy(conts),
        tok,
        prompt,
        torch.ones_like(prompt),
        seeds=[0] * len(rows),
        max_new_tokens=len(conts[0]),
        **kw,
    )


def test_sample_stop_strings(assets):
    tok = assets.tokenizer
    r = _sample(tok, ["ab 12cd", "a 12 cd", "abcdefg", "12abcde"], stop_strings=[" 12", "ef"])
    assert r.response_mask.sum(1).tolist() == [5, 4, 6, 7]
    assert r.ended.tolist() == [True, True, True, False]
    # Everything after the stop is the pad token, so nothing there can be read by mistake either.
    for row, n in zip(r.response_ids, r.response_mask.sum(1)):
        assert (row[n:] == tok.pad_token_id).all()
    assert tok.decode(r.response_ids[0][r.response_mask[0]]) == "ab 12"


def test_sample_stop_string_in_the_last_slot_counts_as_ended(assets):
    """A response whose stop string completes exactly at T stopped — it did not run out of tokens
    (otherwise rollout.missing_eos_penalty punishes it and response/eos_frac under-counts)."""
    tok = assets.tokenizer
    r = _sample(tok, ["abcdefg", "abcd 12"], stop_strings=[" 12"])
    assert r.response_mask.sum(1).tolist() == [7, 7]
    assert r.ended.tolist() == [False, True]


def test_sample_stop_token_ids_and_eos(assets):
    tok = assets.tokenizer
    stop = _ids(tok, "h")[0]
    conts = [
        _ids(tok, "abc") + [tok.eos_token_id] + _ids(tok, "de"),
        _ids(tok, "ab") + [stop] + _ids(tok, "cde"),
        _ids(tok, "abcdef"),
    ]
    prompt = torch.tensor([_ids(tok, "ab")] * 3)
    r = sample(
        FixedPolicy(conts),
        tok,
        prompt,
        torch.ones_like(prompt),
        seeds=[0] * 3,
        max_new_tokens=6,
        stop_token_ids=[stop],
    )
    assert r.response_mask.sum(1).tolist() == [4, 3, 6]
    assert r.ended.tolist() == [True, True, False]
    assert (
        r.response_ids[0, 3] == tok.eos_token_id and r.response_ids[1, 2] == stop
    )  # the stop itself stays


def test_stop_string_lengths_across_token_boundaries(assets):
    tok = assets.tokenizer
    ids = torch.tensor([_ids(tok, "abcdefgh"), _ids(tok, "hgfedcba")])
    mask = torch.ones_like(ids, dtype=torch.bool)
    lengths, found = _stop_string_lengths(tok, ids, mask, ["cde", "ba"])
    assert lengths.tolist() == [5, 8] and found.tolist() == [True, True]
    mask[1, 6:] = False  # the stop string lies past the row's end: not found
    lengths, found = _stop_string_lengths(tok, ids, mask, ["ba"])
    assert lengths.tolist() == [8, 6] and found.tolist() == [False, False]


# ----------------------------------------------------------------------------------------------
# Tokens after the stop never influence any loss: the real training step, with a fixed rollout
# ----------------------------------------------------------------------------------------------

T = 6


def _fixed_rollout(tok, variant: str):
    """A ``sample`` replacement for the trainer: each prompt gets a fixed response whose stop depends
    on the row: EOS at t=1, no stop (all T tokens valid), EOS at t=3, EOS at t=0 (a lone EOS), ….

    variant "pad": what ``sample`` produces (pad after the stop); "junk": other tokens after the stop
    (EOS, letters); "pre": one token *before* a stop changed (must change the gradients).
    """
    letters = _ids(tok, "abcdefgh")

    def fake_sample(policy, tokenizer, prompt_ids, prompt_mask, **kwargs):
        g = torch.Generator().manual_seed(123)
        B = prompt_ids.shape[0]
        resp = torch.tensor(letters)[torch.randint(len(letters), (B, T), generator=g)]
        stops = [1, T, 3, 0]  # index of EOS per row (T = no stop)
        for b in range(B):
            if stops[b % 4] < T:
                resp[b, stops[b % 4]] = tok.eos_token_id
        mask, ended = stop_mask(resp, [tok.eos_token_id])
        if variant == "pad":
            resp = torch.where(mask, resp, tok.pad_token_id)
        elif variant == "junk":
            junk = torch.tensor(letters + [tok.eos_token_id])[
                torch.randint(len(letters) + 1, (B, T), generator=g)
            ]
            resp = torch.where(mask, resp, junk)
        elif variant == "pre":
            resp = torch.where(mask, resp, tok.pad_token_id)
            resp[2, 0] = letters[0] if resp[2, 0] != letters[0] else letters[1]
        return Rollout(prompt_ids, prompt_mask, resp, mask, ended)

    return fake_sample


def _train_with_fixed_rollout(assets, tmp_path, monkeypatch, variant: str):
    """One PPO step (2 mini-batches × 2 micro-batches, 2 epochs) on the fixed rollout; returns the
    gradients each optimiser step saw, the metrics row and the trained actor/critic."""
    from proximal.config import load_config
    from proximal.train.optim import trainable_parameters
    from proximal.trainers import ppo

    grads = []
    clip_and_step = ppo.clip_and_step

    def record_then_step(
        model, opt, sched, max_norm, **kw
    ):  # the accumulated gradient, before clipping
        grads.append([p.grad.clone() for p in trainable_parameters(model)])
        return clip_and_step(model, opt, sched, max_norm, **kw)

    from proximal.rollout import collect

    monkeypatch.setattr(collect, "sample", _fixed_rollout(assets.tokenizer, variant))
    monkeypatch.setattr(ppo, "clip_and_step", record_then_step)
    builds = Spy(ppo.build_models)
    monkeypatch.setattr(ppo, "build_models", builds)
    run_dir = tmp_path / variant
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        run_dir,
        model={"reward_model": str(assets.reward_model("llama")), "critic": "reward_model"},
        rollout={"batch_size": 8, "max_new_tokens": T},
        ppo={"epochs": 2, "mini_batch_size": 4, "micro_batch_size": 2},
        train={"steps": 1},
        kl={"beta": 0.1},
    )
    ppo.train(load_config(ppo.PPOConfig, write_yaml(tmp_path / f"{variant}.yaml", cfg)))
    m = builds.results[-1]
    [row] = read_jsonl(run_dir / "metrics.jsonl")
    return grads, without_timing(row), m


@pytest.fixture(scope="module")
def fixed_rollout_runs(assets, tmp_path_factory):
    out = {}
    for variant in ("pad", "junk", "pre"):
        with pytest.MonkeyPatch.context() as mp:
            out[variant] = _train_with_fixed_rollout(
                assets, tmp_path_factory.mktemp("fixed"), mp, variant
            )
    return out


def test_tokens_after_the_stop_never_change_gradients(fixed_rollout_runs):
    grads_pad, row_pad, m_pad = fixed_rollout_runs["pad"]
    grads_junk, row_junk, m_junk = fixed_rollout_runs["junk"]
    assert (
        len(grads_pad) == len(grads_junk) == 2 * 2 * 2
    )  # (actor, critic) × 2 mini-batches × 2 epochs
    for i, (a, b) in enumerate(zip(grads_pad, grads_junk)):
        which = "actor" if i % 2 == 0 else "critic"
        assert len(a) == len(b)
        for ga, gb in zip(a, b):
            assert torch.equal(ga, gb), f"optimiser step {i // 2} ({which}): gradients differ"
    assert row_pad == row_junk  # scores, KL, rewards, losses, lengths: all bitwise the same
    for name in ("actor", "critic"):
        sa, sb = getattr(m_pad, name).state_dict(), getattr(m_junk, name).state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), f"trained {name} weights differ"


def test_a_token_before_the_stop_does_change_gradients(fixed_rollout_runs):
    """The control: the comparison above can fail — one valid token changed changes both models' gradients."""
    grads_pad, row_pad, _ = fixed_rollout_runs["pad"]
    grads_pre, row_pre, _ = fixed_rollout_runs["pre"]

    def same(i):
        return all(torch.equal(a, b) for a, b in zip(grads_pad[i], grads_pre[i]))

    assert len(grads_pad) == len(grads_pre) == 8
    assert not all(same(i) for i in range(0, 8, 2)), "actor gradients did not change"
    assert not all(same(i) for i in range(1, 8, 2)), "critic gradients did not change"
    assert row_pad["loss/policy"] != row_pre["loss/policy"]


def test_experience_ignores_tokens_after_the_stop(assets):
    """log π_old, log π_ref and V_old at valid positions do not depend on what follows the stop."""
    from proximal.data.collate import pad_left
    from proximal.models.loading import load_causal_lm, load_sequence_scorer
    from proximal.models.policy import Reference
    from proximal.rollout.experience import compute_experience

    tok = assets.tokenizer
    actor = load_causal_lm(str(assets.policy("llama")))
    critic = load_sequence_scorer(str(assets.reward_model("llama")))
    reference = Reference(
        actor, path=str(assets.policy("llama")), dtype="float32", shares_actor=False
    )
    prompt_ids, prompt_mask = pad_left(
        [_ids(tok, p) for p in ("ab 1", "c", "dd 3")], tok.pad_token_id
    )
    resp = torch.tensor([_ids(tok, "ab") + [1, 4, 5], _ids(tok, "abcde"), [1] + _ids(tok, "dcba")])
    mask, ended = stop_mask(resp, [1])
    junk = torch.where(mask, resp, torch.tensor(_ids(tok, "hhhhh")))
    ones = torch.ones(3, dtype=torch.bool)
    exps = [
        compute_experience(
            Rollout(prompt_ids, prompt_mask, r, mask, ended),
            torch.zeros(3),
            ones,
            actor=actor,
            reference=reference,
            critic=critic,
            temperature=0.7,
            micro_batch_size=2,
        )
        for r in (resp, junk)
    ]
    out = [(e.old_logprobs, e.ref_logprobs, e.values) for e in exps]
    for a, b in zip(*out):
        assert torch.equal(torch.where(mask, a, 0.0), torch.where(mask, b, 0.0))
    old, ref, values = out[0]
    assert torch.equal(old, ref)  # untrained actor == reference
    assert (values[~mask] == 0).all()
    # log π_old is the log-probability under the *sampling* temperature (rollout.temperature = 0.7).
    from proximal.rollout.sampling import response_logits

    with torch.no_grad():
        logits = response_logits(actor, Rollout(prompt_ids, prompt_mask, resp, mask, ended))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(old[mask], expected[mask], rtol=0, atol=1e-6)
