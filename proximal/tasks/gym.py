"""reasoning-gym generators as built-in tasks for ``proximal compare --compare.task reasoning_gym:NAME``.

A task is one generator at a size a tiny character-level model learns on a CPU (:data:`GENERATORS`):
``chain_sum`` (2–3 one-digit terms, ``+`` and ``-``: "State the final answer to the following
arithmetic problem: 4 - 1 - 7 =") and ``basic_arithmetic`` (2–3 one-digit terms, ``+`` and ``-``,
negative terms and parentheses: "Calculate ( 5 + -8 ) - -6."). Its prompts are the generator's own entries,
read from the source ``reasoning-gym://NAME?...`` (:mod:`proximal.data.gym`, no instruction: the
bare question): the training split for SFT and RL, the held-out split (apart by seed and by question)
for evaluation. The reward is ``proximal.rewards:reasoning_gym``, the generator's own
``score_answer`` of the text in the last ``<answer>…</answer>``.

The SFT data is the generator's answers (neither generator gives a worked solution) written by a
**sloppy teacher** (:data:`TEACHER`), as the arithmetic task's (:mod:`proximal.tasks.arithmetic`):
right some of the time, otherwise a careless answer (off by one, off by ten, one digit wrong) or the
right answer without the ``<answer>`` tags (a format error, which the scorer gives 0). A model
fine-tuned on it answers right well below the ceiling; an RL stage rewarded by the scorer can learn
to avoid the teacher's habits.

Held-out columns: :func:`exact_match` (the tagged answer equals the gold answer, as text) and
:func:`format_error` (no ``<answer>`` tag).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from urllib.parse import quote

from proximal.data.gym import SCHEME, rows
from proximal.data.jsonl import write_jsonl
from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm

#: compare.task's prefix: ``reasoning_gym:chain_sum`` (a task name, not a data spec).
PREFIX = "reasoning_gym:"
#: Each task's generator config: a small expression space, yet larger than the training set draws.
GENERATORS: dict[str, dict] = {
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1},
    # + and - only: reasoning-gym 0.1.25 computes a parenthesis-free "simple" task left to right
    # ("6 - 5 * 3" → 3), so * would teach a wrong precedence; with parentheses (the default) it
    # evaluates the expression, and allows negative terms: "Calculate ( 5 + -8 ) - -6."
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 3,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ["+", "-"],
    },
}
TASKS = tuple(PREFIX + name for name in GENERATORS)
#: How the sloppy SFT teacher answers: "slip" = a careless number in the tags; "format" = the right
#: number without them (:data:`BAD_FORMATS`).
TEACHER = {"correct": 0.55, "slip": 0.3, "format": 0.15}
BAD_FORMATS = ("{}", "answer: {}", "<answer>{}")
#: The longest response: "<answer>-27</answer>" is 20 characters, + EOS.
MAX_RESPONSE_TOKENS = 24
#: The longest prompt: chain_sum's 3-term question is 72 characters.
MAX_PROMPT_TOKENS = 96
#: The tiny base model: a 2-layer llama, hidden 128.
DEFAULT_MODEL = {"arch": "llama", "hidden": 128, "layers": 2, "heads": 4, "max_positions": 128}

_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)


def generator(task: str) -> str:
    """``reasoning_gym:chain_sum`` → ``chain_sum``; ValueError for a task that is none of these."""
    name = task.removeprefix(PREFIX)
    if not task.startswith(PREFIX) or name not in GENERATORS:
        raise ValueError(f"{task!r} is not a reasoning-gym task (known: {', '.join(TASKS)})")
    return name


def source(name: str, *, size: int, seed: int, eval_size: int) -> str:
    """The ``reasoning-gym://`` source of task ``name``: its config, no instruction."""
    query = [f"size={size}", f"seed={seed}", f"eval_size={eval_size}", "instruction=none"]
    query += [f"{k}={quote(json.dumps(v), safe='')}" for k, v in GENERATORS[name].items()]
    return f"{SCHEME}{name}?{'&'.join(query)}"


def tagged(value: str) -> str:
    return f"<answer>{value}</answer>"


def _read(completion: str) -> str | None:
    """The text of the last ``<answer>…</answer>`` (reasoning-gym's rule), EOS and padding cut."""
    # lazy: reasoning-gym is the optional `reasoning` extra; only these tasks' scores need it
    from reasoning_gym.utils import extract_answer

    cut = completion.find("<eos>")
    text = completion[:cut] if cut >= 0 else completion
    return extract_answer(text.replace("<pad>", ""), tag_name="answer")


def exact_match(completions: list[str], answer: list, **kwargs) -> list[float]:
    """1.0 where the last tagged answer equals the row's gold answer (stripped text), else 0.0."""
    return [
        float(_read(c) is not None and _read(c) == str(a).strip())
        for c, a in zip(completions, answer)
    ]


def format_error(completions: list[str], **kwargs) -> list[float]:
    """1.0 for each response with no ``<answer>…</answer>``, else 0.0."""
    return [float(_read(c) is None) for c in completions]


