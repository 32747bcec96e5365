"""``proximal rm`` with ``model.lora_r``: the adapters on the backbone and the score head (peft's
``modules_to_save``) are all that train, counted by hand; every other weight stays bit for bit; the
merged export is a plain one-label classifier scoring as the trained model; the adapter export loads
through the reward-model loader PPO uses."""

from __future__ import annotations

import json
import random

import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification

from proximal.cli import main
from proximal.models.heads import last_token_scores
from proximal.models.loading import load_sequence_scorer
from proximal.trainers import reward

R = 2
IDS = torch.tensor([[4, 5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 10, 11]])
MASK = torch.ones_like(IDS)


def _argv(base, tmp_path, name, *extra):
    rng = random.Random(0)
    rows = [
        {"prompt": f"{x} ", "chosen": "a" * 3, "rejected": "b" * 3}
        for x in (rng.choice("abcdefgh") for _ in range(16))
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        "rm",
        *("--model.path", str(base), "--model.lora_r", str(R), "--data.train_file", str(data)),
        *("--data.max_length", "16", "--optim.lr", "3e-2", "--train.steps", "2"),
        *("--train.batch_size", "8", "--train.micro_batch_size", "4", "--train.device", "cpu"),
        *("--output.dir", str(tmp_path / name), "--output.progress", "false"),
        *extra,
    ]


def test_adapters_and_head_train_the_rest_is_frozen_and_both_exports_load(
    assets, tmp_path, monkeypatch, capsys
):
    seen = {}
    real_fit = reward.fit

    def fit(*args, model, **kw):
        seen["model"] = model
        return real_fit(*args, model=model, **kw)

    monkeypatch.setattr(reward, "fit", fit)
    base = assets.policy("llama")
    assert main(_argv(base, tmp_path, "merged")) == 0, capsys.readouterr().err
    model = seen["model"]
    c = json.loads((base / "config.json").read_text())
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    per_block = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    head = "base_model.model.score.modules_to_save.default.weight"
    assert head in trainable and trainable[head].shape == (1, h)
    assert sum(p.numel() for p in trainable.values()) == R * per_block * 2 + h == 2976
    assert all(".lora_" in n for n in trainable if n != head)
    original = load_file(str(base / "model.safetensors"))
    for n, p in model.named_parameters():
        if not p.requires_grad and "score" not in n:
            key = n.removeprefix("base_model.model.").replace(".base_layer", "")
            assert torch.equal(p, original[key]), key
    assert trainable[head].abs().max() > 0  # the zero-initialised head moved

    with torch.no_grad():
        want = last_token_scores(model, IDS, MASK)
        plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged")
        assert plain.config.num_labels == 1 and not any(
            "lora" in n for n, _ in plain.named_parameters()
        )
        torch.testing.assert_close(last_token_scores(plain, IDS, MASK), want, rtol=1e-5, atol=1e-5)

    # the adapters alone, loaded by the reward-model loader of ppo / grpo (merged as it loads)
    assert main(_argv(base, tmp_path, "adapters", "--output.merge_lora", "false")) == 0
    assert (tmp_path / "adapters" / "adapter_config.json").is_file()
    with torch.no_grad():
        want = last_token_scores(seen["model"], IDS, MASK)
        loaded = load_sequence_scorer(str(tmp_path / "adapters"))
        torch.testing.assert_close(last_token_scores(loaded, IDS, MASK), want, rtol=1e-5, atol=1e-5)
