"""The built-in reasoning task: multi-step integer arithmetic, with reference answers and a verifier.

A prompt is a fully parenthesised expression followed by ``=`` (``"(7+5)*3="``); the right response
works it out one operation at a time and ends with the answer line::

    (7+5)*3=   ->   7+5=12;12*3=36;answer: 36

Prompt rows carry the reference in an ``answer`` column (``{"prompt": "(7+5)*3=", "answer": "36"}``),
the way reasoning data sets do (GSM8K, MATH). The reward is a **verifier** that reads it:
:func:`verify` ``(prompts, completions, answer, **kwargs)`` — TRL's reward-function signature, the
row's ``answer`` column arriving as a keyword — extracts the final answer (the last ``answer: N`` or
``\\boxed{N}``) and scores 1.0 when it equals the reference, 0.0 when it does not, and 0.0 when there
is no readable answer at all. Those malformed responses are counted apart by :func:`format_error`
(1.0 per malformed response), a score function of the same signature to log beside the reward with
weight 0. The **gold score** is exact match (:func:`exact_match`): the same reading, checked against
the value of the prompt's own expression, computed here and never read from the data.

The sizes are chosen so the demo's tiny model learns the task on a CPU in minutes: operands 1-9,
one or two operations among ``+ - *``, and every intermediate value in 0..99 (:data:`MAX_VALUE`;
expressions outside it are redrawn). What RLHF has to fix is put in the demonstrations on purpose,
as in the digit task (:mod:`proximal.tasks.digits`): a **sloppy teacher** (:data:`TEACHER`) writes
the right working only some of the time; otherwise it slips on one step and carries the wrong value
on, stops after the first step and gives that as the answer, or gets the working right and botches
the answer line (a format error). A model fine-tuned on it answers right well below the ceiling;
an online method rewarded by the verifier can learn to avoid the teacher's habits.

:func:`make_task_data` writes every file a run needs; the same seed gives byte-identical files.
Held-out prompts are a fixed share of all expressions (:func:`is_held_out`, a hash of the
expression), so no training split ever contains one.
"""

from __future__ import annotations

import ast
import json
import random
import re
import zlib
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from proximal.data.jsonl import write_jsonl
from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm

#: Operators and the operand range of generated expressions; every intermediate value and the
#: answer lie in [0, MAX_VALUE] (an expression outside it is redrawn).
OPS = "+-*"
OPERANDS = (1, 9)
N_OPS = (1, 2)
MAX_VALUE = 99
SEP = "="
STEP_SEP = ";"
ANSWER_PREFIX = "answer: "
#: Every character of prompts, workings and answers (``\\boxed{N}`` included, which the verifier
#: reads though the teacher never writes it).
ALPHABET = "0123456789+-*()=;: abdenorswx\\{}"
#: One expression in HELD_OUT_EVERY is held out (by a hash of its text and the seed).
HELD_OUT_EVERY = 8
#: Responses longer than this are cut by the rollout; the longest right one is 25 characters + EOS.
MAX_RESPONSE_TOKENS = 32

#: How the sloppy SFT teacher answers: probability of each behaviour. "slip" = one step's result
#: wrong and carried on; "early" = the first step's value given as the answer (a slip when there is
#: one step); "format" = the right working with a malformed answer line (:data:`BAD_ANSWER_LINES`).
TEACHER = {"correct": 0.4, "slip": 0.3, "early": 0.1, "format": 0.2}
#: The teacher's malformed answer lines ("{}" is the right value): no colon, no keyword, none at all.
BAD_ANSWER_LINES = ("answer {}", "{}", "")

_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)

#: The tiny base model: a 2-layer llama, hidden 64, as the digit task's.
DEFAULT_MODEL = {"arch": "llama", "hidden": 64, "layers": 2, "heads": 4, "max_positions": 64}


def build_tokenizer():
    """The task's character tokenizer: ``<pad> <eos> <bos> <unk>`` (ids 0-3), then :data:`ALPHABET`."""
    return build_char_tokenizer(ALPHABET, chat_template=_CHAT_TEMPLATE)