def _careless(value: int, rng: random.Random) -> int:
    """A careless result near ``value``: off by one, off by ten, or one digit wrong."""
    while True:
        kind = rng.choice(("one", "ten", "digit"))
        if kind == "one":
            wrong = value + rng.choice((-1, 1))
        elif kind == "ten":
            wrong = value + rng.choice((-10, 10))
        else:
            sign, digits = ("-" if value < 0 else ""), list(str(abs(value)))
            i = rng.randrange(len(digits))
            digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
            wrong = int(sign + "".join(digits))
        if wrong != value:
            return wrong


def teacher_response(answer: str, rng: random.Random, mix: dict[str, float] | None = None) -> str:
    """The sloppy teacher's response to a question whose gold answer is ``answer`` (:data:`TEACHER`)."""
    mix = TEACHER if mix is None else mix
    behaviour = rng.choices(list(mix), weights=list(mix.values()))[0]
    if behaviour == "slip":
        return tagged(str(_careless(int(answer), rng)))
    if behaviour == "format":
        return rng.choice(BAD_FORMATS).format(answer)
    return tagged(answer)


def build_tokenizer(texts: list[str]):
    """A character tokenizer over every character of ``texts`` and the answer tags."""
    alphabet = sorted(set("".join(texts)) | set(tagged("-0123456789")) | set(" :"))
    return build_char_tokenizer(alphabet, chat_template=_CHAT_TEMPLATE)


def make_task_data(
    out_dir: str | Path,
    name: str,
    seed: int = 0,
    *,
    n_train: int = 4000,
    n_sft_eval: int = 100,
    n_prompts_eval: int = 256,
    teacher: dict[str, float] | None = None,
    model: dict | None = None,
) -> dict:
    """Write task ``name``'s files under ``out_dir``, as :func:`proximal.tasks.arithmetic.make_task_data`
    does: ``sft_{train,eval}.jsonl`` (``prompt``, ``response``: the teacher's answer),
    ``prompts_{train,eval}.jsonl`` (the source's rows: ``prompt``, ``answer``, ``metadata``,
    ``generator_config``), ``tokenizer/``, ``base_model/`` and ``task.json``. Training rows are the
    source's training split (``n_train`` items at ``seed``), SFT and RL prompts alike; held-out rows
    its held-out split (no question of training), the first ``n_sft_eval`` for the SFT loss, the
    next ``n_prompts_eval`` for evaluation. The same seed gives identical files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # draw enough held-out items that n_sft_eval + n_prompts_eval remain after deduplication
    url = source(name, size=n_train, seed=seed, eval_size=8 * (n_sft_eval + n_prompts_eval))
    train = [r for _, r in rows(url, "train")]
    held = [r for _, r in rows(url, "test")]
    if len(held) < n_sft_eval + n_prompts_eval:
        raise ValueError(
            f"{name}: only {len(held)} held-out questions apart from training; ask for fewer"
        )
    rng = random.Random(f"proximal-reasoning-gym-{name}-{seed}")
    teacher = dict(TEACHER if teacher is None else teacher)
    sft = {
        "train": [
            {"prompt": r["prompt"], "response": teacher_response(r["answer"], rng, teacher)}
            for r in train
        ],
        "eval": [
            {"prompt": r["prompt"], "response": teacher_response(r["answer"], rng, teacher)}
            for r in held[:n_sft_eval]
        ],
    }
    prompts = {"train": train, "eval": held[n_sft_eval : n_sft_eval + n_prompts_eval]}
    for split in ("train", "eval"):
        write_jsonl(out / f"sft_{split}.jsonl", sft[split])
        write_jsonl(out / f"prompts_{split}.jsonl", prompts[split])
    texts = [r["prompt"] for r in train + held] + [r["response"] for r in sft["train"]]
    tokenizer = build_tokenizer(texts)
    tokenizer.save_pretrained(out / "tokenizer")
    model_kwargs = dict(DEFAULT_MODEL, **(model or {}))
    build_tiny_causal_lm(out / "base_model", tokenizer, seed=seed, **model_kwargs)

    def rate(fn, sft_rows: list[dict], gold: list[dict]) -> float:
        scores = fn([r["response"] for r in sft_rows], answer=[g["answer"] for g in gold])
        return sum(scores) / len(scores)

    info = {
        "task": PREFIX + name,
        "source": url,
        "seed": seed,
        "generator_config": GENERATORS[name],
        "sizes": {
            "train": n_train,
            "train_distinct": len({r["prompt"] for r in train}),
            "sft_eval": n_sft_eval,
            "prompts_eval": len(prompts["eval"]),
        },
        "teacher": teacher,
        "model": model_kwargs,
        "teacher_exact_match_train": rate(exact_match, sft["train"], train),
        "teacher_format_errors_train": rate(format_error, sft["train"], train),
    }
    (out / "task.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
