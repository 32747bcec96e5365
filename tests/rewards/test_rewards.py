"""proximal.rewards (issue 42, item 2): the field's reward functions under TRL's names, each on
hand-written cases whose expected values are worked out here — the mathematics of the answers
(½ = 0.5), TRL's regex read by hand, DAPO's eq. 13 computed on paper, reasoning-gym's scorers called
directly on the answer the test extracts itself — plus math-verify from a thread, the missing-package
line, a factory built from model.reward_function_kwargs in a one-step ``proximal grpo`` run, and that
run's errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from decimal import Decimal
from pathlib import Path

import pytest
import reasoning_gym as rg
from ppo_support import command_main, read_jsonl

import proximal.rewards as rewards
from proximal.config import ConfigError
from proximal.data.jsonl import write_jsonl
from proximal.rewards import (
    accuracy_reward,
    exact_match,
    get_reasoning_gym_reward,
    get_soft_overlong_punishment,
    reasoning_gym,
    think_format_reward,
)
from proximal.rollout.reward_functions import load_reward_functions
from proximal.specs import import_spec

ROOT = Path(__file__).resolve().parents[2]
OVERLONG = "proximal.rewards:get_soft_overlong_punishment"


def grpo_run(policy, prompts, run_dir, model: dict, *args: str) -> int:
    """``proximal grpo`` for one cheap step (two prompts, four responses each, at most 8 tokens)
    with ``model`` over the reward settings; the exit code."""
    cfg = {
        "model": {"path": str(policy), **model},
        "data": {"prompts": str(prompts), "max_prompt_length": 16},
        "rollout": {"batch_size": 2, "group_size": 4, "max_new_tokens": 8},
        "grpo": {"micro_batch_size": 4, "beta": 0.04},
        "optim": {"lr": 1e-3},
        "train": {"steps": 1, "seed": 0, "device": "cpu"},
        "output": {"dir": str(run_dir), "progress": False, "samples_per_step": 8},
    }
    return command_main("grpo", cfg, *args)


def completion_length(completion_ids, **kwargs):
    """A test reward (``test_rewards:completion_length``): |y|, the number of completion tokens the
    run hands every function — to check the overlong punishment against, row by row."""
    return [float(len(ids)) for ids in completion_ids]


# ----------------------------------------------------------------------------------------------
# accuracy_reward (math-verify)
# ----------------------------------------------------------------------------------------------

# (solution, completion, score): the answer's value against the solution's, as a person reads them
ACCURACY_CASES = [
    (r"$\frac{1}{2}$", r"The answer is \boxed{0.5}", 1.0),  # ½ is 0.5
    ("0.5", r"So we get \boxed{\frac{1}{2}}.", 1.0),
    (r"\frac{1}{3}", r"My answer is \boxed{\frac{1}{3}}", 1.0),  # TRL's docstring example
    (r"\frac{1}{3}", r"My answer is \boxed{\frac{1}{2}}", 0.0),
    ("5", r"The length is \boxed{5 \text{ cm}}", 1.0),  # units dropped
    ("5 cm", r"\boxed{5}", 1.0),
    ("5", r"\boxed{6 \text{ cm}}", 0.0),
    ("$x^2$", r"\boxed{x \cdot x}", 1.0),  # symbolic equality
    (r"$\sqrt{2}$", r"\boxed{2^{1/2}}", 1.0),
    (r"\sqrt{2}", r"\boxed{2^{1/2}}", None),  # bare LaTeX other than \frac: no parse, write $…$
    ("3", r"The final answer is $3$.", 1.0),  # an anchored $…$ is read without a box
    ("3", "The answer is 3", 0.0),  # a bare number is no answer (LaTeX only, behind an anchor)
    ("3", r"\boxed{3} or maybe \boxed{4}", 0.0),  # two boxes are the set {3, 4}: no hedging
    ("3", r"The final answer is $3$, so \boxed{4}", 0.0),  # a box before any other anchor
    ("hello", r"\boxed{1}", None),  # a solution that does not parse: the row is skipped
    ("", r"\boxed{1}", None),
]


def test_accuracy_reward_on_math_verifys_known_cases():
    solutions = [s for s, _, _ in ACCURACY_CASES]
    completions = [c for _, c, _ in ACCURACY_CASES]
    assert accuracy_reward(completions, solutions) == [x for _, _, x in ACCURACY_CASES]


def test_accuracy_reward_reads_a_conversational_completion():
    completions = [
        [{"role": "assistant", "content": r"\boxed{0.5}"}],
        [{"role": "assistant", "content": r"\boxed{0.25}"}],
    ]
    assert accuracy_reward(completions, [r"\frac{1}{2}", r"\frac{1}{2}"]) == [1.0, 0.0]


def test_accuracy_reward_is_safe_outside_the_main_thread():
    """math-verify's own time limits raise outside the main thread (signal.alarm); the reward turns
    them off there and scores as in the main thread."""
    from math_verify import parse, verify

    solutions = [r"\frac{1}{2}", "7", "hello"]
    completions = [r"\boxed{0.5}", r"\boxed{8}", r"\boxed{1}"]
    got: dict[str, object] = {}

    def run():
        try:
            got["scores"] = accuracy_reward(completions, solutions)
        except Exception as e:  # noqa: BLE001 - the test reports it
            got["error"] = e
        try:  # what the reward avoids: math-verify with its time limit on, in a thread
            verify(parse("1", parsing_timeout=None), parse("1", parsing_timeout=None))
        except ValueError as e:
            got["with_timeout"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert "error" not in got, got.get("error")
    assert got["scores"] == [1.0, 0.0, None]
    assert "threaded environment" in str(got["with_timeout"])


def test_accuracy_reward_bounds_a_pathological_answer_in_the_main_thread(tmp_path):
    """9^(9^(9^9)) parses at once and then compares for ever; in the main thread math-verify's limit
    (set to 1 s here) ends the comparison and the answer scores 0. Run in a child process, so that a
    regression fails after its timeout rather than hanging the suite."""
    code = (
        "from proximal.rewards import accuracy\n"
        "accuracy.VERIFY_TIMEOUT_S = 1\n"
        "print(accuracy.accuracy_reward([r'\\boxed{9^{9^{9^{9}}}}'], ['3']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0.0]"


# ----------------------------------------------------------------------------------------------
# think_format_reward, exact_match
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("<think>\nThis is my reasoning.\n</think>\nThis is my answer.", 1.0),  # TRL's example
        ("<think>a</think>", 1.0),  # nothing after the reasoning
        ("<think></think>42", 1.0),  # empty reasoning
        ("<think>two\nlines</think>\n\nanswer\n", 1.0),
        ("<think>\nThis is my reasoning.\nThis is my answer.", 0.0),  # TRL's negative: no close
        (" <think>a</think>b", 0.0),  # must start with the tag
        ("a<think>b</think>c", 0.0),
        ("<think>a<think>b</think>c", 0.0),  # a second <think>
        ("<think>a</think>b<think>c</think>", 0.0),  # ... anywhere after the first
        ("</think><think>a", 0.0),
        ("<THINK>a</THINK>", 0.0),  # case counts
    ],
)
def test_think_format_reward(completion, score):
    assert think_format_reward([completion]) == [score]
    assert think_format_reward([[{"role": "assistant", "content": completion}]]) == [score]


def test_exact_match_compares_stripped_text():
    completions = ["42", " 42\n", "42.0", "Paris", "paris", "4 2", "7", "x"]
    solution = ["42", "42", "42", " Paris ", "Paris", "42", None, None]
    answer = [None, None, None, None, None, None, 7, None]  # a number in the data: its text
    assert exact_match(completions, solution=solution, answer=answer) == [
        1.0,
        1.0,
        0.0,
        1.0,
        0.0,
        0.0,
        1.0,
        None,  # no reference: does not apply
    ]
    assert exact_match(["b", "a"], answer=["a", "a"]) == [0.0, 1.0]
    with pytest.raises(ValueError, match="column 'solution' or 'answer'"):
        exact_match(["a"])


# ----------------------------------------------------------------------------------------------
# get_soft_overlong_punishment (DAPO eq. 13)
# ----------------------------------------------------------------------------------------------


def test_soft_overlong_punishment_in_its_three_regions():
    # L_max = 10, L_cache = 4: 0 up to 6 tokens, (6 − |y|) / 4 from 7 to 10, −1 past 10
    f = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    lengths = [0, 1, 6, 7, 8, 9, 10, 11, 50]
    expected = [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    assert f(completion_ids=[[5] * n for n in lengths]) == expected
    # L_cache = 0: no ramp, a step from 0 to −1 past L_max
    g = get_soft_overlong_punishment(10, 0)
    assert g(completion_ids=[[1] * 10, [1] * 11]) == [0.0, -1.0]
    # TRL's docstring example: 90 tokens of L_max 100, L_cache 20
    assert get_soft_overlong_punishment(100, 20)([[1] * 90]) == [-0.5]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 11), "soft_punish_cache = 11 must be in [0, max_completion_len = 10]"),
        ((10, -1), "soft_punish_cache = -1 must be in [0, max_completion_len = 10]"),
        ((0, 0), "max_completion_len = 0 must be ≥ 1 token"),
        ((10.5, 2), "max_completion_len = 10.5 must be a whole number of tokens"),
    ],
)
def test_soft_overlong_punishment_refuses_bad_arguments(args, message):
    with pytest.raises(ValueError) as e:
        get_soft_overlong_punishment(*args)
    assert str(e.value) == message


# ----------------------------------------------------------------------------------------------
# reasoning_gym
# ----------------------------------------------------------------------------------------------


def _rows(name: str, n: int, **config) -> list[dict]:
    """n entries of a generator as a prompt file holds them (JSON: its tuples become lists)."""
    return json.loads(json.dumps(list(rg.create_dataset(name, size=n, seed=7, **config))))


@pytest.mark.parametrize(
    ("name", "config"),
    [("chain_sum", {"min_terms": 2, "max_terms": 3}), ("basic_arithmetic", {})],
)
def test_reasoning_gym_scores_as_the_generators_own_score_answer(name, config):
    entries = _rows(name, 4, **config)
    dataset = rg.create_dataset(name, size=4, seed=7, **config)
    completions, answers, expected = [], [], []
    for entry in entries:
        gold = entry["answer"]
        wrong = str(int(gold) + 1)
        cases = [  # (completion, the answer in it, read by hand)
            (f"<think>so</think><answer>{gold}</answer>", gold),
            (f"<answer> {gold} </answer>", gold),  # stripped
            (f"<answer>{wrong}</answer>", wrong),
            (f"<answer>{wrong}</answer> no: <answer>{gold}</answer>", gold),  # the last tag
            (f"x = <answer>x = {gold}</answer>", f"x = {gold}"),
            (gold, None),  # no tag: no answer
        ]
        for completion, extracted in cases:
            completions.append(completion)
            answers.append(entry)
            expected.append(dataset.score_answer(extracted, entry))
    got = reasoning_gym(
        completions, [e["answer"] for e in answers], [e["metadata"] for e in answers]
    )
    assert got == expected
    # and by hand: right 1, wrong 0, no tag 0 for every entry
    assert got[0::6] == got[1::6] == got[3::6] == [1.0] * 4
    assert got[2::6] == got[5::6] == [0.0] * 4


def test_reasoning_gym_rows_as_a_file_holds_them():
    """Metadata as its JSON text (a CSV or Parquet column), conversational completions, a row of
    another task (no generator: not scored), the whole completion as the answer by the factory."""
    (entry,) = _rows("chain_sum", 1)
    gold = entry["answer"]
    got = reasoning_gym(
        [
            [{"role": "assistant", "content": f"<answer>{gold}</answer>"}],
            f"<answer>{gold}</answer>",
            f"<answer>{gold}</answer>",
        ],
        [gold, gold, "3"],
        [entry["metadata"], json.dumps(entry["metadata"]), {"task": "other"}],
    )
    assert got == [1.0, 1.0, None]
    whole = get_reasoning_gym_reward(answer_tag=None)
    tagged = f"<answer>{gold}</answer>"  # read whole, the tags are part of the answer
    own = rg.get_score_answer_fn("chain_sum")(tagged, entry)
    assert own < 1.0
    assert whole([f" {gold}\n", tagged], [gold] * 2, [entry["metadata"]] * 2) == [1.0, own]
    boxed = get_reasoning_gym_reward(answer_tag="final")
    assert boxed([f"<final>{gold}</final>"], [gold], [entry["metadata"]]) == [1.0]
    with pytest.raises(ValueError, match="'<b>' must be a tag name"):
        get_reasoning_gym_reward(answer_tag="<b>")
    with pytest.raises(ValueError, match="'no_such_generator' is not a reasoning-gym generator"):
        reasoning_gym(["x"], ["1"], [{"source_dataset": "no_such_generator"}])


def test_reasoning_gym_scores_under_the_rows_generator_config():
    """decimal_arithmetic accepts an answer within 10^-max_num_decimal_places: 0.05 off is right
    under max_num_decimal_places 1, wrong under the default 3. Given the row's config, the scorer is
    the generator's own."""
    config = {"min_num_decimal_places": 1, "max_num_decimal_places": 1}
    (entry,) = _rows("decimal_arithmetic", 1, **config)
    near = str(Decimal(entry["answer"]) + Decimal("0.05"))
    own = rg.create_dataset("decimal_arithmetic", size=1, seed=7, **config)
    assert own.score_answer(near, entry) == 1.0  # the generator's own verdict
    args = ([f"<answer>{near}</answer>"] * 2, [entry["answer"]] * 2, [entry["metadata"]] * 2)
    assert reasoning_gym(*args, generator_config=[config, json.dumps(config)]) == [1.0, 1.0]
    assert reasoning_gym(*args) == [0.0, 0.0]  # the default config's tolerance, 0.001


