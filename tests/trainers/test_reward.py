"""``proximal rm`` end to end on a tiny model; scores, losses and accuracy checked independently.

The reference computations run each sequence alone through a plainly loaded
``AutoModelForSequenceClassification`` (no padding, Hugging Face's own pooling) and write the
Bradley–Terry loss out with ``math``.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import yaml

from proximal.cli import main
from proximal.config import describe, load_config
from proximal.data.preferences import collate_pairs, load_preference_pairs
from proximal.logging import read_metrics
from proximal.models.reward import load_reward_model, pair_scores
from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm, build_tiny_reward_model
from proximal.trainers.reward import RMConfig, train
from proximal.trainers.sft import SFTConfig


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer("ab=")


@pytest.fixture(scope="module")
def lm(tmp_path_factory, tok):
    """A random tiny causal LM (standing in for an SFT checkpoint)."""
    return build_tiny_causal_lm(tmp_path_factory.mktemp("rm") / "lm", tok, seed=0)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, tok):
    """A random tiny one-label sequence classifier (random, non-zero head)."""
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "cls", tok, seed=1)


def count_task(n: int, seed: int) -> list[dict]:
    """Pairs of 6-letter a/b strings; the one with more a's is chosen (no ties)."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        x, y = ("".join(rng.choice("ab") for _ in range(6)) for _ in range(2))
        if x.count("a") != y.count("a"):
            c, r = (x, y) if x.count("a") > y.count("a") else (y, x)
            rows.append({"prompt": "=", "chosen": c, "rejected": r})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def make_cfg(model_path, tmp_path, train_rows, eval_rows=None, **overrides) -> RMConfig:
    o = {
        "model.path": str(model_path),
        "data.train_file": write_jsonl(tmp_path / "train.jsonl", train_rows),
        "data.max_length": 16,
        "output.dir": str(tmp_path / "run"),
        "train.device": "cpu",
        **overrides,
    }
    if eval_rows is not None:
        o["data.eval_file"] = write_jsonl(tmp_path / "eval.jsonl", eval_rows)
    return load_config(RMConfig, overrides=o)