# ----------------------------------------------------------------------------------------------
# Expressions
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One operation of a working: ``left op right = value``."""

    left: int
    op: str
    right: int
    value: int

    def text(self) -> str:
        return f"{self.left}{self.op}{self.right}={self.value}"


def apply(left: int, op: str, right: int) -> int:
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    raise ValueError(f"unknown operator {op!r}")


def random_expression(
    rng: random.Random,
    *,
    n_ops: tuple[int, int] = N_OPS,
    operands: tuple[int, int] = OPERANDS,
    max_value: int = MAX_VALUE,
) -> str:
    """A fully parenthesised expression of ``n_ops`` operations (the outermost pair left off) whose
    every intermediate value is in [0, max_value]; drawn again until it is."""
    while True:
        k = rng.randint(*n_ops)
        value = rng.randint(*operands)
        text = str(value)
        # Grow one side: each new operation takes the tree so far as its left or right operand.
        for i in range(k):
            op, leaf = rng.choice(OPS), rng.randint(*operands)
            inner = text if i == 0 else f"({text})"
            if rng.random() < 0.5:
                text, value = f"{inner}{op}{leaf}", apply(value, op, leaf)
            else:
                text, value = f"{leaf}{op}{inner}", apply(leaf, op, value)
            if not 0 <= value <= max_value:
                break
        else:
            return text


def parse(expression: str) -> ast.expr:
    """The expression's syntax tree, integers and ``+ - *`` only; ValueError for anything else."""
    try:
        tree = ast.parse(expression, mode="eval").body
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def check(node) -> None:
        if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
            check(node.left)
            check(node.right)
        elif not (isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0):
            raise ValueError(
                f"not an arithmetic expression: {expression!r} (only non-negative integers, "
                "+, - and * with parentheses)"
            )

    check(tree)
    return tree


_AST_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}


def steps(expression: str) -> list[Step]:
    """The working, one operation at a time in evaluation order (innermost first)."""
    return _working(expression)


def _working(expression: str, slip_at: int | None = None, rng=None, max_value=MAX_VALUE):
    # The steps, with step ``slip_at``'s result replaced by a careless one that the later steps then
    # compute on, as a person working by hand carries a mistake forward.
    out: list[Step] = []

    def walk(node) -> int:
        if isinstance(node, ast.Constant):
            return node.value
        left, right = walk(node.left), walk(node.right)
        op = _AST_OPS[type(node.op)]
        value = apply(left, op, right)
        if len(out) == slip_at:
            value = _slipped(value, rng, max_value)
        out.append(Step(left, op, right, value))
        return value

    walk(parse(expression))
    return out


def prompt_expression(prompt: str) -> str:
    """The expression a prompt asks for: ``"(7+5)*3="`` → ``"(7+5)*3"``; ValueError for anything else."""
    body = prompt.strip()
    if not body.endswith(SEP):
        raise ValueError(
            f"not an arithmetic-task prompt: {prompt!r} (expected an expression followed by "
            f"{SEP!r}, e.g. '(7+5)*3=')"
        )
    return body[:-1]


def solve(prompt: str) -> int:
    """The value of the prompt's expression."""
    expression = prompt_expression(prompt)
    working = steps(expression)
    return working[-1].value if working else int(expression)


def worked_solution(prompt: str) -> str:
    """The right response: each step, then ``answer: N``."""
    working = steps(prompt_expression(prompt))
    return STEP_SEP.join([s.text() for s in working] + [f"{ANSWER_PREFIX}{working[-1].value}"])


# ----------------------------------------------------------------------------------------------
# Reading answers: the verifier, its format-error count and the gold score
# ----------------------------------------------------------------------------------------------

# The last "answer: N" or "\boxed{N}" is the answer. N is an integer or a decimal, optionally signed;
# it must end there ("answer: 1x8" is no answer at all, not the answer 1); a full stop may follow.
_NUMBER = r"([-+]?\d+(?:\.\d+)?)"
_ANSWER = re.compile(rf"answer:\s*{_NUMBER}(?!\.?\w)|\\boxed\{{\s*{_NUMBER}\s*\}}")


def _response_text(completion: str) -> str:
    # What follows EOS is never the answer; padding never is either (rollouts may decode either way).
    cut = completion.find("<eos>")
    if cut >= 0:
        completion = completion[:cut]
    return completion.replace("<pad>", "").replace("<bos>", "")


