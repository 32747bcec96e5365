"""Every row format × every command it applies to, through the real command line on the tiny models,
from the example files in tests/fixtures/data/ (the ones docs/data.md links): one short run each; the
same rows in two formats give the same tokens and the same first step (every logged number but the
clock's); a conversation that does not end with the assistant's turn where one is needed is one
line and exit status 2.

The tiny models have no chat template; every run gets tests/fixtures/data/chat_template.jinja through
``model.chat_template`` (the plain-string rows are the conversational ones written out in that
template: user ``8 q ``, assistant ``9 a<eos>``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from ppo_support import without_timing  # noqa: E402  (tests/trainers/ppo is on sys.path)

from proximal.cli import main
from proximal.data.chat import set_chat_template
from proximal.data.preferences import load_preference_pairs
from proximal.data.prompts import load_prompts, load_texts
from proximal.data.sft import load_sft_examples
from proximal.logging import read_metrics
from proximal.models.loading import load_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"
TEMPLATE = FIXTURES / "chat_template.jinja"


def config(command: str, assets, data: dict, out: Path, **sections) -> dict:
    """A one-step run of ``command`` on the tiny llama (rm: the tiny reward model, whose score head is
    random, so its first loss depends on the tokens)."""
    model = assets.reward_model() if command == "rm" else assets.policy()
    cfg = {"model": {"path": str(model), "chat_template": str(TEMPLATE)}, "data": dict(data)}
    if command in ("ppo", "grpo"):
        cfg["model"]["reward_functions"] = ["ppo_support:frac_a"]
        cfg["data"]["max_prompt_length"] = 16
        cfg["train"] = {"steps": 1, "seed": 0, "device": "cpu"}
        cfg["optim"] = {"lr": 1e-3}
        if command == "ppo":
            cfg["model"]["critic"] = "policy"
            cfg["rollout"] = {"batch_size": 4, "max_new_tokens": 6}
            cfg["ppo"] = {"epochs": 1, "mini_batch_size": 4, "micro_batch_size": 2}
            cfg["optim"]["critic_lr"] = 1e-3
        else:
            cfg["rollout"] = {"batch_size": 2, "group_size": 4, "max_new_tokens": 6}
            cfg["grpo"] = {"micro_batch_size": 4, "beta": 0.04}
    else:
        cfg["data"]["max_length"] = 32
        cfg["train"] = {"batch_size": 8, "micro_batch_size": 4, "steps": 1, "device": "cpu"}
        cfg["optim"] = {"lr": 1e-3}
    cfg["output"] = {"dir": str(out), "progress": False}
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def run(command: str, cfg: dict, capsys) -> dict:
    """``proximal COMMAND --config FILE``; the metrics of step 1 (its first training step)."""
    path = Path(cfg["output"]["dir"]).with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    assert main([command, "--config", str(path)]) == 0, capsys.readouterr().err
    rows = read_metrics(Path(cfg["output"]["dir"]) / "metrics.jsonl")
    return next(r for r in rows if r["step"] == 1)


def fixture(name: str) -> str:
    return str(FIXTURES / name)


@pytest.fixture(scope="module")
def tok(assets):
    t = load_tokenizer(str(assets.policy()), role="model.path", padding_side="right")
    set_chat_template(t, str(TEMPLATE))
    return t


# ------------------------------------------------------------------------- the same rows, two ways


def test_same_rows_same_tokens(tok):
    """The fixture pairs hold the same rows: identical token ids and trained positions."""
    load = dict(max_length=32)
    plain, _ = load_sft_examples(fixture("sft_prompt_completion.jsonl"), tok, **load)
    conv, _ = load_sft_examples(
        fixture("sft_conversational.jsonl"), tok, **load, loss_on="all_assistant"
    )
    assert [e.input_ids for e in plain] == [e.input_ids for e in conv]
    assert [e.mask() for e in plain] == [e.mask() for e in conv]
    # by hand, row 1: "8 abc 9 " then "cba" + EOS trained
    chars = "abcdefgh 0123456789"
    assert plain[0].input_ids == [4 + chars.index(c) for c in "8 abc 9 cba"] + [1]
    assert plain[0].mask() == [False] * 8 + [True] * 4
    text, _ = load_sft_examples(fixture("sft_text.jsonl"), tok, **load, loss_on="all_tokens")
    whole, _ = load_sft_examples(
        fixture("sft_prompt_completion.jsonl"), tok, **load, loss_on="all_tokens"
    )
    assert [(e.input_ids, e.mask()) for e in text] == [(e.input_ids, e.mask()) for e in whole]

    pairs = {
        name: load_preference_pairs(fixture(f"pref_{name}.jsonl"), tok, **load)[0]
        for name in ("explicit", "implicit", "conversational")
    }
    sides = {n: [(p.chosen_ids, p.rejected_ids) for p in ps] for n, ps in pairs.items()}
    assert sides["explicit"] == sides["implicit"] == sides["conversational"]
    starts = {n: [p.prompt_len for p in ps] for n, ps in pairs.items()}
    assert starts["explicit"] == starts["conversational"]
    # the implicit prompt ends before the space after "9": that space opens the responses
    assert starts["implicit"] == [n - 1 for n in starts["explicit"]]

    prompts = [
        load_prompts(fixture(f"prompts_{k}.jsonl"), tok, max_length=16)
        for k in ("plain", "conversational")
    ]
    assert prompts[0].token_ids == prompts[1].token_ids and prompts[0].texts == prompts[1].texts

    ptx = load_texts(fixture("ptx_conversational.jsonl"), tokenizer=tok)
    assert ptx == [t + "<eos>" for t in load_texts(fixture("ptx_text.jsonl"))]


def test_sft_every_format(assets, tmp_path, capsys):
    def sft(name, out, **data):
        return run(
            "sft",
            config("sft", assets, {"train_file": fixture(name), **data}, tmp_path / out),
            capsys,
        )

    plain = sft("sft_prompt_completion.jsonl", "pc")
    conv = sft("sft_conversational.jsonl", "conv")
    assert without_timing(plain) == without_timing(conv)
    text = sft("sft_text.jsonl", "text")
    whole = sft("sft_prompt_completion.jsonl", "whole", loss_on="all_tokens")
    assert without_timing(text) == without_timing(whole)
    assert text["train/loss"] != plain["train/loss"]  # other tokens trained: a different loss
    multi = sft("sft_multiturn.jsonl", "multi")
    last = sft("sft_multiturn.jsonl", "last", loss_on="last_assistant")
    # Every assistant turn, not the last only. By hand: each row has two assistant turns, each
    # trained on its content and the template's EOS; the 8 answers of the file have 27 characters
    # and each is one row's first and another row's last answer: 2 * (27 + 8) against 27 + 8.
    lines = Path(fixture("sft_prompt_completion.jsonl")).read_text().splitlines()
    answers = [json.loads(x)["completion"] for x in lines]
    assert sum(map(len, answers)) == 27
    assert (multi["train/tokens"], last["train/tokens"]) == (70, 35)


@pytest.mark.parametrize("command", ["rm", "dpo", "simpo"])
def test_preference_commands_every_format(assets, tmp_path, capsys, command):
    got = {
        name: run(
            command,
            config(command, assets, {"train_file": fixture(f"pref_{name}.jsonl")}, tmp_path / name),
            capsys,
        )
        for name in ("explicit", "implicit", "conversational")
    }
    assert without_timing(got["explicit"]) == without_timing(got["conversational"])
    if command == "rm":  # the reward model scores the last token: where the prompt ends is moot
        assert without_timing(got["explicit"]) == without_timing(got["implicit"])
    else:  # the space after "9" is a response token of the implicit rows
        assert got["implicit"]["train/logp_chosen"] != got["explicit"]["train/logp_chosen"]


@pytest.mark.parametrize("command", ["ppo", "grpo"])
def test_online_commands_every_prompt_format(assets, tmp_path, capsys, command):
    plain = run(
        command,
        config(command, assets, {"prompts": fixture("prompts_plain.jsonl")}, tmp_path / "plain"),
        capsys,
    )
    conv = run(
        command,
        config(
            command, assets, {"prompts": fixture("prompts_conversational.jsonl")}, tmp_path / "conv"
        ),
        capsys,
    )
    assert without_timing(plain) == without_timing(conv)


def test_ppo_ptx_from_conversations(assets, tmp_path, capsys):
    data = {"prompts": fixture("prompts_conversational.jsonl"), "ptx_batch_size": 4}
    ptx = {}
    for name in ("text", "conversational"):
        cfg = config(
            "ppo",
            assets,
            {**data, "ptx_file": fixture(f"ptx_{name}.jsonl")},
            tmp_path / name,
            ppo={"ptx_coef": 0.5},
        )
        ptx[name] = run("ppo", cfg, capsys)["loss/ptx"]
    # the same texts but each conversation's closing EOS (the template's): a nearby, different loss
    assert ptx["text"] != ptx["conversational"]
    assert ptx["conversational"] == pytest.approx(ptx["text"], rel=0.2)


# ------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "command, row",
    [
        (
            "sft",
            {
                "messages": [
                    {"role": "user", "content": "ab"},
                    {"role": "assistant", "content": "c"},
                    {"role": "user", "content": "d"},
                ]
            },
        ),
        (
            "rm",
            {
                "prompt": [{"role": "user", "content": "ab"}],
                "chosen": [{"role": "user", "content": "c"}],
                "rejected": [{"role": "assistant", "content": "d"}],
            },
        ),
        (
            "dpo",
            {
                "chosen": [{"role": "user", "content": "ab"}],
                "rejected": [{"role": "user", "content": "ab"}],
            },
        ),
    ],
)
def test_a_conversation_not_ending_with_the_assistant(assets, tmp_path, capsys, command, row):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(row) + "\n")
    path = tmp_path / "bad.yaml"
    path.write_text(
        yaml.safe_dump(config(command, assets, {"train_file": str(f)}, tmp_path / "run"))
    )
    assert main([command, "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.strip()]
    assert f"{f}:1: " in line and "must be the assistant's" in line
    assert not (tmp_path / "run").exists()
