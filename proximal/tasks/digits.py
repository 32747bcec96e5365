"""The built-in task: sort a string of digits, with a gold score apart from any learned reward model.

A prompt is 4 to 8 digits followed by ``=`` (``"31415="``); the right response is the same digits in
ascending order (``"11345"``), then EOS. Because the right answer is known exactly, every response
has a **gold score** in [0, 1] (:func:`gold_score`): the fraction of positions holding the right
digit, over the longer of the response and the answer, so that missing *and* extra digits cost::

    gold("31415=", "11345")  = 5/5 = 1.0
    gold("31415=", "11354")  = 3/5 = 0.6     two digits out of place
    gold("31415=", "1134")   = 4/5 = 0.8     one digit missing
    gold("31415=", "113455") = 5/6 ≈ 0.83    one digit too many
    gold("31415=", "31415")  = 2/5 = 0.4     the prompt copied back unsorted

The gold score is what a human would *want*; RLHF never sees it. What RLHF sees is built the way
InstructGPT's pipeline builds it (Ouyang et al. 2022), with the imperfections of real data put in on purpose:

* **SFT demonstrations are imperfect.** A sloppy teacher (:data:`TEACHER`) writes the right answer
  only some of the time; otherwise it makes one or two slips (an adjacent swap, a dropped digit, a
  wrong digit) or gives up and copies the prompt. A model fine-tuned on it samples at about the
  teacher's gold, well below the ceiling of 1 — room for PPO to improve.
* **Preference labels are noisy.** Each preference pair holds two candidates for one prompt
  (drawn from :data:`CANDIDATES`, a wider mix than the teacher's), and a simulated labeller picks
  the chosen one by Bradley–Terry sampling on the gold scores with temperature ``tau``:
  ``P(a ≻ b) = σ((gold(a) − gold(b)) / tau)`` (Bradley & Terry 1952, the same model the reward model is fitted
  with). With the default ``tau`` the labeller agrees with gold on about 4 of 5 pairs whose gold
  differs (:func:`expected_agreement` computes the exact rate for a data set).
* **The reward model is therefore a proxy.** It is a tiny network trained on a few thousand noisy
  pairs from a narrow distribution; away from that distribution its scores are guesses. Optimise
  it hard enough (small β) and the policy finds responses the proxy overrates — the over-
  optimisation of Gao et al. (2022) — which the gold score exposes.

:func:`make_task_data` writes every file the demo needs; the same seed gives byte-identical files.
The character tokenizer (:func:`build_tokenizer`) is a standard Hugging Face tokenizer with
one token per digit, so every response token is one decision the PPO credit assignment can see.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path

from proximal.data.jsonl import write_jsonl
from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm

DIGITS = "0123456789"
SEP = "="
ALPHABET = DIGITS + SEP
MIN_DIGITS, MAX_DIGITS = 4, 8
#: Responses this long or longer are certainly wrong; PPO's ``max_new_tokens`` should allow a few
#: more than MAX_DIGITS so over-long (hacked) responses can appear and be scored.
MAX_RESPONSE_TOKENS = 12
#: The held-out evaluation's scores (:func:`proximal.evaluation.evaluate_policy`): the gold score.
EVAL_SCORES = {"gold": "proximal.tasks.digits:gold_score"}

#: How the sloppy SFT teacher answers: probability of each behaviour. "slipN" = the sorted answer
#: with N random slips (see :data:`SLIPS_TEACHER`); "copy" = the prompt's digits, unsorted.
TEACHER = {"correct": 0.15, "slip1": 0.35, "slip2": 0.25, "copy": 0.25}
SLIPS_TEACHER = ("swap", "drop", "replace")

#: How candidate responses for preference pairs are drawn: a wider mix than the teacher, as real
#: comparison data comes from many sampled policies. It also holds over-long answers ("dup").
CANDIDATES = {"correct": 0.25, "slip1": 0.35, "slip2": 0.25, "copy": 0.15}
SLIPS_CANDIDATES = ("swap", "drop", "replace", "dup")

#: The labeller's Bradley–Terry temperature: smaller is closer to gold, larger is noisier.
LABEL_TAU = 0.2

_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def build_tokenizer():
    """The task's character tokenizer: ``<pad> <eos> <bos> <unk>`` (ids 0-3), then ``0``-``9`` and ``=``.

    A ``transformers.PreTrainedTokenizerFast``; ``save_pretrained`` it and load it back with
    ``AutoTokenizer``. Its chat template renders messages verbatim and ends each assistant turn
    with EOS, so ``messages``-style data means the same as ``prompt``/``response`` data.
    """
    return build_char_tokenizer(ALPHABET, chat_template=_CHAT_TEMPLATE)


# ----------------------------------------------------------------------------------------------
# Gold score
# ----------------------------------------------------------------------------------------------


def prompt_digits(prompt: str) -> str:
    """The digits a prompt asks to sort: ``"31415="`` → ``"31415"``; ValueError for anything else."""
    body = prompt.strip()
    if not body.endswith(SEP) or not body[:-1].isdigit() or not body[:-1].isascii():
        raise ValueError(
            f"not a digits-task prompt: {prompt!r} (expected digits followed by {SEP!r}, "
            f"e.g. '31415=')"
        )
    return body[:-1]


def answer(prompt: str) -> str:
    """The right response to ``prompt``: its digits in ascending order."""
    return "".join(sorted(prompt_digits(prompt)))


def _response_text(completion: str) -> str:
    # Rollouts may decode with or without special tokens; what follows EOS is never part of the
    # answer, and padding never is either.
    cut = completion.find("<eos>")
    if cut >= 0:
        completion = completion[:cut]
    return completion.replace("<pad>", "").replace("<bos>", "").strip()


def gold(prompt: str, completion: str) -> float:
    """Gold score of one completion: right digits in the right place / max(len(answer), len(response))."""
    target = answer(prompt)
    response = _response_text(completion)
    hits = sum(a == b for a, b in zip(response, target))
    return hits / max(len(target), len(response))


def gold_score(prompts: list[str], completions: list[str]) -> list[float]:
    """Gold scores in [0, 1], one per (prompt, completion); usable as a PPO reward function.

    The signature is the one rule-based reward functions take, so a run can name it
    ``proximal.tasks.digits:gold_score``; the demo gives it weight 0, so it is logged beside the
    learned reward but never trained on.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"gold_score: {len(prompts)} prompts but {len(completions)} completions")
    return [gold(p, c) for p, c in zip(prompts, completions)]


