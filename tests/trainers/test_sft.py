"""``proximal sft`` end to end on a tiny model, and its loss, schedule and accumulation by hand.

Expected values are computed independently of the trainer: per-sequence ``log_softmax`` on unpadded
inputs, entropies counted from the data, learning rates written out by hand.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
import yaml

from proximal.cli import main
from proximal.config import ConfigError, describe, load_config
from proximal.logging import read_metrics
from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm
from proximal.train.sections import PreferenceDataSection
from proximal.trainers.sft import SFTConfig, train
from proximal.trainers.sft_config import SFTData

LETTERS = "abcdefgh"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random tiny Llama and its char tokenizer, saved as a Hugging Face checkpoint."""
    d = tmp_path_factory.mktemp("sft")
    tok = build_char_tokenizer(LETTERS + "=")
    return build_tiny_causal_lm(d / "base", tok, seed=0), tok


def repeat_task(n: int, seed: int) -> list[dict]:
    """Prompt "x=", response "xxx": learnable only by reading the prompt."""
    rng = random.Random(seed)
    return [{"prompt": f"{x}=", "response": x * 3} for x in (rng.choice(LETTERS) for _ in range(n))]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def make_cfg(base_path, tmp_path, train_rows, eval_rows=None, **overrides) -> SFTConfig:
    o = {
        "model.path": str(base_path),
        "data.train_file": write_jsonl(tmp_path / "train.jsonl", train_rows),
        "data.max_length": 16,
        "output.dir": str(tmp_path / "run"),
        "train.device": "cpu",
        **overrides,
    }
    if eval_rows is not None:
        o["data.eval_file"] = write_jsonl(tmp_path / "eval.jsonl", eval_rows)
    return load_config(SFTConfig, overrides=o)


def hand_nll(model, tok, rows) -> tuple[float, int]:
    """Σ −log p over response tokens + EOS, each row run alone (no padding, no masks), and the token count."""
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
            y = tok(r["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            x = torch.tensor([p + y])
            logp = torch.log_softmax(model(input_ids=x).logits[0].double(), -1)
            for j, target in enumerate(y):
                total -= float(logp[len(p) + j - 1, target])
            count += len(y)
    return total, count


# --------------------------------------------------------------------------------------------------
# Training end to end
# --------------------------------------------------------------------------------------------------


def test_sft_lowers_held_out_loss_below_any_prompt_blind_model(base, tmp_path):
    base_path, tok = base
    train_rows, eval_rows = repeat_task(256, seed=1), repeat_task(64, seed=2)
    cfg = make_cfg(
        base_path,
        tmp_path,
        train_rows,
        eval_rows,
        **{
            "optim.lr": 3e-3,
            "train.steps": 100,
            "train.batch_size": 16,
            "train.micro_batch_size": 8,
            "optim.warmup_steps": 5,
            "train.eval_every": 25,
        },
    )
    out = train(cfg)
    rows = read_metrics(out / "metrics.jsonl")
    evals = {r["step"]: r["eval/loss"] for r in rows if "eval/loss" in r}
    assert sorted(evals) == [0, 25, 50, 75, 100]
    assert [r["step"] for r in rows] == list(range(101))

    # The best model that ignores the prompt knows only the position in the response: its loss is
    # the entropy of the target given the position, counted from the held-out data.
    by_pos = defaultdict(Counter)
    for r in eval_rows:
        for j, c in enumerate(list(r["response"]) + ["<eos>"]):
            by_pos[j][c] += 1
    n = sum(sum(c.values()) for c in by_pos.values())
    blind = -sum(k * math.log(k / sum(c.values())) for c in by_pos.values() for k in c.values()) / n
    assert 1.4 < blind < 1.7  # ~ 3/4 · ln 8

    assert evals[0] > 2.0  # random init: about ln(13 tokens) = 2.56
    assert evals[100] < 0.25 < blind / 5  # it reads the prompt
    assert evals[100] < evals[50] < evals[0]

    # The checkpoint loads with plain transformers, and its held-out loss — recomputed row by row
    # without padding or masks — is the logged one.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tok2 = AutoTokenizer.from_pretrained(out)
    total, count = hand_nll(model, tok2, eval_rows)
    assert count == rows[100]["eval/tokens"] == 64 * 4
    assert total / count == pytest.approx(evals[100], rel=1e-5)
    assert model.generation_config.eos_token_id == tok.eos_token_id

    # The resolved config is saved and round-trips.
    assert load_config(SFTConfig, out / "config.yaml") == cfg
    assert rows[0]["data/train_rows"] == 256 and rows[0]["data/eval_skipped"] == 0
    assert rows[1]["train/lr"] == 0.0  # warm-up step 0 of 5 (transformers.get_scheduler)
    assert rows[2]["train/lr"] == pytest.approx(3e-3 / 5)
    assert rows[100]["train/lr"] == pytest.approx(3e-3 / 95)


def test_accumulation_gives_the_full_batch_token_mean(base, tmp_path):
    """One step over 4 rows of very different response lengths, as 1 micro-batch of 4 or 4 of 1."""
    base_path, tok = base
    rows = [
        {"prompt": "a=", "response": "b"},
        {"prompt": "c=", "response": "defghabc"},
        {"prompt": "d=", "response": "aa"},
        {"prompt": "e=", "response": "hhhhh"},
    ]
    from transformers import AutoModelForCausalLM

    total, count = hand_nll(AutoModelForCausalLM.from_pretrained(base_path), tok, rows)
    logged = {}
    for micro in (4, 1):
        d = tmp_path / f"m{micro}"
        d.mkdir()
        cfg = make_cfg(
            base_path,
            d,
            rows,
            **{
                "train.batch_size": 4,
                "train.micro_batch_size": micro,
                "train.steps": 1,
                "optim.lr": 1e-3,
            },
        )
        logged[micro] = read_metrics(train(cfg) / "metrics.jsonl")[1]
    assert logged[4]["train/tokens"] == logged[1]["train/tokens"] == count == 2 + 9 + 3 + 6
    # the loss is a mean over tokens of the whole batch, however it is split
    assert logged[4]["train/loss"] == pytest.approx(total / count, rel=1e-5)
    assert logged[1]["train/loss"] == pytest.approx(total / count, rel=1e-5)
    assert logged[1]["train/grad_norm"] == pytest.approx(logged[4]["train/grad_norm"], rel=1e-4)


def test_output_dir_is_never_clobbered_by_accident(base, tmp_path):
    base_path, _ = base
    rows = repeat_task(8, seed=3)
    cfg = make_cfg(
        base_path, tmp_path, rows, **{"train.batch_size": 8, "train.micro_batch_size": 8}
    )
    out = train(cfg)

    def metrics():
        return [
            {k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "memory/"))}
            for r in read_metrics(out / "metrics.jsonl")
        ]

    first = metrics()
    with pytest.raises(
        FileExistsError, match=r"output.dir .*run already holds a run; continue it with --resume"
    ):
        train(cfg)
    cfg.output.overwrite = True
    assert train(cfg) == out
    # the old run's metrics were replaced, not appended to — and the same seed gave the same numbers
    assert metrics() == first and len(first) == 2
    stranger = tmp_path / "home"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    cfg.output.dir = str(stranger)
    with pytest.raises(ConfigError, match="does not look like a run directory"):
        train(cfg)
    assert (stranger / "notes.txt").read_text() == "mine"


