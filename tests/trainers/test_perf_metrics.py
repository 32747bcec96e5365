"""Every method logs ``perf/tokens_per_s``, ``perf/flops_per_s`` and ``perf/mfu`` (issue 22), and the
FLOPs behind them are the step's passes counted by hand.

The ratio ``perf/flops_per_s ÷ perf/tokens_per_s`` is the step's FLOPs per trained token — both are
divided by the same wall time, so it does not depend on the clock. Each run below trains one step on
a batch that is the whole data set (fixed methods) or on responses fixed in advance (PPO, GRPO), so
every sequence length is known and the step's FLOPs can be written out from the tiny models' shapes:

  tiny policy (tests/conftest.py): V = 23, hidden 32, 2 layers, 2 heads of 16, MLP 128
    body = 2 · (4·32·32 + 3·32·128) = 32768, head = 23·32 = 736, attention 4·L·d = 4·2·32 = 256
  tiny reward model, and the PPO critic built from the policy: the same body + a 32·1 score = 32800
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from grpo_support import grpo_config, grpo_main
from ppo_support import ppo_main, tiny_config

from proximal.cli import main
from proximal.data.preferences import load_preference_pairs
from proximal.data.sft import load_sft_examples
from proximal.logging import read_metrics
from proximal.models.loading import load_tokenizer
from proximal.rollout import collect
from proximal.rollout.sampling import Rollout, stop_mask

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"
BODY, HEAD, ATTN, SCORER = 32768, 736, 256, 32800
PERF = ("perf/tokens_per_s", "perf/flops_per_s", "perf/mfu")


def step_one(run_dir: Path) -> dict:
    """Step 1's row, after checking the three keys and that MFU is FLOP/s over perf.json's peak."""
    row = next(r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] == 1)
    assert all(row[k] > 0 for k in PERF), {k: row.get(k) for k in PERF}
    peak = json.loads((run_dir / "perf.json").read_text())
    assert peak["dtype"] == "float32" and peak["processes"] == 1
    assert row["perf/mfu"] == pytest.approx(
        row["perf/flops_per_s"] / peak["total_peak_flops_per_s"], rel=1e-12
    )
    return row


def flops_per_token(row: dict) -> float:
    return row["perf/flops_per_s"] / row["perf/tokens_per_s"]


def run_fixed(command: str, model: Path, data: str, out: Path, capsys, **sections) -> dict:
    cfg = {
        "model": {"path": str(model)},
        "data": {"train_file": str(FIXTURES / data), "max_length": 32},
        "train": {"batch_size": 8, "micro_batch_size": 4, "steps": 1, "device": "cpu"},
        "optim": {"lr": 1e-3},
        "output": {"dir": str(out), "progress": False},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    assert main([command, "--config", str(path)]) == 0, capsys.readouterr().err
    return step_one(out)


@pytest.fixture(scope="module")
def tok(assets):
    t = load_tokenizer(str(assets.policy()), role="model.path", padding_side="right")
    assert len(t) == 23  # the vocabulary the shapes above are written for
    return t


def test_sft(assets, tok, tmp_path, capsys):
    rows, _ = load_sft_examples(str(FIXTURES / "sft_prompt_completion.jsonl"), tok, max_length=32)
    assert len(rows) == 8  # one batch: every row
    s = [len(r.input_ids) for r in rows]
    targets = sum(r.n_targets for r in rows)
    row = run_fixed("sft", assets.policy(), "sft_prompt_completion.jsonl", tmp_path / "r", capsys)
    # the model trains on every token, its head scores the targets only
    flops = 6 * BODY * sum(s) + 6 * HEAD * targets + 3 * ATTN * sum(x * x for x in s)
    assert flops_per_token(row) == pytest.approx(flops / sum(s), rel=1e-12)


def pairs_lengths(tok):
    pairs, _ = load_preference_pairs(str(FIXTURES / "pref_explicit.jsonl"), tok, max_length=32)
    assert len(pairs) == 8
    s = [len(p.chosen_ids) for p in pairs] + [len(p.rejected_ids) for p in pairs]
    responses = sum(len(p.chosen_ids) + len(p.rejected_ids) - 2 * p.prompt_len for p in pairs)
    return s, responses


def test_rm(assets, tok, tmp_path, capsys):
    s, _ = pairs_lengths(tok)
    row = run_fixed("rm", assets.reward_model(), "pref_explicit.jsonl", tmp_path / "r", capsys)
    flops = 6 * SCORER * sum(s) + 3 * ATTN * sum(x * x for x in s)  # no language-model head
    assert flops_per_token(row) == pytest.approx(flops / sum(s), rel=1e-12)


@pytest.mark.parametrize(
    "command, extra, reference",
    [
        ("dpo", {}, True),  # the reference's forward over the same sequences
        ("dpo", {"train": {"precompute_ref_logprobs": True}}, False),  # before the first step
        ("simpo", {}, False),
    ],
)
def test_dpo_and_simpo(command, extra, reference, assets, tok, tmp_path, capsys):
    s, responses = pairs_lengths(tok)
    row = run_fixed(
        command, assets.policy(), "pref_explicit.jsonl", tmp_path / "r", capsys, **extra
    )
    squares = sum(x * x for x in s)
    flops = 6 * BODY * sum(s) + 6 * HEAD * responses + 3 * ATTN * squares
    if reference:
        flops += 2 * BODY * sum(s) + 2 * HEAD * responses + ATTN * squares
    assert flops_per_token(row) == pytest.approx(flops / sum(s), rel=1e-12)


# ------------------------------------------------------------------------- online methods


class FixedResponses:
    """Stands in for the sampler: every row's response is the same 6 letters (no stop), and the
    prompts' real lengths are recorded."""

    def __init__(self, tok):
        self.letters = tok("abcdef", add_special_tokens=False).input_ids
        self.prompt_lengths: list[int] = []

    def __call__(self, engine, tokenizer, prompt_ids, prompt_mask, **kwargs):
        B = prompt_ids.shape[0]
        self.prompt_lengths += prompt_mask.sum(1).tolist()
        resp = torch.tensor([self.letters] * B)
        mask, ended = stop_mask(resp, [tokenizer.eos_token_id])
        return Rollout(prompt_ids, prompt_mask, resp, mask, ended)