def exact_sort(prompts: list[str], completions: list[str]) -> list[float]:
    """The task's rule verifier: 1.0 where the response is exactly the sorted digits, else 0.0.

    A reward function (``model.reward_functions: [proximal.tasks.digits:exact_sort]``) of the kind
    GRPO was designed around (Shao et al. 2024; DeepSeek-R1's accuracy reward): checkable, binary,
    never fooled the way a learned reward model can be. Whatever follows EOS, padding and surrounding
    whitespace are ignored, as in :func:`gold`; anything else — a digit missing, extra or out of
    place, any other character — is wrong.
    :func:`gold_score` is the partial credit beside it.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"exact_sort: {len(prompts)} prompts but {len(completions)} completions")
    return [1.0 if _response_text(c) == answer(p) else 0.0 for p, c in zip(prompts, completions)]


# ----------------------------------------------------------------------------------------------
# Simulated data sources: prompts, a sloppy teacher, preference candidates, a noisy labeller
# ----------------------------------------------------------------------------------------------


def random_digits(rng: random.Random) -> str:
    n = rng.randint(MIN_DIGITS, MAX_DIGITS)
    return "".join(rng.choice(DIGITS) for _ in range(n))


def _slip(s: list[str], kind: str, rng: random.Random) -> None:
    """Apply one slip to the digit list ``s`` in place."""
    if kind == "swap":  # two neighbours out of order; pick a pair that actually changes the string
        pairs = [i for i in range(len(s) - 1) if s[i] != s[i + 1]]
        if pairs:
            i = rng.choice(pairs)
            s[i], s[i + 1] = s[i + 1], s[i]
    elif kind == "drop":
        if len(s) > 1:
            del s[rng.randrange(len(s))]
    elif kind == "replace":  # a wrong digit, written in sorted position as a careless sorter would
        i = rng.randrange(len(s))
        s[i] = rng.choice([d for d in DIGITS if d != s[i]])
        s.sort()
    elif kind == "dup":  # one digit written twice
        i = rng.randrange(len(s))
        s.insert(i, s[i])
    else:
        raise ValueError(f"unknown slip {kind!r}")


def noisy_response(
    digits: str, rng: random.Random, mix: dict[str, float], slips: Sequence[str]
) -> str:
    """One response to the prompt ``digits + '='`` drawn from the behaviour mixture ``mix``."""
    behaviour = rng.choices(list(mix), weights=list(mix.values()))[0]
    if behaviour == "copy":
        return digits
    s = sorted(digits)
    n_slips = {"correct": 0, "slip1": 1, "slip2": 2}[behaviour]
    for _ in range(n_slips):
        _slip(s, rng.choice(slips), rng)
    return "".join(s)


def teacher_response(digits: str, rng: random.Random) -> str:
    """The sloppy SFT teacher's answer (see :data:`TEACHER`)."""
    return noisy_response(digits, rng, TEACHER, SLIPS_TEACHER)