def plain_score(model, tok, prompt: str, response: str) -> float:
    """One sequence alone, no padding: HF's pooled output is the head at the last token (the EOS)."""
    ids = tok(prompt + response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_scores_are_the_head_at_the_last_real_token(classifier, tok, tmp_path):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(classifier).eval()
    rows = [
        {"prompt": "=", "chosen": "a", "rejected": "abbbbab"},
        {"prompt": "ab=", "chosen": "bbbb", "rejected": "b"},
    ]
    pairs, _ = load_preference_pairs(write_jsonl(tmp_path / "p.jsonl", rows), tok, max_length=16)
    batch = collate_pairs(pairs, tok.pad_token_id)  # right-padded, lengths 3..9
    with torch.no_grad():
        r_w, r_l = pair_scores(model, batch)
        hf_pooled = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits[:, 0]
    expected_w = [plain_score(model, tok, r["prompt"], r["chosen"]) for r in rows]
    expected_l = [plain_score(model, tok, r["prompt"], r["rejected"]) for r in rows]
    assert r_w.tolist() == pytest.approx(expected_w, abs=1e-5)
    assert r_l.tolist() == pytest.approx(expected_l, abs=1e-5)
    assert len(set(expected_w + expected_l)) == 4  # the check has teeth: the four scores differ
    # pad != EOS here, so HF's own pooling of the padded batch agrees
    assert hf_pooled.tolist() == pytest.approx(expected_w + expected_l, abs=1e-5)


def test_pad_equal_to_eos_is_warned_about(lm):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(lm)
    tok.pad_token = tok.eos_token
    with pytest.warns(UserWarning, match="pad token is its EOS token"):
        model, new_head = load_reward_model(str(lm), "float32", tok)
    assert new_head and model.config.pad_token_id == tok.eos_token_id == 1


def test_rm_learns_a_preference_and_saves_a_plain_classifier(lm, tok, tmp_path):
    train_rows, eval_rows = count_task(256, seed=1), count_task(128, seed=2)
    cfg = make_cfg(
        lm,
        tmp_path,
        train_rows,
        eval_rows,
        **{
            "optim.lr": 3e-3,
            "train.steps": 60,
            "train.batch_size": 16,
            "train.micro_batch_size": 8,
            "train.eval_every": 20,
        },
    )
    out = train(cfg)
    rows = read_metrics(out / "metrics.jsonl")
    evals = {r["step"]: r for r in rows if "eval/accuracy" in r}
    assert sorted(evals) == [0, 20, 40, 60]

    # Step 0: the fresh head is zero, so every score is 0: loss ln 2, and ties count as wrong.
    assert rows[0]["model/new_head"] == 1
    assert evals[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert evals[0]["eval/accuracy"] == 0.0 and evals[0]["eval/reward_gap"] == 0.0

    final = evals[60]
    assert final["eval/accuracy"] >= 0.9  # chance is 0.5 (128 pairs: a 0.9 by luck is p < 1e-20)
    assert final["eval/loss"] < 0.35 < math.log(2)
    assert final["eval/reward_gap"] > 1.0

    # Plain transformers loads it; scoring each held-out pair alone reproduces the logged numbers.
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id == tok.pad_token_id
    assert model.config.architectures == ["LlamaForSequenceClassification"]
    gaps = [
        plain_score(model, tok, r["prompt"], r["chosen"])
        - plain_score(model, tok, r["prompt"], r["rejected"])
        for r in eval_rows
    ]
    assert sum(g > 0 for g in gaps) / len(gaps) == final["eval/accuracy"]
    assert sum(gaps) / len(gaps) == pytest.approx(final["eval/reward_gap"], rel=1e-4)
    assert sum(softplus(-g) for g in gaps) / len(gaps) == pytest.approx(
        final["eval/loss"], rel=1e-4
    )
    assert load_config(RMConfig, out / "config.yaml") == cfg


def test_margin_enters_the_loss(lm, tmp_path):
    margins = [0.0, 1.0, 2.0, 3.0]
    rows = [{"prompt": "=", "chosen": "a", "rejected": "b", "margin": m} for m in margins]
    cfg = make_cfg(
        lm,
        tmp_path,
        rows,
        rows,
        **{"train.batch_size": 4, "train.micro_batch_size": 2, "train.steps": 1},
    )
    metrics = read_metrics(train(cfg) / "metrics.jsonl")
    # Zero head: r_w = r_l = 0, so −log σ(0 − m) = softplus(m) per pair.
    expected = sum(softplus(m) for m in margins) / 4
    assert metrics[0]["eval/loss"] == pytest.approx(expected, rel=1e-6)
    assert metrics[1]["train/loss"] == pytest.approx(
        expected, rel=1e-6
    )  # measured before the update


def test_existing_classifier_keeps_its_head_and_accumulation_matches(classifier, tok, tmp_path):
    """One step from a random classifier: same loss and gradient norm as 1 micro-batch of 4 or 4 of 1."""
    rows = count_task(4, seed=3)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(classifier).eval()
    gaps = [
        plain_score(model, tok, r["prompt"], r["chosen"])
        - plain_score(model, tok, r["prompt"], r["rejected"])
        for r in rows
    ]
    expected_loss = sum(softplus(-g) for g in gaps) / 4
    logged = {}
    for micro in (4, 1):
        d = tmp_path / f"m{micro}"
        d.mkdir()
        cfg = make_cfg(
            classifier,
            d,
            rows,
            **{"train.batch_size": 4, "train.micro_batch_size": micro, "train.steps": 1},
        )
        logged[micro] = read_metrics(train(cfg) / "metrics.jsonl")
    assert logged[4][0]["model/new_head"] == 0
    for micro in (4, 1):
        assert logged[micro][1]["train/loss"] == pytest.approx(expected_loss, rel=1e-5)
        assert logged[micro][1]["train/reward_gap"] == pytest.approx(sum(gaps) / 4, rel=1e-4)
    assert logged[1][1]["train/grad_norm"] == pytest.approx(
        logged[4][1]["train/grad_norm"], rel=1e-4
    )


def write_yaml(path, model_path, tmp_path, train_file=None):
    cfg = {
        "model": {"path": str(model_path)},
        "data": {
            "train_file": train_file
            or write_jsonl(tmp_path / "train.jsonl", count_task(16, seed=5)),
            "eval_file": write_jsonl(tmp_path / "eval.jsonl", count_task(8, seed=6)),
            "max_length": 16,
        },
        "train": {"batch_size": 8, "micro_batch_size": 4, "steps": 2, "device": "cpu"},
        "optim": {"lr": 1e-3},
        "output": {"dir": str(tmp_path / "run")},
    }
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_cli_runs(lm, tmp_path, capsys):
    assert (
        main(
            [
                "rm",
                "--config",
                write_yaml(tmp_path / "rm.yaml", lm, tmp_path),
                "--train.eval_every",
                "1",
            ]
        )
        == 0
    )
    out = tmp_path / "run"
    for name in (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "config.yaml",
        "metrics.jsonl",
    ):
        assert (out / name).is_file(), name
    assert len([r for r in read_metrics(out / "metrics.jsonl") if "eval/accuracy" in r]) == 3
    assert "proximal rm: held-out accuracy" in capsys.readouterr().out


def test_cli_bad_preference_row_names_file_and_line(lm, tmp_path, capsys):
    bad = tmp_path / "prefs.jsonl"
    bad.write_text(
        '{"prompt": "=", "chosen": "a", "rejected": "b"}\n\n{"prompt": "=", "rejected": "b"}\n'
    )
    assert main(["rm", "--config", write_yaml(tmp_path / "rm.yaml", lm, tmp_path, str(bad))]) == 2
    err = capsys.readouterr().err
    assert f"proximal rm: {bad}:3: missing field 'chosen'" in err
    assert "Traceback" not in err


def test_cli_config_error_is_one_message(lm, tmp_path, capsys):
    config = write_yaml(tmp_path / "rm.yaml", lm, tmp_path)
    assert (
        main(
            [
                "rm",
                "--config",
                config,
                "--train.batch_size",
                "10",
                "--train.micro_batch_size",
                "4",
                "--optim.max_grad_norm",
                "-1",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("proximal rm:") == 1
    assert "train.batch_size = 10 is not divisible by train.micro_batch_size = 4" in err
    assert err.count("not divisible") == 1  # each problem once
    assert "optim.max_grad_norm = -1.0 must be ≥ 0 (0 = no clipping)" in err
    assert main(["rm", "--config", config, "--data.on_too_long", "truncate"]) == 2
    assert "data.on_too_long: 'truncate' is not one of 'error', 'skip'" in capsys.readouterr().err


def test_a_non_finite_loss_stops_the_run_with_exit_status_1(lm, tmp_path, capsys):
    # An absurd learning rate: the first step is finite; Adam's ±lr moves (weights near float32's
    # largest, 3.4e38) make the next forward overflow. (At 1e30 the final norm keeps the scores finite.)
    config = write_yaml(tmp_path / "rm.yaml", lm, tmp_path)
    argv = ["rm", "--config", config, "--optim.lr", "1e38", "--optim.max_grad_norm", "0"]
    assert main([*argv, "--train.steps", "3", "--output.progress", "false"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "proximal rm: step 2: the RM loss is nan; the step was not applied (lower optim.lr, "
        "or check the data)"
    ), err
    assert "Traceback" not in err
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1]


def test_sft_and_rm_configs_have_the_same_layout():
    """The same fields in the same order, but for SFT's choice of which tokens are trained."""
    sft_only = {"data.loss_on"}
    assert [n for n, *_ in describe(RMConfig)] == [
        n for n, *_ in describe(SFTConfig) if n not in sft_only
    ]


def test_every_field_is_documented():
    doc = (Path(__file__).parents[2] / "docs" / "rm.md").read_text()
    for name, _, _, help_ in describe(RMConfig):
        assert help_, name
        assert f"`{name}`" in doc, f"docs/rm.md does not document {name}"
