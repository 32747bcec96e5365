"""The digits task: the gold score by hand, deterministic data, and the labeller's designed noise."""

import json
import random

import pytest

from proximal.tasks import digits as D

# --- gold score, hand-checked --------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, completion, expected",
    [
        ("31415=", "11345", 1.0),  # right
        ("31415=", "11354", 3 / 5),  # last two digits swapped: positions 4 and 5 wrong
        ("31415=", "1134", 4 / 5),  # one digit missing: 4 right, over the answer's 5
        ("31415=", "113455", 5 / 6),  # one digit too many: 5 right, over the response's 6
        ("31415=", "", 0.0),  # empty
        ("9=", "9", 1.0),
        ("2200=", "0022", 1.0),
        ("2200=", "2200", 0.0),
    ],
)
def test_gold_by_hand(prompt, completion, expected):
    assert D.gold(prompt, completion) == pytest.approx(expected, abs=1e-12)


def test_gold_hand_checks_of_the_position_rule():
    # "31415" vs answer "11345", position by position: 3/1 1/1 4/3 1/4 5/5 -> positions 2 and 5 match.
    assert D.gold("31415=", "31415") == pytest.approx(2 / 5)
    # "01234" vs "11345": 0/1 1/1 2/3 3/4 4/5 -> only position 2.
    assert D.gold("31415=", "01234") == pytest.approx(1 / 5)


def test_gold_ignores_what_follows_eos_and_padding():
    assert D.gold("31415=", "11345<eos>999") == 1.0
    assert D.gold("31415=", "11345<eos><pad><pad>") == 1.0
    assert D.gold("31415=", " 11345\n") == 1.0
    # a non-digit character in the response occupies a position and never matches
    assert D.gold("31415=", "11x45") == pytest.approx(4 / 5)