def extract_answer(completion: str) -> Decimal | None:
    """The response's final answer (the last ``answer: N`` or ``\\boxed{N}``), or None when it has none."""
    found = _ANSWER.findall(_response_text(completion))
    if not found:
        return None
    plain, boxed = found[-1]
    return Decimal(plain or boxed)


def _reference(value, i: int) -> Decimal:
    try:
        return Decimal(str(value).strip())
    except InvalidOperation:
        raise ValueError(
            f"answer[{i}] = {value!r} is not a number (the answer column holds the reference, e.g. '36')"
        ) from None


def _check_lengths(name: str, prompts, completions, **columns) -> None:
    for key, values in {"completions": completions, **columns}.items():
        if values is not None and len(values) != len(prompts):
            raise ValueError(f"{name}: {len(prompts)} prompts but {len(values)} {key}")


def verify(prompts: list[str], completions: list[str], answer: list, **kwargs) -> list[float]:
    """The task's verifier, a reward function of TRL's signature: 1.0 where the response's final answer
    (:func:`extract_answer`) equals the row's reference ``answer``, 0.0 where it differs and 0.0 where
    there is none (malformed; :func:`format_error` counts those). ``answer`` holds one reference per
    completion (a string or a number); other keywords (``completion_ids``, ``step``, …) are ignored.
    """
    _check_lengths("verify", prompts, completions, answer=answer)
    out = []
    for i, (completion, ref) in enumerate(zip(completions, answer)):
        got = extract_answer(completion)
        out.append(1.0 if got is not None and got == _reference(ref, i) else 0.0)
    return out