# ----------------------------------------------------------------------------------------------
# Loading by spec: the package, the missing-package line, factories from reward_function_kwargs
# ----------------------------------------------------------------------------------------------


def test_each_loads_as_a_spec():
    for name in rewards.__all__:
        assert import_spec(f"proximal.rewards:{name}", "reward function") is getattr(rewards, name)


def test_a_missing_package_is_one_line_naming_the_extra():
    """Without math-verify (or reasoning-gym), the spec's ConfigError names the install command; the
    functions that need no package still load."""
    code = (
        "import sys\n"
        "sys.modules['math_verify'] = None\n"  # the import system's 'not installed'
        "sys.modules['reasoning_gym'] = None\n"
        "from proximal.specs import import_spec\n"
        "from proximal.config import ConfigError\n"
        "import_spec('proximal.rewards:think_format_reward', 'reward function')\n"
        "for name in ('accuracy_reward', 'reasoning_gym'):\n"
        "    try:\n"
        "        import_spec(f'proximal.rewards:{name}', 'reward function')\n"
        "    except ConfigError as e:\n"
        "        print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "reward function 'proximal.rewards:accuracy_reward': cannot import (proximal.rewards."
        "accuracy_reward needs math-verify (module 'math_verify' is not installed): pip install "
        "'proximal-rlhf[reasoning]')",
        "reward function 'proximal.rewards:reasoning_gym': cannot import (proximal.rewards."
        "reasoning_gym needs reasoning-gym (module 'reasoning_gym' is not installed): pip install "
        "'proximal-rlhf[reasoning]')",
    ]


def test_a_factory_is_built_from_its_kwargs_once_at_load():
    specs = [OVERLONG, OVERLONG, "proximal.rewards:think_format_reward"]
    functions = load_reward_functions(
        specs,
        {
            OVERLONG: {"max_completion_len": 4, "soft_punish_cache": 2},
            f"{OVERLONG}#2": {"max_completion_len": 8, "soft_punish_cache": 0},
        },
    )
    assert list(functions) == [OVERLONG, f"{OVERLONG}#2", "proximal.rewards:think_format_reward"]
    ids = [[1] * 3, [1] * 5, [1] * 9]
    assert functions[OVERLONG](completion_ids=ids) == [-0.5, -1.0, -1.0]
    assert functions[f"{OVERLONG}#2"](completion_ids=ids) == [0.0, 0.0, -1.0]
    assert functions["proximal.rewards:think_format_reward"] is think_format_reward


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            None,
            f"reward function '{OVERLONG}' is a factory of reward functions: give its arguments in "
            f"model.reward_function_kwargs ({{'{OVERLONG}': {{max_completion_len, "
            "soft_punish_cache}})",
        ),
        (
            {OVERLONG: {"max_completion_len": 4, "soft_punish_cache": 2, "cache": 1}},
            f"model.reward_function_kwargs['{OVERLONG}']: no argument 'cache' (its arguments: "
            "max_completion_len, soft_punish_cache)",
        ),
        (
            {OVERLONG: {"max_completion_len": 4}},
            f"model.reward_function_kwargs['{OVERLONG}']: argument 'soft_punish_cache' missing "
            "(its arguments: max_completion_len, soft_punish_cache)",
        ),
        (
            {OVERLONG: {"max_completion_len": 4, "soft_punish_cache": 5}},
            f"model.reward_function_kwargs['{OVERLONG}']: ValueError: soft_punish_cache = 5 must "
            "be in [0, max_completion_len = 4]",
        ),
    ],
)
def test_a_factorys_wrong_kwargs_name_the_spec_and_the_argument(kwargs, message):
    with pytest.raises(ConfigError) as e:
        load_reward_functions([OVERLONG], kwargs)
    assert str(e.value) == message