def preference_probability(gold_a: float, gold_b: float, tau: float = LABEL_TAU) -> float:
    """Bradley–Terry probability that the labeller prefers ``a``: σ((gold_a − gold_b) / tau)."""
    z = (gold_a - gold_b) / tau
    if z >= 0:  # the two branches of a sigmoid that never overflows, whatever tau
        return 1.0 / (1.0 + math.exp(-z))
    return math.exp(z) / (1.0 + math.exp(z))


def label_pair(
    prompt: str, a: str, b: str, rng: random.Random, tau: float = LABEL_TAU
) -> tuple[str, str]:
    """The noisy labeller: ``(chosen, rejected)``, sampled from the Bradley–Terry probability."""
    if rng.random() < preference_probability(gold(prompt, a), gold(prompt, b), tau):
        return a, b
    return b, a


def expected_agreement(pairs: list[dict], tau: float = LABEL_TAU) -> float:
    """The labeller's expected agreement with gold over pairs whose gold differs: mean σ(|Δgold| / tau)."""
    ps = [
        preference_probability(
            abs(gold(r["prompt"], r["chosen"]) - gold(r["prompt"], r["rejected"])), 0.0, tau
        )
        for r in pairs
        if gold(r["prompt"], r["chosen"]) != gold(r["prompt"], r["rejected"])
    ]
    return sum(ps) / len(ps)


def gold_agreement(pairs: list[dict]) -> float:
    """Fraction of pairs (with differing gold) whose ``chosen`` has the higher gold score."""
    diffs = [gold(r["prompt"], r["chosen"]) - gold(r["prompt"], r["rejected"]) for r in pairs]
    decided = [d for d in diffs if d != 0]
    return sum(d > 0 for d in decided) / len(decided)


# ----------------------------------------------------------------------------------------------
# Writing the task's files
# ----------------------------------------------------------------------------------------------


def _prompts(rng: random.Random, n: int, exclude: set[str]) -> list[str]:
    out: list[str] = []
    seen = set(exclude)
    while len(out) < n:
        d = random_digits(rng)
        if d in seen:
            continue
        seen.add(d)
        out.append(d)
    return out