def format_error(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """1.0 for each response with no readable final answer (no ``answer: N``, no ``\\boxed{N}``),
    else 0.0: the malformed responses the verifier scores 0. A score function of the reward-function
    signature, so a run logs its rate per step with weight 0 (``score/...:format_error``)."""
    _check_lengths("format_error", prompts, completions)
    return [1.0 if extract_answer(c) is None else 0.0 for c in completions]


def exact_match(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """The gold score: 1.0 where the final answer equals the value of the prompt's expression,
    computed here (the data's ``answer`` column is not read), else 0.0."""
    _check_lengths("exact_match", prompts, completions)
    out = []
    for prompt, completion in zip(prompts, completions):
        got = extract_answer(completion)
        out.append(1.0 if got is not None and got == solve(prompt) else 0.0)
    return out


# ----------------------------------------------------------------------------------------------
# The sloppy teacher
# ----------------------------------------------------------------------------------------------


def _slipped(value: int, rng: random.Random, max_value: int) -> int:
    """A careless result near ``value``: off by one, off by ten (a carry), or one digit wrong."""
    while True:
        kind = rng.choice(("one", "ten", "digit"))
        if kind == "one":
            wrong = value + rng.choice((-1, 1))
        elif kind == "ten":
            wrong = value + rng.choice((-10, 10))
        else:
            digits = list(str(value))
            i = rng.randrange(len(digits))
            digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
            wrong = int("".join(digits))
        if wrong != value and 0 <= wrong <= max_value:
            return wrong


def teacher_response(
    prompt: str, rng: random.Random, mix: dict[str, float] | None = None, max_value: int = MAX_VALUE
) -> str:
    """The sloppy SFT teacher's working (see :data:`TEACHER`)."""
    mix = TEACHER if mix is None else mix
    behaviour = rng.choices(list(mix), weights=list(mix.values()))[0]
    working = steps(prompt_expression(prompt))
    if behaviour == "early" and len(working) == 1:
        behaviour = "slip"
    if behaviour == "early":
        return STEP_SEP.join([working[0].text(), f"{ANSWER_PREFIX}{working[0].value}"])
    if behaviour == "slip":  # one step wrong; the later steps compute on with the wrong value
        working = _working(prompt_expression(prompt), rng.randrange(len(working)), rng, max_value)
    body = [s.text() for s in working]
    if behaviour == "format":
        line = rng.choice(BAD_ANSWER_LINES).format(working[-1].value)
        return STEP_SEP.join(body + ([line] if line else []))
    return STEP_SEP.join(body + [f"{ANSWER_PREFIX}{working[-1].value}"])


# ----------------------------------------------------------------------------------------------
# Writing the task's files
# ----------------------------------------------------------------------------------------------


def is_held_out(expression: str, seed: int) -> bool:
    """Whether ``expression`` belongs to the held-out share (one in :data:`HELD_OUT_EVERY`)."""
    return zlib.crc32(f"{seed}:{expression}".encode()) % HELD_OUT_EVERY == 0


def _draw(
    rng: random.Random, n: int, *, held_out: bool, unique: bool, seed: int, **sizes
) -> list[str]:
    """``n`` expressions of one share; ``unique``: no repeats (held-out sets), else drawn freely."""
    out: list[str] = []
    seen: set[str] = set()
    misses = 0
    while len(out) < n:
        e = random_expression(rng, **sizes)
        if is_held_out(e, seed) != held_out:
            continue
        if unique and e in seen:
            misses += 1
            if misses > 200 * n:
                raise ValueError(
                    f"only {len(out)} distinct held-out expressions found for the {n} asked; "
                    "ask for fewer held-out prompts or allow larger expressions"
                )
            continue
        seen.add(e)
        out.append(e)
    return out


def make_task_data(
    out_dir: str | Path,
    seed: int = 0,
    *,
    n_sft_train: int = 4000,
    n_sft_eval: int = 200,
    n_prompts_train: int = 2000,
    n_prompts_eval: int = 256,
    teacher: dict[str, float] | None = None,
    model: dict | None = None,
) -> dict:
    """Write the task's data, tokenizer and a randomly initialised tiny base model under ``out_dir``.

    Files: ``sft_{train,eval}.jsonl`` (``prompt``, ``response``: the teacher's working),
    ``prompts_{train,eval}.jsonl`` (``prompt``, ``answer``: the reference, a string), ``tokenizer/``,
    ``base_model/`` (a tiny llama, see ``model``) and ``task.json`` (sizes, design constants and the
    teacher's measured exact-match and format-error rates). Held-out prompts (``*_eval``) are never
    among the training prompts. The same ``seed`` gives identical files. Returns ``task.json``'s contents.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"proximal-arithmetic-{seed}")  # a str seed is hashed deterministically
    teacher = dict(TEACHER if teacher is None else teacher)

    held = _draw(rng, n_sft_eval + n_prompts_eval, held_out=True, unique=True, seed=seed)
    sft_eval_e, prompts_eval_e = held[:n_sft_eval], held[n_sft_eval:]
    sft_train_e = _draw(rng, n_sft_train, held_out=False, unique=False, seed=seed)
    prompts_train_e = _draw(rng, n_prompts_train, held_out=False, unique=False, seed=seed)

    sft = {
        name: [{"prompt": e + SEP, "response": teacher_response(e + SEP, rng, teacher)} for e in es]
        for name, es in (("train", sft_train_e), ("eval", sft_eval_e))
    }
    prompts = {
        name: [{"prompt": e + SEP, "answer": str(solve(e + SEP))} for e in es]
        for name, es in (("train", prompts_train_e), ("eval", prompts_eval_e))
    }
    for split in ("train", "eval"):
        write_jsonl(out / f"sft_{split}.jsonl", sft[split])
        write_jsonl(out / f"prompts_{split}.jsonl", prompts[split])

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out / "tokenizer")
    model_kwargs = dict(DEFAULT_MODEL, **(model or {}))
    build_tiny_causal_lm(out / "base_model", tokenizer, seed=seed, **model_kwargs)

    def rate(fn, rows: list[dict]) -> float:
        scores = fn([r["prompt"] for r in rows], [r["response"] for r in rows])
        return sum(scores) / len(scores)

    info = {
        "task": "arithmetic",
        "seed": seed,
        "sizes": {
            "sft_train": n_sft_train,
            "sft_eval": n_sft_eval,
            "prompts_train": n_prompts_train,
            "prompts_eval": n_prompts_eval,
        },
        "ops": OPS,
        "operands": list(OPERANDS),
        "n_ops": list(N_OPS),
        "max_value": MAX_VALUE,
        "held_out_every": HELD_OUT_EVERY,
        "teacher": teacher,
        "model": model_kwargs,
        "teacher_exact_match_train": rate(exact_match, sft["train"]),
        "teacher_exact_match_eval": rate(exact_match, sft["eval"]),
        "teacher_format_errors_train": rate(format_error, sft["train"]),
    }
    (out / "task.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
