"""The built-in tool task: multiplying three-digit numbers, with a ``calculator`` tool.

A prompt is a product followed by ``=`` (``"123*456="``). A tiny model cannot multiply three-digit
numbers in its head; with the tool it only has to copy the expression into a call and the result
into its answer. The right trajectory, in the minimal call format (``[name args]``,
:class:`proximal.agents.tools.MinimalFormat`) and this task's chat template (a tool result is
written ``{result}``; an assistant turn ends with EOS)::

    123*456=  [calculator 123*456]<eos>  {56088}  answer: 56088<eos>
    prompt    agent turn 1               tool     agent turn 2

Prompt rows carry the reference in an ``answer`` column, and the verifier, the format-error count
and the gold score read answers as the arithmetic task's do (:mod:`proximal.tasks.arithmetic`: the
last ``answer: N``; exact match against the value of the prompt's own expression), over the whole
trajectory — every turn, not only the text before the first EOS — given as text (EOS written or
dropped) or as chat messages (the assistant turns are read). An observation ``{56088}`` is never
an answer.

A **sloppy teacher** (:data:`TEACHER`) writes the SFT demonstrations as conversations with tool
turns: often right; otherwise it skips the tool and guesses (a near miss), miscopies the tool's
result, calls the tool with a typo in an operand and copies the wrong result, or gets the value
right and botches the answer line. The same teacher's answers without the tool
(``sft_notool_*.jsonl``) are the no-tool baseline's demonstrations.

:func:`make_task_data` writes every file deterministically (the same seed, byte-identical files).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from proximal.data.jsonl import write_jsonl
from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm
from proximal.tasks import arithmetic
from proximal.tasks.arithmetic import ANSWER_PREFIX, BAD_ANSWER_LINES, is_held_out, solve

__all__ = [
    "build_tokenizer",
    "calculator",
    "call",
    "completion_text",
    "exact_match",
    "format_error",
    "make_task_data",
    "random_product",
    "teacher_messages",
    "trajectory_text",
    "verify",
]

#: The operands of a prompt's product.
OPERANDS = (100, 999)
SEP = "="
#: The tool's name, the minimal call format's brackets, and how the template writes a tool result.
TOOL = "calculator"
CALL_OPEN, CALL_CLOSE = "[", "]"
RESULT_OPEN, RESULT_CLOSE = "{", "}"
#: Every character a prompt, a call, a result, an answer or a tool's error message uses (letters
#: of both cases for error text such as "ValueError: ..."); anything else is <unk>.
ALPHABET = "0123456789+-*()=;:,.'_ []{}\\abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
#: The longest right trajectory: "123*456=" + "[calculator 123*456]" + EOS + "{123456}" +
#: "answer: 123456" + EOS is 8 + 21 + 8 + 15 = 52 tokens; a rollout's budget after the prompt.
MAX_RESPONSE_TOKENS = 64

#: How the sloppy teacher answers: "correct" — calls the tool, copies its result; "no_call" —
#: answers without the tool, a near miss; "miscopy" — calls the tool, copies its result with one
#: digit wrong; "typo" — calls it with one operand digit wrong, copies that result; "format" —
#: right value, malformed answer line (:data:`~proximal.tasks.arithmetic.BAD_ANSWER_LINES`).
TEACHER = {"correct": 0.45, "no_call": 0.2, "miscopy": 0.15, "typo": 0.1, "format": 0.1}

_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}{{ '"
    + RESULT_OPEN
    + "' ~ m['content'] ~ '"
    + RESULT_CLOSE
    + "' }}"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% endfor %}"
)

#: The tiny base model: a 2-layer llama as the arithmetic task's, with room for a whole trajectory.
DEFAULT_MODEL = {"arch": "llama", "hidden": 64, "layers": 2, "heads": 4, "max_positions": 96}


def calculator(expression: str) -> int:
    """Evaluate an arithmetic expression.

    Args:
        expression: non-negative integers with +, - and * and parentheses, e.g. "123*456".
    """
    return solve(expression.strip() + SEP)


def trajectory_text(completion) -> str:
    """The text the answer is read from: a completion's text with each special token (``<eos>``
    between turns, padding) read as a line break, or the assistant turns of a message list."""
    if isinstance(completion, list):
        return "\n".join(m["content"] for m in completion if m.get("role") == "assistant")
    for special in ("<eos>", "<pad>", "<bos>"):
        completion = completion.replace(special, "\n")
    return completion


def verify(prompts: list[str], completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 where the trajectory's final answer equals the row's ``answer``, else 0.0 (TRL's
    reward-function signature; :func:`proximal.tasks.arithmetic.verify` on :func:`trajectory_text`)."""
    texts = [trajectory_text(c) for c in completions]
    return arithmetic.verify(prompts, texts, answer=answer)


def format_error(prompts: list[str], completions: list, **kwargs) -> list[float]:
    """1.0 for each trajectory with no readable final answer, else 0.0."""
    return arithmetic.format_error(prompts, [trajectory_text(c) for c in completions])


def exact_match(prompts: list[str], completions: list, **kwargs) -> list[float]:
    """The gold score: 1.0 where the final answer equals the product the prompt asks for (computed
    here, the ``answer`` column not read), else 0.0."""
    return arithmetic.exact_match(prompts, [trajectory_text(c) for c in completions])


def build_tokenizer():
    """The task's character tokenizer: ``<pad> <eos> <bos> <unk>`` (ids 0-3), then :data:`ALPHABET`,
    with the task's chat template (tool results as ``{...}``, EOS after each assistant turn)."""
    return build_char_tokenizer(ALPHABET, chat_template=_CHAT_TEMPLATE)


