"""reasoning-gym generators as built-in tasks for ``proximal compare --compare.task reasoning_gym:NAME``.

A task is one generator at a size a tiny character-level model learns on a CPU (:data:`GENERATORS`):
``chain_sum`` (2–3 one-digit terms, ``+`` and ``-``: "State the final answer to the following
arithmetic problem: 4 - 1 - 7 =") and ``basic_arithmetic`` (2–3 one-digit terms, ``+`` and ``-``,
negative terms and parentheses: "Calculate ( 5 + -8 ) - -6."). Its prompts are the generator's own entries,
read from the source ``reasoning-gym://NAME?...`` (:mod:`proximal.data.gym`, no instruction: the
bare question): the training split for SFT and RL, the held-out split (apart by seed and by question)
for evaluation. The reward is ``proximal.rewards:reasoning_gym``, the generator's own
``score_answer`` of the text in the last ``<answer>…</answer>``.

The SFT data is written by a **sloppy teacher** (:data:`TEACHER`), as the arithmetic task's
(:mod:`proximal.tasks.arithmetic`). Neither generator gives a worked solution, so the teacher works
the generator's own expression (its entry's ``metadata["expression"]``) one ``+``/``-`` at a time
(:func:`working`) before the answer line: ``0-4=-4;-4-8=-12;<answer>-12</answer>``. It is right
some of the time, otherwise slips in one step (off by one, off by ten, one digit wrong) and carries
the slip on to its answer, or writes the right working and the right number without the
``<answer>`` tags (a format error, which the scorer gives 0). ``make_task_data(..., worked=False)``
writes the answer line alone, as before: a 2-layer model fine-tuned on answers alone answers few
unseen questions right (chain_sum: 0.15 after 2 000 steps, against 0.34 after 1 000 steps with the
working; docs/tasks.md). A model fine-tuned on the teacher answers right below its 55 %; an RL stage
rewarded by the scorer can learn to avoid the teacher's habits.

Held-out columns: :func:`exact_match` (the tagged answer equals the gold answer, as text) and
:func:`format_error` (no ``<answer>`` tag).
"""

from __future__ import annotations

import ast
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
#: How the sloppy SFT teacher answers: "slip" = a careless result in one step (the answer alone: a
#: careless answer), carried on to the tagged answer; "format" = the right working and number
#: without the tags (:data:`BAD_FORMATS`).
TEACHER = {"correct": 0.55, "slip": 0.3, "format": 0.15}
BAD_FORMATS = ("{}", "answer: {}", "<answer>{}")
#: Between the worked steps: ``0-4=-4;-4-8=-12;<answer>-12</answer>``.
STEP_SEP = ";"
#: The longest response, with room: the teacher's longest is 38 characters for chain_sum
#: (``8-9=-1;-1-7=-8;<answer>-8</answer>``), 67 for basic_arithmetic (nested negations; 0.1 % of
#: its questions pass 56), + EOS.
MAX_RESPONSE_TOKENS = 64
#: The longest prompt: chain_sum's 3-term question is 72 characters.
MAX_PROMPT_TOKENS = 96
#: The tiny base model: a 2-layer llama, hidden 128; a whole prompt and response in its positions.
DEFAULT_MODEL = {"arch": "llama", "hidden": 128, "layers": 2, "heads": 4, "max_positions": 160}

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


def working(expression: str, slip_at: int | None = None, rng: random.Random | None = None):
    """``(steps, value)``: the worked solution of a ``+ -`` expression (the generators' metadata
    ``expression``), one operation a step in evaluation order (innermost first, left to right) —
    ``"0 - 4 - 8"`` → ``["0-4=-4", "-4-8=-12"]``, -12; the negation of a group is a step of its own
    (``-(-3)=3``; a run of them one step, ``-(-(12))=12``), a negative number is not. Step
    ``slip_at``'s result is replaced by a careless one (:func:`_careless`) that the later steps
    compute on, as a person working by hand carries a mistake forward. ValueError for anything
    but integers, ``+``, ``-`` and parentheses."""
    steps: list[str] = []

    def result(text: str, value: int) -> int:
        if len(steps) == slip_at:
            value = _careless(value, rng)
        steps.append(f"{text}={value}")
        return value

    def walk(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            k = 0  # a run of negations is one step: -(-(3+9)) → 3+9=12;-(-(12))=12
            while isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
                node, k = node.operand, k + 1
            inner = walk(node)
            if isinstance(node, ast.Constant):  # the innermost minus is the number's sign
                inner, k = -inner, k - 1
            if k == 0:
                return inner
            return result(f"{'-(' * k}{inner}{')' * k}", -inner if k % 2 else inner)
        if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub):
            left, right = walk(node.left), walk(node.right)
            op = "+" if isinstance(node.op, ast.Add) else "-"
            return result(f"{left}{op}{right}", left + right if op == "+" else left - right)
        raise ValueError(f"not a + - expression: {expression!r}")

    try:
        tree = ast.parse(expression, mode="eval").body
    except SyntaxError:
        raise ValueError(f"not a + - expression: {expression!r}") from None
    value = walk(tree)
    return steps, value


def teacher_response(
    answer: str,
    rng: random.Random,
    mix: dict[str, float] | None = None,
    expression: str | None = None,
) -> str:
    """The sloppy teacher's response to a question whose gold answer is ``answer`` (:data:`TEACHER`):
    with ``expression``, its worked solution (:func:`working`; a slip in one step, carried on) before
    the answer line, else the answer line alone (a slip: a careless answer)."""
    mix = TEACHER if mix is None else mix
    behaviour = rng.choices(list(mix), weights=list(mix.values()))[0]
    steps: list[str] = []
    value = int(answer)
    if expression is not None:
        steps, value = working(expression)
        if value != int(answer):
            raise ValueError(f"{expression!r} works out to {value}, the generator says {answer}")
    if behaviour == "slip" and steps:
        steps, value = working(expression, rng.randrange(len(steps)), rng)
    elif behaviour == "slip":  # the answer alone, or a bare number: nothing to work out
        value = _careless(value, rng)
    if behaviour == "format":
        line = rng.choice(BAD_FORMATS).format(value)
    else:
        line = tagged(str(value))
    return STEP_SEP.join([*steps, line])


def build_tokenizer(texts: list[str]):
    """A character tokenizer over every character of ``texts`` and the answer tags."""
    alphabet = sorted(
        set("".join(texts)) | set(tagged("-0123456789")) | set(" :") | set("()=" + STEP_SEP)
    )
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
    worked: bool = True,
    model: dict | None = None,
) -> dict:
    """Write task ``name``'s files under ``out_dir``, as :func:`proximal.tasks.arithmetic.make_task_data`
    does: ``sft_{train,eval}.jsonl`` (``prompt``, ``response``: the teacher's worked solution and
    answer; ``worked=False``: the answer alone), ``prompts_{train,eval}.jsonl`` (the source's rows:
    ``prompt``, ``answer``, ``metadata``, ``generator_config``), ``tokenizer/``, ``base_model/`` and
    ``task.json``. Training rows are the
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

    def respond(row: dict) -> str:
        expression = row["metadata"]["expression"] if worked else None
        return teacher_response(row["answer"], rng, teacher, expression)

    sft = {
        "train": [{"prompt": r["prompt"], "response": respond(r)} for r in train],
        "eval": [{"prompt": r["prompt"], "response": respond(r)} for r in held[:n_sft_eval]],
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
        "worked": worked,
        "model": model_kwargs,
        "teacher_exact_match_train": rate(exact_match, sft["train"], train),
        "teacher_format_errors_train": rate(format_error, sft["train"], train),
    }
    (out / "task.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
