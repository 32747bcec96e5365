"""Left-padding a prompt changes no log-probability, value or score (the MDP of Ziegler et al. 2019:
the state is the prompt and the response prefix, never the padding). GPT-2 has absolute position
embeddings, so it checks that positions count real tokens only; Llama and Qwen2 check the same
through rotary positions."""

from __future__ import annotations

import pytest
import torch

from proximal.core import logprobs_from_logits
from proximal.data.collate import pad_left
from proximal.models.heads import last_token_scores
from proximal.models.loading import load_causal_lm, load_sequence_scorer
from proximal.rollout.experience import critic_values as _values
from proximal.rollout.sampling import Rollout, response_logits, stop_mask

ATOL = 1e-5  # float32; observed differences are ~1e-7


def _ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def _rollout(tok, prompts: list[str], responses: list[str]) -> Rollout:
    prompt_ids, prompt_mask = pad_left([_ids(tok, p) for p in prompts], tok.pad_token_id)
    rows = [_ids(tok, r) + [tok.eos_token_id] for r in responses]
    T = max(map(len, rows))
    resp = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])
    mask, ended = stop_mask(resp, [tok.eos_token_id])
    return Rollout(prompt_ids, prompt_mask, resp, mask, ended)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_left_padding_changes_no_logprob_or_value(arch, assets):
    tok = assets.tokenizer
    actor = load_causal_lm(str(assets.policy(arch)))
    critic = load_sequence_scorer(str(assets.reward_model(arch)))
    alone = _rollout(tok, ["ab 1"], ["cdef"])
    # The same prompt behind a prompt 9 tokens longer (so 9 pad tokens on its left), and a response
    # shorter than the other row's (so right padding after its EOS as well).
    batch = _rollout(tok, ["hhhhhhhhhhhhh", "ab 1"], ["a", "cdef"])
    assert batch.prompt_mask[1].tolist() == [0] * 9 + [1] * 4
    with torch.no_grad():
        lp_alone = logprobs_from_logits(
            response_logits(actor, alone), alone.response_ids, 0.7, mask=alone.response_mask
        )
        lp_batch = logprobs_from_logits(
            response_logits(actor, batch), batch.response_ids, 0.7, mask=batch.response_mask
        )
        v_alone, v_batch = _values(critic, alone), _values(critic, batch)
    n = int(alone.response_mask.sum())
    assert n == 5
    torch.testing.assert_close(lp_batch[1, :n], lp_alone[0, :n], rtol=0, atol=ATOL)
    torch.testing.assert_close(v_batch[1, :n], v_alone[0, :n], rtol=0, atol=ATOL)

    # The reward model reads prompt + response right-padded: the score ignores padding too.
    with torch.no_grad():
        s_alone = last_token_scores(critic, alone.input_ids, alone.attention_mask)
        s_batch = last_token_scores(critic, batch.input_ids, batch.attention_mask)
    torch.testing.assert_close(s_batch[1], s_alone[0], rtol=0, atol=ATOL)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_sampling_distribution_equals_the_recomputed_policy(arch, assets):
    """``generate`` on a left-padded batch sees the same distribution the trainer recomputes as
    log π_old, so the rollout is on-policy (including GPT-2's absolute positions)."""
    tok = assets.tokenizer
    actor = load_causal_lm(str(assets.policy(arch)))
    prompt_ids, prompt_mask = pad_left(
        [_ids(tok, p) for p in ("hhhhhhhh 1", "ab 1")], tok.pad_token_id
    )
    with torch.no_grad():
        out = actor.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            do_sample=False,
            max_new_tokens=6,
            min_new_tokens=6,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        resp = out.sequences[:, prompt_ids.shape[1] :]
        mask = torch.ones_like(resp, dtype=torch.bool)
        r = Rollout(prompt_ids, prompt_mask, resp, mask, torch.zeros(2, dtype=torch.bool))
        recomputed = response_logits(actor, r)
    generated = torch.stack(out.logits, dim=1)
    torch.testing.assert_close(recomputed, generated, rtol=0, atol=ATOL)  # observed ~1e-7
