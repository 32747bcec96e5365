"""The reasoning-gym tasks of ``proximal compare --compare.task reasoning_gym:NAME`` (issue 42, item
6): their files (the generator's own entries, the held-out prompts apart from training, the sloppy
teacher's measured rates), their held-out columns on hand-written responses, the packaged configs,
the compare plan and its config mistakes; and (marker ``slow``) a one-seed comparison at the
smallest size, the plumbing, not the learning (tests/tasks/test_gym_learning.py)."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import reasoning_gym as rg
import yaml
from transformers import AutoTokenizer

from proximal.cli import main
from proximal.compare import CompareConfig, plan, task_configs
from proximal.config import load_config
from proximal.data import gym as gym_source
from proximal.data.jsonl import read_jsonl as _read_jsonl
from proximal.demo import gym_stage_configs
from proximal.tasks import gym


def read_jsonl(path) -> list[dict]:
    return [row for _, row in _read_jsonl(path)]


def test_exact_match_and_format_errors_on_hand_written_responses():
    responses = [
        "<answer>-12</answer>",  # right
        "<answer> -12 </answer><eos><pad>",  # right: stripped, what follows EOS cut
        "<answer>12</answer>",  # wrong
        "-12",  # no tags: a format error, never right
        "answer: -12",
        "<answer>3</answer> then <answer>-12</answer>",  # the last tagged answer counts
        "<answer>-12",  # unclosed
    ]
    answers = ["-12"] * len(responses)
    assert gym.exact_match(responses, answer=answers) == [1, 1, 0, 0, 0, 1, 0]
    assert gym.format_error(responses) == [0, 0, 0, 1, 1, 0, 1]


def test_the_teacher_answers_in_its_proportions():
    rng = random.Random(0)
    out = [gym.teacher_response("-12", rng) for _ in range(4000)]
    right = sum(r == "<answer>-12</answer>" for r in out) / 4000
    untagged = sum("</answer>" not in r for r in out) / 4000
    slips = [r for r in out if r.startswith("<answer>") and r.endswith("</answer>")]
    slips = [int(r[8:-9]) for r in slips if r != "<answer>-12</answer>"]
    # three standard errors of 4000 draws: 0.024 at p = 0.55, 0.017 at p = 0.15
    assert abs(right - 0.55) < 0.024 and abs(untagged - 0.15) < 0.017
    assert slips and all(careless(s, -12) for s in slips)


@pytest.mark.parametrize(
    "expression, steps, value",
    [
        ("0 - 4 - 8", ["0-4=-4", "-4-8=-12"], -12),  # left to right
        ("5 - 3", ["5-3=2"], 2),
        ("3 - -7", ["3--7=10"], 10),  # a negative number is no step
        ("( 2 + -8 ) + 4", ["2+-8=-6", "-6+4=-2"], -2),
        ("-1 - -( -3 + 0 )", ["-3+0=-3", "-(-3)=3", "-1-3=-4"], -4),  # a group's negation is
        ("-( -( 3 + 9 ) )", ["3+9=12", "-(-(12))=12"], 12),  # a step, a run of them one step
        ("-( -3 )", ["-(-3)=3"], 3),
        ("7", [], 7),
    ],
)
def test_the_worked_solution(expression, steps, value):
    assert gym.working(expression) == (steps, value)
    assert value == eval(expression)  # Python's own value of the same text


def test_the_teachers_working_carries_a_slip_forward():
    rng = random.Random(0)
    out = [gym.teacher_response("-4", rng, None, "-1 - -( -3 + 0 )") for _ in range(2000)]
    right = "-3+0=-3;-(-3)=3;-1-3=-4;<answer>-4</answer>"
    # three standard errors of 2000 draws: 0.034 at p = 0.55, 0.024 at p = 0.15
    assert abs(sum(r == right for r in out) / 2000 - 0.55) < 0.034
    untagged = [r for r in out if "</answer>" not in r]
    assert abs(len(untagged) / 2000 - 0.15) < 0.024
    # a format error: the right working, then the right number without the tags
    assert {r.rsplit(";", 1)[1] for r in untagged} == {"-4", "answer: -4", "<answer>-4"}
    assert {r.rsplit(";", 1)[0] for r in untagged} == {"-3+0=-3;-(-3)=3;-1-3=-4"}
    slips = 0
    for r in out:
        if r == right or r in untagged:
            continue
        # a slip: one step's value careless; the later steps compute on the value it wrote
        s0, s1, s2, line = r.split(";")
        a, b, c = (int(x.rsplit("=", 1)[1]) for x in (s0, s1, s2))
        assert (s0, s1, s2, line) == ("-3+0=" + str(a), f"-({a})={b}", f"-1-{b}={c}", gym.tagged(c))
        wrong = [(v, want) for v, want in ((a, -3), (b, -a), (c, -1 - b)) if v != want]
        assert len(wrong) == 1 and careless(*wrong[0]), r
        slips += 1
    assert abs(slips / 2000 - 0.3) < 0.031
    with pytest.raises(ValueError, match="works out to -4, the generator says 5"):
        gym.teacher_response("5", rng, None, "-1 - -( -3 + 0 )")
    with pytest.raises(ValueError, match="not a"):
        gym.working("2 * 3")


def careless(wrong: int, right: int) -> bool:
    """Off by one, off by ten, or one digit of the same sign changed (-4 → "-0" is 0)."""
    a, b = str(abs(wrong)).zfill(2), str(abs(right)).zfill(2)
    same_sign = (wrong < 0) == (right < 0) or wrong == 0
    one_digit = same_sign and sum(x != y for x, y in zip(a, b)) == 1
    return wrong != right and (abs(wrong - right) in (1, 10) or one_digit)


@pytest.fixture(scope="module")
def chain_sum_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("chain_sum")
    info = gym.make_task_data(
        out / "task", "chain_sum", 0, n_train=400, n_sft_eval=20, n_prompts_eval=40
    )
    return out, info


def test_the_task_files_are_the_generators_entries_and_keep_held_out_apart(chain_sum_files):
    root, info = chain_sum_files
    out = root / "task"
    train = read_jsonl(out / "prompts_train.jsonl")
    held = read_jsonl(out / "prompts_eval.jsonl")
    own = rg.create_dataset("chain_sum", size=400, seed=0, **gym.GENERATORS["chain_sum"])
    assert [(r["prompt"], r["answer"]) for r in train] == [
        (e["question"], e["answer"]) for e in own
    ]
    assert len(held) == 40 and not {r["prompt"] for r in held} & {r["prompt"] for r in train}
    # the seeds: the held-out split's start past the training split's 0 .. 399
    assert gym_source.parse(info["source"]).held_out_seed() == 401
    sft = read_jsonl(out / "sft_train.jsonl")
    assert [r["prompt"] for r in sft] == [r["prompt"] for r in train]
    # the teacher's worked solution of the generator's own expression, then the tagged answer
    worked = [
        ";".join([*gym.working(t["metadata"]["expression"])[0], gym.tagged(t["answer"])])
        for t in train
    ]
    right = sum(s["response"] == w for s, w in zip(sft, worked)) / 400
    assert info["teacher_exact_match_train"] == right
    assert info["teacher_format_errors_train"] == sum(
        "</answer>" not in s["response"] for s in sft
    ) / len(sft)
    # the tokenizer spells every prompt and response
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    for r in sft[:50] + read_jsonl(out / "sft_eval.jsonl"):
        ids = tok(r["prompt"] + r["response"], add_special_tokens=False).input_ids
        assert tok.unk_token_id not in ids and tok.decode(ids) == r["prompt"] + r["response"]


def test_the_packaged_configs_load_and_learn_from_the_generators_scorer(chain_sum_files):
    cfgs = gym_stage_configs(task_configs("reasoning_gym:chain_sum"), chain_sum_files[0], 0)
    assert list(cfgs) == ["sft", "ppo", "grpo", "rloo"]
    for name in ("ppo", "grpo", "rloo"):
        cfg = cfgs[name][0]
        assert cfg.model.reward_functions[0] == "proximal.rewards:reasoning_gym"
        assert cfg.rollout.max_new_tokens == gym.MAX_RESPONSE_TOKENS
        assert cfg.data.max_prompt_length == gym.MAX_PROMPT_TOKENS


def test_compare_plans_the_verifier_methods_of_a_reasoning_gym_task():
    def groups(**compare):
        cfg = load_config(CompareConfig, None, {f"compare.{k}": v for k, v in compare.items()})
        return list(dict.fromkeys(r.group for r in plan(cfg)))

    for task in ("reasoning_gym:chain_sum", "reasoning_gym:basic_arithmetic"):
        assert groups(task=task) == ["ppo@verifier", "grpo@verifier", "rloo@verifier"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compare.task", "reasoning_gym:sums"], "compare.task: 'reasoning_gym:sums' is not a"),
        (["--compare.methods", "[dpo]"], "'dpo': the reasoning_gym:chain_sum task has a verifier"),
    ],
)
def test_reasoning_gym_task_mistakes(tmp_path, capsys, args, message):
    argv = ["compare", "--compare.task", "reasoning_gym:chain_sum"]
    assert main([*argv, "--output.dir", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.mark.slow
def test_a_small_reasoning_gym_comparison(tmp_path):
    """The packaged configs with a 10-step SFT and one RL step each: the plumbing."""
    configs = tmp_path / "configs"
    shutil.copytree(task_configs("reasoning_gym:chain_sum"), configs)
    sft = yaml.safe_load((configs / "sft.yaml").read_text())
    sft["train"].update(steps=10, eval_every=5)
    sft["optim"]["warmup_steps"] = 2
    (configs / "sft.yaml").write_text(yaml.safe_dump(sft))
    out = tmp_path / "out"
    argv = ["compare", "--compare.task", "reasoning_gym:chain_sum", "--compare.configs"]
    rc = main(
        [
            *argv,
            str(configs),
            "--compare.seeds",
            "1",
            "--compare.responses",
            "64",
            "--compare.evaluations",
            "1",
            "--compare.eval_samples_per_prompt",
            "1",
            "--output.dir",
            str(out),
            "--output.progress",
            "false",
        ]
    )
    assert rc == 0
    for name in ("ppo@verifier", "grpo@verifier", "rloo@verifier"):
        final = json.loads((out / "runs" / f"{name}-seed0" / "eval.json").read_text())["final"]
        assert {"gold", "format_error", "kl"} <= set(final["mean"])