def test_batch_larger_than_data_is_a_clear_error(base, tmp_path):
    base_path, _ = base
    cfg = make_cfg(
        base_path,
        tmp_path,
        repeat_task(5, seed=4),
        **{"train.batch_size": 8, "train.micro_batch_size": 4},
    )
    with pytest.raises(ConfigError, match=r"train.batch_size = 8 is larger than the 5 usable rows"):
        train(cfg)


# --------------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------------


def write_yaml(path, base_path, tmp_path, **sections):
    cfg = {
        "model": {"path": str(base_path)},
        "data": {
            "train_file": write_jsonl(tmp_path / "train.jsonl", repeat_task(16, seed=5)),
            "eval_file": write_jsonl(tmp_path / "eval.jsonl", repeat_task(8, seed=6)),
            "max_length": 16,
        },
        "train": {"batch_size": 8, "micro_batch_size": 4, "steps": 2, "device": "cpu"},
        "output": {"dir": str(tmp_path / "run")},
    }
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_cli_runs(base, tmp_path, capsys):
    base_path, _ = base
    config = write_yaml(tmp_path / "sft.yaml", base_path, tmp_path)
    assert main(["sft", "--config", config, "--optim.lr", "1e-3", "--train.seed=3"]) == 0
    out = tmp_path / "run"
    for name in (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "config.yaml",
        "metrics.jsonl",
    ):
        assert (out / name).is_file(), name
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 1e-3 and saved["train"]["seed"] == 3
    assert "proximal sft: held-out loss" in capsys.readouterr().out