def call(expression: str) -> str:
    """The minimal-format call of the calculator: ``[calculator 123*456]``."""
    return f"{CALL_OPEN}{TOOL} {expression}{CALL_CLOSE}"


def random_product(rng: random.Random, operands: tuple[int, int] = OPERANDS) -> str:
    return f"{rng.randint(*operands)}*{rng.randint(*operands)}"


def _digit_slip(value: int, rng: random.Random) -> int:
    """``value`` with one digit changed (the leading digit never to 0)."""
    digits = list(str(value))
    i = rng.randrange(len(digits))
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i] and (i or d != "0")])
    return int("".join(digits))


def teacher_messages(prompt: str, rng: random.Random, mix: dict[str, float] | None = None):
    """The sloppy teacher's conversation for ``prompt``: user, assistant (a call or the answer),
    and when it called the tool, the tool's result and the assistant's answer."""
    mix = TEACHER if mix is None else mix
    behaviour = rng.choices(list(mix), weights=list(mix.values()))[0]
    expression = prompt[: -len(SEP)]
    value = calculator(expression)
    user = {"role": "user", "content": prompt}
    if behaviour == "no_call":
        return [user, {"role": "assistant", "content": f"{ANSWER_PREFIX}{_digit_slip(value, rng)}"}]
    if behaviour == "typo":
        left, right = expression.split("*")
        if rng.random() < 0.5:
            left = str(_digit_slip(int(left), rng))
        else:
            right = str(_digit_slip(int(right), rng))
        expression = f"{left}*{right}"
    result = calculator(expression)
    answer = f"{ANSWER_PREFIX}{result}"
    if behaviour == "miscopy":
        answer = f"{ANSWER_PREFIX}{_digit_slip(result, rng)}"
    elif behaviour == "format":
        answer = rng.choice(BAD_ANSWER_LINES[:2]).format(result)  # no colon, or the bare number
    return [
        user,
        {"role": "assistant", "content": call(expression)},
        {"role": "tool", "name": TOOL, "content": str(result)},
        {"role": "assistant", "content": answer},
    ]


def completion_text(messages: list[dict]) -> str:
    """The text after the prompt as a rollout holds it (the template's rendering of the turns after
    the user's), EOS written ``<eos>``: what the verifier reads."""
    out = []
    for m in messages[1:]:
        if m["role"] == "assistant":
            out.append(m["content"] + "<eos>")
        else:
            out.append(RESULT_OPEN + m["content"] + RESULT_CLOSE)
    return "".join(out)


def _draw(rng, n: int, *, held_out: bool, unique: bool, seed: int) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        e = random_product(rng)
        if is_held_out(e, seed) != held_out or (unique and e in seen):
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

    Files: ``sft_{train,eval}.jsonl`` (``messages``: the teacher's conversation with tool turns),
    ``sft_notool_{train,eval}.jsonl`` (``prompt``, ``response``: the teacher's final answer alone,
    for the no-tool baseline), ``prompts_{train,eval}.jsonl`` (``prompt``, ``answer``),
    ``tokenizer/``, ``base_model/`` and ``task.json`` (sizes, the tool, the call format, the
    teacher's measured exact match). Held-out prompts (``*_eval``) never appear in training
    files; the same ``seed`` gives identical files. Returns ``task.json``'s contents.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"proximal-calculator-{seed}")
    teacher = dict(TEACHER if teacher is None else teacher)

    held = _draw(rng, n_sft_eval + n_prompts_eval, held_out=True, unique=True, seed=seed)
    splits = {
        "sft_eval": held[:n_sft_eval],
        "prompts_eval": held[n_sft_eval:],
        "sft_train": _draw(rng, n_sft_train, held_out=False, unique=False, seed=seed),
        "prompts_train": _draw(rng, n_prompts_train, held_out=False, unique=False, seed=seed),
    }
    rates = {}
    for split in ("train", "eval"):
        convs = [teacher_messages(e + SEP, rng, teacher) for e in splits[f"sft_{split}"]]
        write_jsonl(out / f"sft_{split}.jsonl", [{"messages": c} for c in convs])
        write_jsonl(
            out / f"sft_notool_{split}.jsonl",
            [{"prompt": c[0]["content"], "response": c[-1]["content"]} for c in convs],
        )
        prompts = [c[0]["content"] for c in convs]
        rates[f"teacher_exact_match_{split}"] = _mean(
            exact_match(prompts, [completion_text(c) for c in convs])
        )
        rates[f"teacher_tool_use_{split}"] = _mean([float(len(c) > 2) for c in convs])
        write_jsonl(
            out / f"prompts_{split}.jsonl",
            [{"prompt": e + SEP, "answer": str(calculator(e))} for e in splits[f"prompts_{split}"]],
        )

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out / "tokenizer")
    model_kwargs = dict(DEFAULT_MODEL, **(model or {}))
    build_tiny_causal_lm(out / "base_model", tokenizer, seed=seed, **model_kwargs)

    info = {
        "task": "calculator",
        "seed": seed,
        "sizes": {k: len(v) for k, v in splits.items()},
        "operands": list(OPERANDS),
        "tools": [f"{__name__}:{TOOL}"],
        "call_format": {"format": "minimal", "open": CALL_OPEN, "close": CALL_CLOSE},
        "max_response_tokens": MAX_RESPONSE_TOKENS,
        "teacher": teacher,
        "model": model_kwargs,
        **rates,
    }
    (out / "task.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
