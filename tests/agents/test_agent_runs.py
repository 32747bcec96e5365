"""``proximal ppo`` and ``proximal grpo`` with ``env:`` / ``tools:`` end to end on the tiny Llama.

* A one-turn environment whose ``get_reward`` is the verifier's score reproduces today's single-turn
  run bit for bit — metrics and weights (the trajectory path changes nothing when there is one turn).
* A multi-turn run: agent/* metrics every step, samples.jsonl keeps each trajectory's turns, the
  per-turn rewards reach the score (GRPO) and the shaped rewards (PPO).
* Tools in a run: a raising tool, a hanging one (ended within its timeout + slack), a malformed call
  and a non-text result — each counted in agent/*, none hangs or crashes the run.
* Resume of a multi-turn run continues exactly.
* The one-line refusals.
"""

from __future__ import annotations

import time

import pytest
import torch
from agent_support import TOOLS_TEMPLATE
from ppo_support import (
    checkpoint_dirs,
    command_main,
    load_safetensors_dir,
    prompt_texts,
    read_jsonl,
    tiny_config,
    without_timing,
)

from proximal.data.jsonl import write_jsonl
from proximal.models.loading import load_tokenizer


def ppo_main(config: dict | None, *args: str) -> int:
    return command_main("ppo", config, *args)


def grpo_main(config: dict | None, *args: str) -> int:
    return command_main("grpo", config, *args)


def grpo_config(policy, prompts, run_dir, **sections) -> dict:
    """tests/trainers/grpo_support.py's few cheap GRPO steps (that directory is not on this one's path)."""
    cfg = {
        "model": {"path": str(policy), "reward_functions": ["ppo_support:frac_a"]},
        "data": {"prompts": str(prompts), "max_prompt_length": 16},
        "rollout": {"batch_size": 2, "group_size": 4, "max_new_tokens": 8},
        "grpo": {"micro_batch_size": 4, "beta": 0.04},
        "optim": {"lr": 1e-3},
        "train": {"steps": 2, "seed": 0, "device": "cpu"},
        "output": {"dir": str(run_dir), "progress": False, "samples_per_step": 2},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def _prompts(tmp_path, n: int = 8, **columns):
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"prompt": p, **columns} for p in prompt_texts(n)])
    return path


def _comparable(row: dict) -> dict:
    """A metrics row without timing and without the agent's own metrics."""
    return {k: v for k, v in without_timing(row).items() if not k.startswith("agent/")}


def _final_weights(run_dir):
    return load_safetensors_dir(checkpoint_dirs(run_dir)[-1] / "policy")


def _same_runs(a_dir, b_dir):
    a, b = read_jsonl(a_dir / "metrics.jsonl"), read_jsonl(b_dir / "metrics.jsonl")
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        x, y = _comparable(x), _comparable(y)
        diff = {k: (x.get(k), y.get(k)) for k in x.keys() | y.keys() if x.get(k) != y.get(k)}
        assert not diff, f"step {x['step']}: {diff}"
    wa, wb = _final_weights(a_dir), _final_weights(b_dir)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# One turn, done after it, no reward of its own: the verifier scores the trajectory, as it scores
# today's response. (An environment's get_reward sees the turns it stepped; a turn cut by
# rollout.max_new_tokens is never stepped, so a FracA environment would score those 0.)
ONE_TURN = {"factory": "agent_support:OneTurn", "max_turns": 1}


def test_grpo_one_turn_environment_is_todays_run_bit_for_bit(assets, tmp_path, capsys):
    prompts = _prompts(tmp_path)
    train = {"steps": 2, "save_every": 2}
    plain = grpo_config(assets.policy("llama"), prompts, tmp_path / "plain", train=train)
    agent = grpo_config(
        assets.policy("llama"),
        prompts,
        tmp_path / "agent",
        train=train,
        env=ONE_TURN,
        tools={"workers": 1},
    )
    assert grpo_main(plain) == 0, capsys.readouterr().err
    assert grpo_main(agent) == 0, capsys.readouterr().err
    _same_runs(tmp_path / "plain", tmp_path / "agent")
    rows = read_jsonl(tmp_path / "agent" / "metrics.jsonl")
    assert all(r["agent/turns"] == 1.0 for r in rows)
    assert read_jsonl(tmp_path / "plain" / "samples.jsonl") == [
        {k: v for k, v in r.items() if k != "trajectory"}
        for r in read_jsonl(tmp_path / "agent" / "samples.jsonl")
    ]


