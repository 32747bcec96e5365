"""Scoring with a reward model whose tokenizer differs from the policy's (issue 3 item 4): the
response is decoded to text and re-tokenized for the reward model, its chat template honoured, in
the layout the reward trainer uses (prompt, response, EOS when the response ended)."""

from __future__ import annotations

import pytest
import torch

from proximal.data.collate import pad_left
from proximal.models.heads import last_token_scores
from proximal.models.loading import load_sequence_scorer, load_tokenizer
from proximal.rollout.sampling import Rollout, stop_mask
from proximal.rollout.scoring import Scorer, same_tokenizer

TEMPLATE = (
    "{% for m in messages %}x{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}y{% endif %}"
)


def _ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def setup(assets):
    policy_tok = load_tokenizer(str(assets.policy("llama")))
    rm_tok = load_tokenizer(str(assets.other_tokenizer_reward_model), padding_side="right")
    rm = load_sequence_scorer(str(assets.other_tokenizer_reward_model))
    prompts = ["ab 1", "cdd 2", "h 3"]
    prompt_ids, prompt_mask = pad_left(
        [_ids(policy_tok, p) for p in prompts], policy_tok.pad_token_id
    )
    eos, pad = policy_tok.eos_token_id, policy_tok.pad_token_id
    resp = torch.tensor(
        [
            _ids(policy_tok, "hg") + [eos, pad, pad, pad],  # ended with EOS
            _ids(policy_tok, "abcdef"),  # ran out of tokens
            [eos, pad, pad, pad, pad, pad],
        ]
    )  # an empty completion
    mask, ended = stop_mask(resp, [eos])
    return policy_tok, rm_tok, rm, prompts, Rollout(prompt_ids, prompt_mask, resp, mask, ended)


def _score_alone(rm, ids):
    with torch.no_grad():
        return last_token_scores(
            rm, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)
        )[0]


def test_reward_model_with_another_tokenizer_reads_retokenized_text(setup):
    policy_tok, rm_tok, rm, prompts, rollout = setup
    assert not same_tokenizer(policy_tok, rm_tok)
    scorer = Scorer(policy_tok, reward_model=rm, reward_tokenizer=rm_tok, micro_batch_size=2)
    assert not scorer.reuse_ids
    scores, parts = scorer(rollout, prompts)
    eos = rm_tok.eos_token_id
    expected_rows = [
        _ids(rm_tok, "ab 1hg") + [eos],
        _ids(rm_tok, "cdd 2abcdef"),
        _ids(rm_tok, "h 3") + [eos],
    ]
    assert scorer._reward_model_inputs(rollout, prompts, None) == expected_rows
    expected = torch.stack([_score_alone(rm, ids) for ids in expected_rows])
    torch.testing.assert_close(parts["reward_model"], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-6)

    # The control: feeding the policy's ids to this reward model scores something else entirely.
    policy_row = (
        rollout.prompt_ids[0][rollout.prompt_mask[0].bool()].tolist()
        + rollout.response_ids[0][:3].tolist()
    )
    assert abs(float(_score_alone(rm, policy_row)) - float(expected[0])) > 1e-4


def test_reward_model_chat_template_is_honoured(setup):
    policy_tok, rm_tok, rm, prompts, rollout = setup
    rm_tok = load_tokenizer(rm_tok.name_or_path, padding_side="right")
    rm_tok.chat_template = TEMPLATE
    scorer = Scorer(policy_tok, reward_model=rm, reward_tokenizer=rm_tok)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    rows = scorer._reward_model_inputs(rollout, prompts, messages)
    eos = rm_tok.eos_token_id
    assert rows == [
        _ids(rm_tok, "xab 1yhg") + [eos],
        _ids(rm_tok, "xcdd 2yabcdef"),
        _ids(rm_tok, "xh 3y") + [eos],
    ]


def test_same_tokenizer_reuses_the_policy_ids(assets, setup):
    policy_tok, _, _, prompts, rollout = setup
    rm = load_sequence_scorer(str(assets.reward_model("llama")))
    rm_tok = load_tokenizer(str(assets.reward_model("llama")), padding_side="right")
    scorer = Scorer(policy_tok, reward_model=rm, reward_tokenizer=rm_tok, micro_batch_size=2)
    assert scorer.reuse_ids
    rows = scorer._reward_model_inputs(rollout, prompts, None)
    eos = policy_tok.eos_token_id
    assert rows == [
        _ids(policy_tok, "ab 1hg") + [eos],
        _ids(policy_tok, "cdd 2abcdef"),
        _ids(policy_tok, "h 3") + [eos],
    ]
    scores, _ = scorer(rollout, prompts)
    torch.testing.assert_close(
        scores, torch.stack([_score_alone(rm, ids) for ids in rows]), rtol=0, atol=1e-6
    )
