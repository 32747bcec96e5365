"""The digits task's rule verifier (exact sort = 1, else 0) beside its partial gold score, and its use
as a reward function by name."""

import pytest

from proximal.tasks import digits as D


@pytest.mark.parametrize(
    "prompt, completion, exact, gold",
    [
        ("31415=", "11345", 1.0, 1.0),
        ("31415=", "11345<eos>999", 1.0, 1.0),  # what follows EOS is not the answer
        ("31415=", " 11345\n", 1.0, 1.0),  # surrounding whitespace neither
        ("31415=", "11354", 0.0, 3 / 5),  # two digits out of place
        ("31415=", "1134", 0.0, 4 / 5),  # one missing
        ("31415=", "113455", 0.0, 5 / 6),  # one extra
        ("31415=", "11 345", 0.0, 2 / 6),  # a space inside the answer
        ("31415=", "", 0.0, 0.0),
        ("2200=", "0022", 1.0, 1.0),
    ],
)
def test_exact_sort_beside_the_gold_score(prompt, completion, exact, gold):
    assert D.exact_sort([prompt], [completion]) == [exact]
    assert D.gold_score([prompt], [completion]) == [pytest.approx(gold, abs=1e-12)]


def test_exact_sort_is_a_reward_function_by_name():
    from proximal.rollout.reward_functions import call_reward_functions, load_reward_function

    fn = load_reward_function("proximal.tasks.digits:exact_sort")
    values = {"prompts": ["31415=", "90=", "5555="], "completions": ["11345", "90", "5555"]}
    scores, _ = call_reward_functions({"exact": fn}, values, n=3)
    assert scores["exact"].tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        D.exact_sort(["1=", "2="], ["1"])


def test_the_evaluations_take_the_digit_tasks_defaults_from_the_task():
    """evaluate_policy and reward_model_gold_agreement hold no task's defaults: a caller names the
    scores, the response and prompt limits and the gold (the digit task's live in tasks/digits.py)."""
    import inspect

    from proximal.evaluation import evaluate_policy, reward_model_gold_agreement
    from proximal.rollout.reward_functions import load_reward_function

    params = inspect.signature(evaluate_policy).parameters
    for name in ("scores", "max_new_tokens", "max_prompt_length"):
        assert params[name].default is inspect.Parameter.empty, name
    gold = inspect.signature(reward_model_gold_agreement).parameters["gold"]
    assert gold.default is inspect.Parameter.empty
    assert {n: load_reward_function(s) for n, s in D.EVAL_SCORES.items()} == {"gold": D.gold_score}