def _pairs(digit_strings: list[str], rng: random.Random, tau: float) -> list[dict]:
    rows = []
    for d in digit_strings:
        prompt = d + SEP
        a = noisy_response(d, rng, CANDIDATES, SLIPS_CANDIDATES)
        b = noisy_response(d, rng, CANDIDATES, SLIPS_CANDIDATES)
        while b == a:  # a pair of identical texts carries no preference
            b = noisy_response(d, rng, CANDIDATES, SLIPS_CANDIDATES)
        chosen, rejected = label_pair(prompt, a, b, rng, tau)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def make_task_data(
    out_dir: str | Path,
    seed: int = 0,
    *,
    n_sft_train: int = 4000,
    n_sft_eval: int = 200,
    n_prefs_train: int = 4000,
    n_prefs_eval: int = 500,
    n_prompts_train: int = 2000,
    n_prompts_eval: int = 256,
    tau: float = LABEL_TAU,
    model: dict | None = None,
) -> dict:
    """Write the task's data, tokenizer and a randomly initialised tiny base model under ``out_dir``.

    Files: ``sft_{train,eval}.jsonl`` (``prompt``, ``response``), ``prefs_{train,eval}.jsonl``
    (``prompt``, ``chosen``, ``rejected``), ``prompts_{train,eval}.jsonl`` (``prompt``),
    ``tokenizer/``, ``base_model/`` (a tiny llama, see ``model``) and ``task.json`` (sizes, design
    constants and measured data statistics). Held-out prompts are never among the training prompts
    of any split. The same ``seed`` gives identical files. Returns the ``task.json`` contents.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"proximal-digits-{seed}")  # a str seed is hashed deterministically

    # Held-out prompts first, so no training split can contain them.
    eval_digits = _prompts(rng, n_sft_eval + n_prefs_eval + n_prompts_eval, set())
    held_out = set(eval_digits)
    sft_eval_d = eval_digits[:n_sft_eval]
    prefs_eval_d = eval_digits[n_sft_eval : n_sft_eval + n_prefs_eval]
    prompts_eval_d = eval_digits[n_sft_eval + n_prefs_eval :]
    # Training prompts may repeat across training splits (as in real pipelines), never across held-out.
    sft_train_d = _prompts(rng, n_sft_train, held_out)
    prefs_train_d = _prompts(rng, n_prefs_train, held_out)
    prompts_train_d = _prompts(rng, n_prompts_train, held_out)

    sft = {
        name: [{"prompt": d + SEP, "response": teacher_response(d, rng)} for d in ds]
        for name, ds in (("train", sft_train_d), ("eval", sft_eval_d))
    }
    prefs = {"train": _pairs(prefs_train_d, rng, tau), "eval": _pairs(prefs_eval_d, rng, tau)}
    prompts = {
        "train": [{"prompt": d + SEP} for d in prompts_train_d],
        "eval": [{"prompt": d + SEP} for d in prompts_eval_d],
    }
    for split in ("train", "eval"):
        write_jsonl(out / f"sft_{split}.jsonl", sft[split])
        write_jsonl(out / f"prefs_{split}.jsonl", prefs[split])
        write_jsonl(out / f"prompts_{split}.jsonl", prompts[split])

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out / "tokenizer")
    model_kwargs = dict(DEFAULT_MODEL, **(model or {}))
    build_tiny_causal_lm(out / "base_model", tokenizer, seed=seed, **model_kwargs)

    def mean_gold(rows: list[dict], key: str) -> float:
        return sum(gold(r["prompt"], r[key]) for r in rows) / len(rows)

    info = {
        "task": "digits-sort",
        "seed": seed,
        "sizes": {
            "sft_train": n_sft_train,
            "sft_eval": n_sft_eval,
            "prefs_train": n_prefs_train,
            "prefs_eval": n_prefs_eval,
            "prompts_train": n_prompts_train,
            "prompts_eval": n_prompts_eval,
        },
        "teacher": TEACHER,
        "teacher_slips": list(SLIPS_TEACHER),
        "candidates": CANDIDATES,
        "candidate_slips": list(SLIPS_CANDIDATES),
        "label_tau": tau,
        "model": model_kwargs,
        "teacher_gold_train": mean_gold(sft["train"], "response"),
        "teacher_gold_eval": mean_gold(sft["eval"], "response"),
        "label_gold_agreement_train": gold_agreement(prefs["train"]),
        "label_expected_agreement_train": expected_agreement(prefs["train"], tau),
        "label_gold_agreement_eval": gold_agreement(prefs["eval"]),
    }
    (out / "task.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


#: The tiny base model: a 2-layer llama, hidden 64 (about 0.13 M parameters).
DEFAULT_MODEL = {"arch": "llama", "hidden": 64, "layers": 2, "heads": 4, "max_positions": 64}