def test_ppo_one_turn_environment_is_todays_run_bit_for_bit(assets, tmp_path, capsys):
    prompts = _prompts(tmp_path)
    train = {"steps": 2, "save_every": 2}
    plain = tiny_config(assets.policy("llama"), prompts, tmp_path / "plain", train=train)
    agent = tiny_config(
        assets.policy("llama"),
        prompts,
        tmp_path / "agent",
        train=train,
        env=ONE_TURN,
        tools={"workers": 1},
    )
    assert ppo_main(plain) == 0, capsys.readouterr().err
    assert ppo_main(agent) == 0, capsys.readouterr().err
    _same_runs(tmp_path / "plain", tmp_path / "agent")


# ----------------------------------------------------------------------------------------------
# Multi-turn runs
# ----------------------------------------------------------------------------------------------

TALK = {"factory": "agent_support:Talk", "max_turns": 3}


def _multi_turn_checks(run_dir, steps: int):
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert 1.0 <= r["agent/turns"] <= 3.0 and r["agent/observation_tokens"] >= 0
        assert (
            abs(sum(r[f"agent/stop_{s}"] for s in ("done", "max_turns", "turn_length")) - 1) < 1e-9
        )
        assert r["agent/tool_calls"] == 0 and "score/env" in r
    assert any(r["agent/turns"] > 1 for r in rows), "no row had a second turn: pick other seeds"
    samples = read_jsonl(run_dir / "samples.jsonl")
    multi = [s for s in samples if len(s["trajectory"]["turns"]) > 1]
    assert multi
    for s in multi:
        turns = s["trajectory"]["turns"]
        # the observation after each turn but the last is the environment's reply, in the response
        assert all(t["observation"] == [{"role": "user", "content": "ab"}] for t in turns[:-1])
        first = turns[0]["agent"]
        for special in ("<bos>", "<unk>", "<pad>"):  # a random tiny policy samples them too
            first = first.replace(special, "")
        assert s["response"].startswith(first)
        want = [0.1 * t["agent"].count("a") for t in turns]
        if s["trajectory"]["stop"] == "turn_length":  # a turn cut by the limit is never stepped
            want[-1] = 0.0
        assert [t["reward"] for t in turns] == pytest.approx(want, abs=1e-12)


def test_grpo_multi_turn_run(assets, tmp_path, capsys):
    """GRPO over a two-turn environment (the step form: a reply, per-turn rewards, an outcome):
    agent/* every step, each trajectory's turns in samples.jsonl, and the score = the outcome +
    the per-turn rewards (GRPO's baseline over whole trajectories)."""
    prompts = _prompts(tmp_path, turns=2)
    cfg = grpo_config(
        assets.policy("llama"),
        prompts,
        tmp_path / "run",
        model={"reward_functions": []},
        rollout={"stop_token_ids": [11, 12, 13]},  # a few digits end a turn too: turns stop early
        env=TALK,
        tools={"workers": 1},
        output={"samples_per_step": 8},
    )
    assert grpo_main(cfg) == 0, capsys.readouterr().err
    _multi_turn_checks(tmp_path / "run", 2)
    for s in read_jsonl(tmp_path / "run" / "samples.jsonl"):
        turn_sum = sum(t["reward"] for t in s["trajectory"]["turns"])
        assert s["score"] == pytest.approx(s["score/env"] + turn_sum, abs=1e-6)


def test_ppo_multi_turn_run(assets, tmp_path, capsys):
    """PPO with the critic across turns over the same environment: the per-turn rewards reach the
    shaped rewards (reward/total_mean = the score + the turn rewards − β·KL, so it moves with them)."""
    prompts = _prompts(tmp_path, turns=2)
    cfg = tiny_config(
        assets.policy("llama"),
        prompts,
        tmp_path / "run",
        model={"reward_functions": []},
        rollout={"stop_token_ids": [11, 12, 13]},
        env=TALK,
        tools={"workers": 1},
        output={"samples_per_step": 8},
    )
    assert ppo_main(cfg) == 0, capsys.readouterr().err
    _multi_turn_checks(tmp_path / "run", 2)
    for s in read_jsonl(tmp_path / "run" / "samples.jsonl"):
        assert s["score"] == pytest.approx(s["score/env"], abs=1e-6)  # turn rewards not in it