def test_cli_config_errors_are_one_message(base, tmp_path, capsys):
    base_path, _ = base
    config = write_yaml(tmp_path / "a.yaml", base_path, tmp_path, train={"learn_rate": 0.1})
    assert main(["sft", "--config", config]) == 2
    err = capsys.readouterr().err
    assert (
        "train.learn_rate: unknown key (known here: activation_checkpointing, batch_size, "
        "compile, cpu_matmul, device," in err
    )

    # A field of the first release that moved names its new place.
    assert main(["sft", "--config", config, "--train.lr", "0.1", "--seed", "3"]) == 2
    err = capsys.readouterr().err
    assert "train.lr: no longer a field; the learning rate is optim.lr" in err
    assert "seed: no longer a field; the seed is train.seed" in err

    config = write_yaml(tmp_path / "b.yaml", base_path, tmp_path)
    assert (
        main(
            [
                "sft",
                "--config",
                config,
                "--train.batch_size",
                "6",
                "--train.micro_batch_size",
                "4",
                "--optim.lr",
                "-1",
                "--model.path",
                "",
                "--train.device",
                "tpu",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("proximal sft:") == 1
    assert "train.batch_size = 6 is not divisible by train.micro_batch_size = 4" in err
    assert err.count("not divisible") == 1  # each problem once
    assert "optim.lr = -1.0 must be a positive number" in err
    assert "model.path is required" in err
    assert "train.device = 'tpu' is not one of auto, cpu, cuda, cuda:N" in err
    assert not (tmp_path / "run").exists()  # nothing ran


def test_validate_lists_each_section_in_order_then_the_split_over_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # as under torchrun with 3 processes
    cfg = SFTConfig()  # model.path and data.train_file left empty
    cfg.data.max_length, cfg.optim.lr, cfg.train.keep_checkpoints, cfg.output.dir = 1, -1.0, 0, ""
    cfg.train.batch_size, cfg.train.micro_batch_size = 8, 4
    assert cfg.validate() == [
        "model.path is required (a checkpoint directory or hub id)",
        "data.train_file is required (a data file or a data set name; docs/data.md)",
        "data.max_length = 1 must be at least 2 (a prompt token and EOS)",
        "optim.lr = -1.0 must be a positive number",
        "train.keep_checkpoints = 0 must be ≥ 1",
        "output.dir is required",
        "train.batch_size = 8 is not divisible by the 3 processes (torchrun --nproc_per_node × nodes)",
    ]
    cfg.train.batch_size, cfg.train.micro_batch_size = 24, 6  # 8 rows each: not 6-row passes
    assert cfg.validate()[-1] == (
        "train.batch_size = 24 over 3 processes is 8 rows each, not divisible by "
        "train.micro_batch_size = 6"
    )
    cfg.train.micro_batch_size = 4  # 8 rows each in two passes of 4
    assert not any("train.batch_size" in e for e in cfg.validate())


def test_the_data_section_is_the_preference_pairs_one_worded_for_rows():
    """The data fields of sft that rm, dpo and simpo also have are theirs — names, types, defaults,
    choices and checks — each with its own --help text (sft's own fields, such as which tokens are
    trained, come after them)."""
    theirs = dataclasses.fields(PreferenceDataSection)
    ours = dataclasses.fields(SFTData)[: len(theirs)]
    assert [(f.name, f.type, f.metadata["choices"]) for f in ours] == [
        (f.name, f.type, f.metadata["choices"]) for f in theirs
    ]
    shared = {f.name for f in theirs}
    assert {k: v for k, v in dataclasses.asdict(SFTData()).items() if k in shared} == (
        dataclasses.asdict(PreferenceDataSection())
    )
    reworded = (
        "train_file",
        "eval_file",
        "max_length",
        "on_too_long",
        "on_empty",
    )  # rows, not pairs
    assert all(
        a.metadata["help"] != b.metadata["help"] for a, b in zip(ours, theirs) if a.name in reworded
    )
    assert SFTData(max_length=1, train_file="").problems() == [
        "data.train_file is required (a data file or a data set name; docs/data.md)",
        "data.max_length = 1 must be at least 2 (a prompt token and EOS)",
    ]


def test_a_non_finite_loss_stops_the_run_with_exit_status_1(base, tmp_path, capsys):
    # An absurd learning rate: the first step is finite; Adam's ±lr moves make the next forward overflow.
    base_path, _ = base
    config = write_yaml(
        tmp_path / "c.yaml",
        base_path,
        tmp_path,
        optim={"lr": 1e30, "max_grad_norm": 0},
        train={"steps": 3},
        output={"progress": False},
    )
    assert main(["sft", "--config", config]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "proximal sft: step 2: the SFT loss is nan; the step was not applied (lower optim.lr, "
        "or check the data)"
    ), err
    assert "Traceback" not in err
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1]


def test_cli_data_error_names_file_and_line_without_traceback(base, tmp_path, capsys):
    base_path, _ = base
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"prompt": "a=", "response": "aaa"}\n{"prompt": "b=", "response": "bbbbbbbbbbbbbbbbbbbb"}\n'
    )
    config = write_yaml(tmp_path / "c.yaml", base_path, tmp_path, data={"train_file": str(bad)})
    assert main(["sft", "--config", config]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: prompt + response is 23 tokens" in err and "data.max_length = 16" in err
    assert "Traceback" not in err


def test_every_field_is_documented(tmp_path):
    doc = (Path(__file__).parents[2] / "docs" / "sft.md").read_text()
    for name, _, _, help_ in describe(SFTConfig):
        assert help_, name
        assert f"`{name}`" in doc, f"docs/sft.md does not document {name}"


def test_keep_best_of_eval_loss_keeps_the_lowest_loss_by_default(base, tmp_path, capsys):
    """``output.keep_best: eval/loss`` with keep_best_mode left at its default (auto) keeps the step
    of the lowest held-out loss, and the start line says it takes smaller as better (issue 37)."""
    base_path, _ = base
    cfg = make_cfg(
        base_path,
        tmp_path,
        repeat_task(64, seed=1),
        repeat_task(16, seed=2),
        **{
            "optim.lr": 3e-3,
            "train.steps": 6,
            "train.batch_size": 16,
            "train.eval_every": 2,
            "train.save_every": 0,
            "train.keep_checkpoints": 1,
            "output.keep_best": "eval/loss",
        },
    )
    assert cfg.output.keep_best_mode == "auto"
    out = train(cfg)
    losses = {
        r["step"]: r["eval/loss"]
        for r in read_metrics(out / "metrics.jsonl")
        if "eval/loss" in r and r["step"] > 0
    }
    assert sorted(losses) == [2, 4, 6]
    lowest, highest = min(losses, key=losses.get), max(losses, key=losses.get)
    assert lowest != highest  # the loss moved, so max and min choose different steps
    from proximal.train.checkpoint import step_name

    assert (out / "checkpoints" / "best").resolve().parent.name == step_name(lowest)
    said = "keep best: eval/loss, smaller is better (output.keep_best_mode = auto"
    assert said in capsys.readouterr().out
    assert said in (out / "run.log").read_text()  # said before run.log opened: written there then


@pytest.mark.parametrize(
    ("metric", "mode", "want"),
    [
        ("eval/loss", "auto", "min"),
        ("eval/nll_loss", "auto", "min"),
        ("eval/kl", "auto", "min"),
        ("eval/kl_per_token", "auto", "min"),
        ("eval/kl_ref", "auto", "min"),
        ("eval/score", "auto", "max"),
        ("eval/accuracy", "auto", "max"),
        ("eval/loss_frac", "auto", "max"),
        ("eval/loss", "max", "max"),
        ("eval/score", "min", "min"),
    ],
)
def test_keep_best_mode_auto_resolves_by_the_metric_name(metric, mode, want):
    from proximal.train.records import resolve_best_mode

    assert resolve_best_mode(metric, mode)[0] == want


def test_a_smoke_run_of_a_hidden_256_model_does_not_compile_under_auto(tmp_path, capfd):
    """``train.compile: auto`` (the default) weighs compiling against the run's length: a 3-step run
    of a hidden-256 model (one process, CPU, no LoRA: every other condition of auto holds) stays
    eager, and models.json records the decision, the length and why (issue 37)."""
    tok = build_char_tokenizer(LETTERS + "=")
    base_path = build_tiny_causal_lm(tmp_path / "base256", tok, seed=0, hidden=256, heads=4)
    cfg = make_cfg(
        base_path,
        tmp_path,
        repeat_task(8, seed=1),
        **{"train.steps": 3, "train.batch_size": 2, "train.micro_batch_size": 2},
    )
    assert cfg.train.compile == "auto"
    out = train(cfg)
    record = json.loads((out / "models.json").read_text())["model"]["compile"]
    assert record["blocks"] == 0 and record["steps"] == 3 and record["pays"] is False
    assert record["why"].startswith(
        "train.compile = auto: hidden size 256 ≥ 256: 3 steps × about 0.1 s saved a step"
    )
    log = (out / "run.log").read_text()
    assert "proximal sft: compile: model: eager" in log
    # quiet by default: the backend's line is in run.log, not on stdout
    assert "proximal sft: cpu matmul: " in log
    printed = capfd.readouterr().out
    assert "cpu matmul" not in printed and "compile:" not in printed