def test_kwargs_for_a_function_that_is_no_factory_are_refused():
    spec = "proximal.rewards:think_format_reward"
    with pytest.raises(ConfigError) as e:
        load_reward_functions([spec], {spec: {"completions": ["x"]}})
    assert str(e.value) == (
        f"model.reward_function_kwargs['{spec}']: called with these arguments it returned list "
        "[0.0], not a reward function; only a factory (a function that returns the reward "
        "function) takes arguments here"
    )


# ----------------------------------------------------------------------------------------------
# The factory in a run: proximal grpo with model.reward_function_kwargs
# ----------------------------------------------------------------------------------------------


def test_grpo_scores_with_the_rewards_its_config_builds(assets, tmp_path, capsys):
    """One GRPO step of at most 8 tokens on prompts carrying reasoning-gym entries (chain_sum), with
    the overlong punishment (L_max 6, L_cache 4) built from model.reward_function_kwargs and trained
    on, and logged beside it at weight 0: each response's |y| (a test function), the reasoning-gym
    scorer (default and built by its factory with the whole completion as the answer), exact match
    and the think format. Every sample's scores are worked out from its response and its row."""
    entries = _rows("chain_sum", 2, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    rows = [  # prompts of the tiny model's alphabet; the entry's answer and metadata as columns
        {"prompt": f"{'ab'[i] * 3} {i}", "answer": e["answer"], "metadata": e["metadata"]}
        for i, e in enumerate(entries)
    ]
    write_jsonl(tmp_path / "prompts.jsonl", rows)
    by_prompt = {r["prompt"]: e for r, e in zip(rows, entries)}
    whole = "proximal.rewards:get_reasoning_gym_reward"
    functions = [
        OVERLONG,
        "test_rewards:completion_length",
        "proximal.rewards:reasoning_gym",
        whole,
        "proximal.rewards:exact_match",
        "proximal.rewards:think_format_reward",
    ]
    model = {
        "reward_functions": functions,
        "reward_function_weights": [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        "reward_function_kwargs": {
            OVERLONG: {"max_completion_len": 6, "soft_punish_cache": 4},
            whole: {"answer_tag": None},
        },
    }
    run_dir = tmp_path / "run"
    assert grpo_run(assets.policy("llama"), tmp_path / "prompts.jsonl", run_dir, model) == 0, (
        capsys.readouterr().err
    )
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert len(samples) == 8
    score_answer = rg.get_score_answer_fn("chain_sum")
    for s in samples:
        n = s["score/test_rewards:completion_length"]
        by_hand = 0.0 if n <= 2 else (-1.0 if n > 6 else (2 - n) / 4)
        assert s[f"score/{OVERLONG}"] == by_hand and s["score"] == by_hand
        entry, response = by_prompt[s["prompt"]], s["response"]
        assert "<" not in response  # the alphabet has no tags: no <answer>, no <think>
        assert s["score/proximal.rewards:reasoning_gym"] == score_answer(None, entry) == 0.0
        assert s[f"score/{whole}"] == score_answer(response.strip(), entry)
        assert s["score/proximal.rewards:exact_match"] == float(response.strip() == entry["answer"])
        assert s["score/proximal.rewards:think_format_reward"] == 0.0
    assert {s["score/test_rewards:completion_length"] for s in samples} & {7.0, 8.0}, (
        "no response reached the −1 region: the test would not tell the regions apart"
    )
    saved = (run_dir / "config.yaml").read_text()
    assert "reward_function_kwargs" in saved and "soft_punish_cache: 4" in saved


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {"reward_function_kwargs": {"proximal.rewards:exact_match": {"a": 1}}},
            "model.reward_function_kwargs['proximal.rewards:exact_match']: "
            "'proximal.rewards:exact_match' is not one of model.reward_functions "
            f"(ppo_support:frac_a, {OVERLONG})",
        ),
        (
            {"reward_function_kwargs": {OVERLONG: 6}},
            f"model.reward_function_kwargs['{OVERLONG}'] = 6: expected a mapping {{argument: value}}",
        ),
        (
            {"reward_function_kwargs": {OVERLONG: {"max_len": 6, "soft_punish_cache": 4}}},
            f"model.reward_function_kwargs['{OVERLONG}']: no argument 'max_len' (its arguments: "
            "max_completion_len, soft_punish_cache)",
        ),
        (  # the same from the command line, as docs/rewards.md writes it
            [
                "--model.reward_function_kwargs",
                f"{{{OVERLONG}: {{max_len: 6, soft_punish_cache: 4}}}}",
            ],
            f"model.reward_function_kwargs['{OVERLONG}']: no argument 'max_len' (its arguments: "
            "max_completion_len, soft_punish_cache)",
        ),
    ],
)
def test_grpo_refuses_bad_kwargs_in_one_line_before_any_model(
    model, message, assets, tmp_path, monkeypatch, capsys
):
    from proximal.trainers import grpo

    def forbidden(*a, **kw):
        raise AssertionError("models were loaded before the config error was reported")

    monkeypatch.setattr(grpo, "build_models", forbidden)
    # a dict: the config's model section gets it; a list: command-line arguments
    args = model if isinstance(model, list) else []
    settings = {} if args else model
    model = {"reward_functions": ["ppo_support:frac_a", OVERLONG], **settings}
    rc = grpo_run(assets.policy("llama"), assets.prompts, tmp_path / "run", model, *args)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err, err
    assert "Traceback" not in err and err.count("proximal grpo:") == 1, err