@pytest.mark.parametrize("staleness", [0, 1])
def test_grpo_multi_turn_resume_continues_exactly(assets, tmp_path, monkeypatch, capsys, staleness):
    """Also at rollout.staleness 1: the trajectories (environments, tools and all) are sampled in
    the generator process, and a checkpoint holds those in flight."""
    from proximal.train import run

    prompts = _prompts(tmp_path, 6, turns=2)

    def cfg(name):
        return grpo_config(
            assets.policy("llama"),
            prompts,
            tmp_path / name,
            model={"reward_functions": ["ppo_support:length"]},
            rollout={"stop_token_ids": [11, 12, 13], "group_size": 2, "staleness": staleness},
            grpo={"iterations": 2, "mini_batch_size": 2, "micro_batch_size": 1},
            env=TALK,
            tools={"workers": 1},
            train={"steps": 3, "save_every": 1, "keep_checkpoints": 3},
        )

    assert grpo_main(cfg("full")) == 0, capsys.readouterr().err
    save = run.save_checkpoint

    def save_then_die(root, step, **kwargs):
        out = save(root, step, **kwargs)
        if step == 2:
            raise SystemExit("killed after step 2")
        return out

    with monkeypatch.context() as mp:
        mp.setattr(run, "save_checkpoint", save_then_die)
        with pytest.raises(SystemExit, match="killed after step 2"):
            grpo_main(cfg("crashed"))
    assert grpo_main(None, "--resume", str(tmp_path / "crashed")) == 0, capsys.readouterr().err
    full = read_jsonl(tmp_path / "full" / "metrics.jsonl")
    resumed = read_jsonl(tmp_path / "crashed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for a, b in zip(full, resumed):
        a, b = without_timing(a), without_timing(b)
        assert a == b, {k: (a.get(k), b.get(k)) for k in a if a.get(k) != b.get(k)}
    assert any(r["agent/turns"] > 1 for r in full[2:])
    if staleness:
        assert [r["rollout/version"] for r in full] == [0, 0, 1]
    assert read_jsonl(tmp_path / "full" / "samples.jsonl") == read_jsonl(
        tmp_path / "crashed" / "samples.jsonl"
    )
    _same_runs(tmp_path / "full", tmp_path / "crashed")


# ----------------------------------------------------------------------------------------------
# Tools in a run
# ----------------------------------------------------------------------------------------------

#: What the policy "writes" in its first turn, row by row (a random tiny model would not write a
#: call): a raising tool, a hanging one, a call naming no tool, an unreadable one, a non-text result.
SCRIPT = [
    "[fail 1]",
    "[hang 2]",
    "[nope 3]",
    "[table",
    "[table 3]",
    "[fail 4]",
    "[hang 5]",
    "[table 6]",
]


def test_conversational_rows_name_their_tools_and_the_limit_holds_with_the_schemas(
    assets, tmp_path, capsys
):
    """A run with tools and conversational prompts: a row's ``tools`` column of names picks the
    schemas its chat template shows (the loader refused such a column before), and
    ``data.max_prompt_length`` holds for the prompt as the model reads it, schemas included (they
    were added after the limit before): the truncations are counted and the samples' prompts are the
    truncated renderings."""
    path = tmp_path / "prompts.jsonl"
    texts = prompt_texts(8)
    offered = [["add"] if i % 2 else None for i in range(len(texts))]  # odd rows name one tool
    write_jsonl(
        path,
        [
            {"messages": [{"role": "user", "content": p}], **({"tools": o} if o else {})}
            for p, o in zip(texts, offered)
        ],
    )
    cfg = grpo_config(
        assets.policy("llama"),
        path,
        tmp_path / "run",
        model={"chat_template": TOOLS_TEMPLATE},
        tools={
            "functions": ["agent_support:add", "agent_support:table"],
            "format": "minimal",
            "workers": 1,
        },
        env={"max_turns": 2},
        train={"steps": 1},
        output={"samples_per_step": 8},
    )
    assert grpo_main(cfg) == 0, capsys.readouterr().err
    # by hand: the template over each row's offered tools, then the loader's rule (keep the end)
    tok = load_tokenizer(str(assets.policy("llama")))
    limit = cfg["data"]["max_prompt_length"]
    ids = [
        tok(f"7 {' '.join(o or ['add', 'table'])} 8 {p} 9 ")["input_ids"]
        for p, o in zip(texts, offered)
    ]
    assert 0 < sum(len(i) > limit for i in ids) < len(ids)  # some rows only: the test can tell
    [row] = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert row["data/prompts_truncated"] == sum(len(i) > limit for i in ids)
    want = {tok.decode(i[-limit:], skip_special_tokens=False) for i in ids}
    sampled = {s["prompt"] for s in read_jsonl(tmp_path / "run" / "samples.jsonl")}
    assert sampled and sampled <= want


def _scripted(monkeypatch, tok, script=SCRIPT):
    """Make every engine write script[row] as a row's first turn (then sample as it would)."""
    from proximal.rollout.engine import HFEngine

    generate = HFEngine.generate
    eos = tok.eos_token_id

    def scripted(self, ids, mask, seeds, params, *, logprobs=False):
        out, mu = generate(self, ids, mask, seeds, params, logprobs=True)
        rows = [
            tok(script[i % len(script)], add_special_tokens=False)["input_ids"] + [eos]
            for i in range(len(ids))
        ]
        width = max(out.shape[1], *(len(r) for r in rows))
        out = torch.nn.functional.pad(out, (0, width - out.shape[1]), value=eos)
        mu = torch.nn.functional.pad(mu, (0, width - mu.shape[1]))
        for i in range(len(ids)):
            if not (ids[i][mask[i].bool()] == eos).any():  # the first turn: no agent turn ended yet
                out[i, : len(rows[i])] = torch.tensor(rows[i])
        return (out, mu) if logprobs else out

    monkeypatch.setattr(HFEngine, "generate", scripted)


def test_tools_in_a_run_are_counted_and_never_hang(tmp_path, monkeypatch, capsys):
    from proximal.tasks.calculator import build_tokenizer, make_task_data

    make_task_data(
        tmp_path / "data", n_sft_train=4, n_sft_eval=2, n_prompts_train=8, n_prompts_eval=2
    )
    tok = build_tokenizer()
    _scripted(monkeypatch, tok)
    cfg = grpo_config(
        tmp_path / "data" / "base_model",
        tmp_path / "data" / "prompts_train.jsonl",
        tmp_path / "run",
        model={"reward_functions": ["proximal.tasks.calculator:verify"]},
        rollout={"batch_size": 4, "group_size": 2, "max_new_tokens": 12},
        grpo={"micro_batch_size": 4},
        env={"max_turns": 2, "max_tokens": 80},  # room for the error texts (the context is 96)
        tools={
            "functions": ["agent_support:fail", "agent_support:hang", "agent_support:table"],
            "format": "minimal",
            "timeout_s": 1.0,
            "workers": 2,
        },
        train={"steps": 1},
        output={"samples_per_step": 8},
    )
    t0 = time.perf_counter()
    assert grpo_main(cfg) == 0, capsys.readouterr().err
    took = time.perf_counter() - t0
    [row] = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    # 8 rows: 2 fail, 2 hang, 1 unknown name + 1 unreadable, 2 table (and whatever turn 2 wrote)
    assert row["agent/tool_calls"] >= 8
    assert row["agent/tool_errors"] >= 2
    assert row["agent/tool_timeouts"] >= 2
    assert row["agent/malformed_calls"] >= 2
    assert row["agent/failed"] == 0.0  # on_error observe: every trajectory goes on
    assert took < 2 * 1.0 + 60, f"the hanging tool held the run: {took:.1f} s"
    observations = [
        t["observation"]
        for s in read_jsonl(tmp_path / "run" / "samples.jsonl")
        for t in s["trajectory"]["turns"][:1]
    ]
    texts = [m["content"] for o in observations for m in o]
    assert any(x.startswith("error: ValueError: no good: 1") for x in texts)
    assert any("timeout_s" in x for x in texts)
    assert any(x.startswith("error: malformed tool call") for x in texts)
    assert '{"n": 3, "square": 9}' in texts  # a non-text result written as JSON


@pytest.mark.parametrize("on_failure", ["zero", "drop"])
def test_a_crash_fails_only_its_own_trajectory(assets, tmp_path, capsys, on_failure):
    """Fault 3 in a run: an environment that always rewards 1.0 and kills its worker when the
    policy's turn holds "b". Only those trajectories fail (the others sharing their worker used to
    fail too, trained as score 0). With zero, score/env is exactly the share that did not fail;
    with drop, the failed ones (and a group they leave with one member) are out of the update, and
    score/env over the trajectories kept is 1.0."""
    prompts = _prompts(tmp_path, crash_if="b")
    run_dir = tmp_path / on_failure
    cfg = grpo_config(
        assets.policy("llama"),
        prompts,
        run_dir,
        model={"reward_functions": []},
        env={"factory": "agent_support:AlwaysOne", "max_turns": 1}
        | ({"on_failure": "drop"} if on_failure == "drop" else {}),  # zero: the default
        tools={"workers": 2},
        output={"samples_per_step": 8},
    )
    assert grpo_main(cfg) == 0, capsys.readouterr().err
    rows = read_jsonl(run_dir / "metrics.jsonl")
    samples = read_jsonl(run_dir / "samples.jsonl")
    # samples.jsonl holds the rows trained on: all 8 with zero, the kept ones with drop
    stepped = [s["trajectory"] for s in samples if s["trajectory"]["stop"] != "turn_length"]
    crashed = ["b" in t["turns"][0]["agent"] for t in stepped]
    assert [t["failed"] for t in stepped] == crashed
    failed = round(sum(r["agent/failed"] * 8 for r in rows))
    assert 0 < failed < 16  # the seed gives both
    assert sum(r["agent/env_errors"] for r in rows) == 2 * failed  # its step and its get_reward
    if on_failure == "zero":
        assert sum(crashed) == failed
    for r in rows:
        if on_failure == "zero":
            assert r["score/env"] == pytest.approx(1.0 - r["agent/failed"], abs=1e-6)
            assert r["agent/dropped"] == 0
        else:
            assert r["agent/dropped"] >= round(r["agent/failed"] * 8)
            if r["agent/dropped"] < 8:
                assert r["score/env"] == 1.0


def test_a_chatty_tool_prints_to_tools_log_and_long_results_are_cut(tmp_path, monkeypatch, capfd):
    """Fault 7: a tool's prints went to the trainer's stdout (15.7 MB in a two-step run). Now to
    tools.log in the run directory; and a result past tools.max_result_chars is cut, counted."""
    from proximal.tasks.calculator import build_tokenizer, make_task_data

    make_task_data(
        tmp_path / "data", n_sft_train=4, n_sft_eval=2, n_prompts_train=8, n_prompts_eval=2
    )
    _scripted(monkeypatch, build_tokenizer(), script=["[chatty 5000]", "[long_result 30]"])
    cfg = grpo_config(
        tmp_path / "data" / "base_model",
        tmp_path / "data" / "prompts_train.jsonl",
        tmp_path / "run",
        model={"reward_functions": ["proximal.tasks.calculator:verify"]},
        rollout={"batch_size": 4, "group_size": 2, "max_new_tokens": 20},
        grpo={"micro_batch_size": 4},
        env={"max_turns": 2, "max_tokens": 85},  # room for the cut result (the context is 96)
        tools={
            "functions": ["agent_support:chatty", "agent_support:long_result"],
            "format": "minimal",
            "workers": 2,
            "max_result_chars": 5,
        },
        train={"steps": 1},
        output={"samples_per_step": 8},
    )
    assert grpo_main(cfg) == 0, capfd.readouterr().err
    out, err = capfd.readouterr()
    assert "ooooo" not in out and "eeeee" not in err
    log = (tmp_path / "run" / "tools.log").read_text()
    assert log.count("o" * 5000) == 4 and log.count("e" * 5000) == 4  # 4 rows called it
    [row] = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert row["agent/results_truncated"] >= 4  # every long_result of turn 1 (and any of turn 2)
    texts = [
        m["content"]
        for s in read_jsonl(tmp_path / "run" / "samples.jsonl")
        for m in s["trajectory"]["turns"][0]["observation"]
    ]
    cut = "xxxxx… [cut: 30 characters, tools.max_result_chars = 5]"
    assert texts.count(cut) == 4 and texts.count("5000") == 4


@pytest.mark.parametrize(
    ("sections", "line"),
    [
        (  # fault 4: a 40-line traceback, exit status 1
            {"env": {"factory": "agent_support:BadReset", "max_turns": 2}},
            "proximal grpo: env.factory BadReset: reset failed for row 0 of the batch (prompt ",
        ),
        (  # fault 5: the run trained with every tool result dropped from what the policy read
            {
                "model": {
                    "chat_template": "{% for m in messages %}{% if m['role'] == 'assistant' %}"
                    "{{ m['content'] ~ eos_token }}{% elif m['role'] == 'user' %}"
                    "{{ m['content'] }}{% endif %}{% endfor %}"
                },
                "tools": {"functions": ["agent_support:add"], "format": "minimal"},
            },
            "proximal grpo: the chat template drops tool messages: ",
        ),
    ],
)
def test_environment_and_template_failures_stop_in_one_line(
    assets, tmp_path, capsys, sections, line
):
    cfg = grpo_config(assets.policy("llama"), _prompts(tmp_path), tmp_path / "run", **sections)
    cfg["tools"] = {"workers": 1, **cfg.get("tools", {})}
    assert grpo_main(cfg) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(line) and "Traceback" not in "\n".join(err)
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or read_jsonl(metrics) == []  # no step ran