def test_gold_score_is_a_reward_function():
    assert D.gold_score(["31415=", "21="], ["11345", "21"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        D.gold_score(["1=", "2="], ["1"])


@pytest.mark.parametrize("bad", ["31415", "abc=", "=", "3 1=", "١٢="])
def test_bad_prompt_is_named(bad):
    with pytest.raises(ValueError, match="not a digits-task prompt"):
        D.gold(bad, "1")


def test_gold_is_in_unit_interval_on_random_strings():
    rng = random.Random(0)
    for _ in range(2000):
        d = D.random_digits(rng)
        resp = "".join(rng.choice(D.ALPHABET) for _ in range(rng.randint(0, 14)))
        assert 0.0 <= D.gold(d + "=", resp) <= 1.0


# --- the noisy sources ---------------------------------------------------------------------------


def test_slips_do_what_they_say():
    rng = random.Random(1)
    for _ in range(200):
        s = sorted(D.random_digits(rng))
        for kind, dlen in (("swap", 0), ("replace", 0), ("drop", -1), ("dup", +1)):
            t = list(s)
            D._slip(t, kind, rng)
            assert len(t) == len(s) + dlen
            if kind == "replace":
                assert t == sorted(t) and t != s
            if kind == "swap" and len(set(s)) > 1:
                assert sorted(t) == s and t != s


def test_bradley_terry_probability():
    assert D.preference_probability(0.5, 0.5) == 0.5
    tau = 0.2
    # sigma(1) = 0.7310585786...
    assert D.preference_probability(0.7, 0.5, tau) == pytest.approx(0.7310585786300049, abs=1e-12)
    assert D.preference_probability(0.5, 0.7, tau) == pytest.approx(
        1 - 0.7310585786300049, abs=1e-12
    )


def test_labeller_agreement_rate_is_the_designed_one():
    """Over many pairs the labeller agrees with gold at the rate σ(|Δ|/τ) predicts, ≈ 0.84 at τ = 0.2."""
    rng = random.Random(7)
    rows = D._pairs([D.random_digits(rng) for _ in range(6000)], rng, D.LABEL_TAU)
    observed = D.gold_agreement(rows)
    expected = D.expected_agreement(rows)
    n = sum(D.gold(r["prompt"], r["chosen"]) != D.gold(r["prompt"], r["rejected"]) for r in rows)
    stderr = (expected * (1 - expected) / n) ** 0.5
    assert abs(observed - expected) < 4 * stderr
    assert 0.80 < expected < 0.88  # the design: noisy, but clearly better than chance
    # a noise-free labeller (tiny tau) agrees always; a very noisy one is near chance
    sharp = D._pairs([D.random_digits(rng) for _ in range(500)], rng, 1e-4)
    assert D.gold_agreement(sharp) == 1.0
    blurry = D._pairs([D.random_digits(rng) for _ in range(3000)], rng, 100.0)
    assert abs(D.gold_agreement(blurry) - 0.5) < 0.05


def test_teacher_is_imperfect():
    rng = random.Random(3)
    prompts = [D.random_digits(rng) for _ in range(4000)]
    g = [D.gold(d + "=", D.teacher_response(d, rng)) for d in prompts]
    mean = sum(g) / len(g)
    assert 0.45 < mean < 0.6  # clearly below the ceiling of 1
    assert 0.1 < sum(x == 1.0 for x in g) / len(g) < 0.25


# --- the files --------------------------------------------------------------------------------------

SMALL = dict(
    n_sft_train=60,
    n_sft_eval=20,
    n_prefs_train=60,
    n_prefs_eval=20,
    n_prompts_train=30,
    n_prompts_eval=10,
)


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_make_task_data_writes_every_file(tmp_path):
    info = D.make_task_data(tmp_path, seed=0, **SMALL)
    for split in ("train", "eval"):
        assert set(_read(tmp_path / f"sft_{split}.jsonl")[0]) == {"prompt", "response"}
        assert set(_read(tmp_path / f"prefs_{split}.jsonl")[0]) == {"prompt", "chosen", "rejected"}
        assert set(_read(tmp_path / f"prompts_{split}.jsonl")[0]) == {"prompt"}
    assert len(_read(tmp_path / "sft_train.jsonl")) == 60
    assert len(_read(tmp_path / "prompts_eval.jsonl")) == 10
    assert json.loads((tmp_path / "task.json").read_text()) == info

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert tok.convert_ids_to_tokens(tok("31415=")["input_ids"]) == list("31415=")
    assert tok.decode(tok("31415=")["input_ids"]) == "31415="
    assert (tok.pad_token, tok.eos_token) == ("<pad>", "<eos>")
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "31="}, {"role": "assistant", "content": "13"}], tokenize=False
    )
    assert rendered == "31=13<eos>"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base_model")
    assert model.config.vocab_size == len(tok) == 15


def test_held_out_prompts_never_in_training(tmp_path):
    D.make_task_data(tmp_path, seed=1, **SMALL)
    held = {
        r["prompt"]
        for f in ("sft_eval", "prefs_eval", "prompts_eval")
        for r in _read(tmp_path / f"{f}.jsonl")
    }
    train = {
        r["prompt"]
        for f in ("sft_train", "prefs_train", "prompts_train")
        for r in _read(tmp_path / f"{f}.jsonl")
    }
    assert len(held) == 50 and not held & train


def test_same_seed_same_files_other_seed_other_files(tmp_path):
    D.make_task_data(tmp_path / "a", seed=5, **SMALL)
    D.make_task_data(tmp_path / "b", seed=5, **SMALL)
    D.make_task_data(tmp_path / "c", seed=6, **SMALL)
    names = [f"{k}_{s}.jsonl" for k in ("sft", "prefs", "prompts") for s in ("train", "eval")]
    names += ["task.json", "base_model/model.safetensors", "tokenizer/tokenizer.json"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "sft_train.jsonl").read_bytes() != (
        tmp_path / "c" / "sft_train.jsonl"
    ).read_bytes()
