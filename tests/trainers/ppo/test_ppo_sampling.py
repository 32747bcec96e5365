"""Rollouts sample from π_θ at the configured temperature / top-p / top-k and nothing else (docs/formulas.md,
the MDP and the clipped surrogate: the ratio r_t and the KL assume the tokens came from exactly the
policy whose log-probabilities are recomputed). A checkpoint's own ``generation_config.json`` must
not add processors of its own."""

from __future__ import annotations

import pytest
import torch

from proximal.data.collate import pad_left
from proximal.models.loading import load_causal_lm, load_tokenizer
from proximal.rollout.sampling import sample

# Fields real checkpoints ship (Qwen2.5-Instruct: repetition_penalty; BART: no_repeat_ngram_size;
# Whisper: suppress_tokens) that would silently change the sampling distribution.
CHECKPOINT_GENERATION_FIELDS = {
    "no_repeat_ngram_size": {"no_repeat_ngram_size": 1},
    "repetition_penalty": {"repetition_penalty": 3.0},
    "suppress_tokens": {"suppress_tokens": [4, 5, 6, 7]},
}


@pytest.mark.parametrize("field", list(CHECKPOINT_GENERATION_FIELDS))
def test_sampling_ignores_the_checkpoints_generation_config(field, assets, tmp_path):
    policy = assets.policy("llama")
    tok = load_tokenizer(str(policy))
    clean = load_causal_lm(str(policy))
    tainted = load_causal_lm(str(policy))
    for k, v in CHECKPOINT_GENERATION_FIELDS[field].items():
        setattr(tainted.generation_config, k, v)
    tainted.save_pretrained(tmp_path / "tainted")
    tainted = load_causal_lm(str(tmp_path / "tainted"))
    assert getattr(tainted.generation_config, field) is not None

    ids, mask = pad_left([tok("ab 1", add_special_tokens=False).input_ids] * 32, tok.pad_token_id)
    out = []
    for model in (clean, tainted):
        out.append(
            sample(
                model,
                tok,
                ids,
                mask,
                seeds=list(range(32)),
                max_new_tokens=8,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
            )
        )
    differ = int((out[0].response_ids != out[1].response_ids).any(1).sum())
    assert differ == 0, (
        f"the checkpoint's generation_config {CHECKPOINT_GENERATION_FIELDS[field]} changed "
        f"{differ} of 32 sampled responses"
    )


def test_categorical_sample_draws_from_the_tempered_filtered_distribution():
    """The rollout sampler's frequencies match softmax(filter(z / τ)) (a chi-square-sized bound on
    20 000 draws), filtered tokens are never drawn, and a row's draws depend on its generator only."""
    from proximal.rollout.engine import SamplingParams, categorical_sample

    z = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    params = SamplingParams(max_new_tokens=1, stop_token_ids=(), temperature=0.8, top_k=4)
    p = torch.softmax(torch.where(torch.arange(5) == 3, -torch.inf, z / 0.8), -1)[
        0
    ]  # top-4 drops token 3
    gens = [torch.Generator().manual_seed(i) for i in range(20_000)]
    draws = categorical_sample(z.expand(20_000, 5), gens, params)
    freq = torch.bincount(draws, minlength=5).double() / 20_000
    assert freq[3] == 0
    assert torch.allclose(
        freq, p.double(), atol=4 * (0.25 / 20_000) ** 0.5
    )  # 4 standard errors at worst
    again = categorical_sample(
        z.expand(3, 5), [torch.Generator().manual_seed(i) for i in (7, 0, 7)], params
    )
    assert again[0] == again[2] == draws[7] and again[1] == draws[0]