def decode(p: int, n: int) -> int:
    """Sampling n tokens after p prompt tokens (models/flops.py's docstring), written out."""
    prefill = 2 * BODY * p + 2 * HEAD + ATTN * p * p
    return prefill + (n - 1) * (2 * BODY + 2 * HEAD) + ATTN * sum(p + j for j in range(1, n))


def test_ppo(assets, tok, tmp_path, monkeypatch):
    """4 rows, one epoch in micro-batches of 2 (so π_old is its own pass): the actor decodes; π_old,
    π_ref and the critic score; actor and critic train. The reward is a function, not a model."""
    fake = FixedResponses(tok)
    monkeypatch.setattr(collect, "sample", fake)
    cfg = tiny_config(assets.policy(), assets.prompts, tmp_path / "r", train={"steps": 1})
    assert ppo_main(cfg) == 0
    row = step_one(tmp_path / "r")
    p, n = fake.prompt_lengths, 6
    assert len(p) == 4
    s = [x + n for x in p]
    tokens, squares, heads = sum(s), sum(x * x for x in s), n * len(p)
    lm_forward = 2 * BODY * tokens + 2 * HEAD * heads + ATTN * squares
    critic_forward = 2 * SCORER * tokens + ATTN * squares
    flops = (
        sum(decode(x, n) for x in p)
        + 2 * lm_forward  # π_old and π_ref
        + critic_forward  # V_old
        + 3 * lm_forward  # the actor's training pass
        + 3 * critic_forward  # the critic's
    )
    assert flops_per_token(row) == pytest.approx(flops / tokens, rel=1e-12)


def test_grpo(assets, tok, tmp_path, monkeypatch):
    """2 prompts × 4 responses, one optimiser step per batch (π_old is the update's own forward): the
    actor decodes, the reference (β = 0.04) scores, the actor trains."""
    fake = FixedResponses(tok)
    monkeypatch.setattr(collect, "sample", fake)
    assert (
        grpo_main(grpo_config(assets.policy(), assets.prompts, tmp_path / "r", train={"steps": 1}))
        == 0
    )
    row = step_one(tmp_path / "r")
    p, n = fake.prompt_lengths, 6
    assert len(p) == 8
    s = [x + n for x in p]
    tokens, squares, heads = sum(s), sum(x * x for x in s), n * len(p)
    lm_forward = 2 * BODY * tokens + 2 * HEAD * heads + ATTN * squares
    flops = sum(decode(x, n) for x in p) + lm_forward + 3 * lm_forward
    assert flops_per_token(row) == pytest.approx(flops / tokens, rel=1e-12)
