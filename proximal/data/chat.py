"""Turning a JSONL record into prompt text (and response text), with or without a chat template.

Two shapes of record are accepted everywhere (SFT, preference pairs, PPO prompts):

* ``{"prompt": "..."}`` — the string is the prompt, used **verbatim** (no chat template);
* ``{"messages": [{"role": ..., "content": ...}, ...]}`` — the tokenizer's chat template renders
  the turns. A prompt is the template over the context turns with ``add_generation_prompt=True``,
  i.e. exactly the text after which the policy starts writing its reply.

A response is always the *content* of the assistant turn, not the template's rendering of it. The
trainers append the tokenizer's EOS token after it. That is what a PPO rollout looks like — the
rendered prompt, the generated content, EOS — so the SFT policy and the reward model are trained on
the same token layout that PPO later samples and scores. (For chat models the tokenizer's EOS is
normally the end-of-turn token, e.g. ``<|im_end|>`` for Qwen2-Instruct.)

Tokenising the prompt and the response separately (see :func:`encode_prompt` and
:func:`encode_response`) is deliberate for the same reason: PPO sees prompt ids followed by sampled
ids, never a joint tokenisation of both strings.
"""

from __future__ import annotations

from typing import Any

from proximal.data.jsonl import DataError

ROLES = ("system", "user", "assistant", "tool")


def check_messages(value: Any, where: str, field: str = "messages") -> list[dict]:
    """``value`` as a non-empty list of ``{"role": str, "content": str}``; DataError naming ``where`` otherwise."""
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: field {field!r} must be a non-empty list of messages, "
            f"got {type(value).__name__} {value!r:.60}"
        )
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(
                f"{where}: {field}[{i}] must be an object with 'role' and 'content', "
                f"got {type(m).__name__} {m!r:.60}"
            )
        for key in ("role", "content"):
            if key not in m:
                raise DataError(f"{where}: {field}[{i}] is missing {key!r}")
            if not isinstance(m[key], str):
                raise DataError(
                    f"{where}: {field}[{i}].{key} must be a string, got "
                    f"{type(m[key]).__name__} {m[key]!r:.60}"
                )
        if m["role"] not in ROLES:
            raise DataError(
                f"{where}: {field}[{i}].role is {m['role']!r}; expected one of {', '.join(ROLES)}"
            )
    return value


def apply_template(messages: list[dict], tokenizer, where: str) -> str:
    """The chat template over ``messages`` followed by the assistant-turn opener (generation prompt)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"{where}: the record uses chat messages, but the tokenizer "
            f"({getattr(tokenizer, 'name_or_path', '?') or '?'}) has no chat template; "
            "give a plain 'prompt' string or use a tokenizer that has one"
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):  # defensive: some versions return a list for a batch of one
        text = text[0]
    return text


def prompt_context(record: dict, where: str) -> str | list[dict]:
    """The prompt part of a record: a string, or a list of messages."""
    has_prompt, has_messages = "prompt" in record, "messages" in record
    if has_prompt and has_messages:
        raise DataError(f"{where}: give either 'prompt' or 'messages', not both")
    if not (has_prompt or has_messages):
        raise DataError(
            f"{where}: missing field 'prompt' (or 'messages') "
            f"(fields present: {', '.join(sorted(record)) or 'none'})"
        )
    key = "prompt" if has_prompt else "messages"
    value = record[key]
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return check_messages(value, where, key)
    raise DataError(
        f"{where}: field {key!r} must be a string or a list of messages, "
        f"got {type(value).__name__} {value!r:.60}"
    )


def render_prompt(record: dict, tokenizer, where: str) -> str:
    """The prompt text of ``record`` (``{"prompt": str}`` or ``{"messages": [...]}``).

    With messages, every message is context: the template is applied over all of them with
    ``add_generation_prompt=True``. ``where`` (``file:line``) prefixes every error.
    """
    context = prompt_context(record, where)
    return context if isinstance(context, str) else apply_template(context, tokenizer, where)


def split_conversation(
    messages: list[dict], tokenizer, where: str, field: str = "messages"
) -> tuple[str, str]:
    """``(prompt_text, response_text)`` from messages that end with an assistant turn.

    The prompt is the template over all earlier turns with the generation prompt; the response is the
    last turn's content.
    """
    check_messages(messages, where, field)
    if messages[-1]["role"] != "assistant":
        raise DataError(
            f"{where}: the last message of {field!r} must be the assistant's response, "
            f"got role {messages[-1]['role']!r}"
        )
    if len(messages) < 2:
        raise DataError(
            f"{where}: {field!r} has only the assistant's response; it needs at least one "
            "earlier turn as the prompt"
        )
    return apply_template(messages[:-1], tokenizer, where), messages[-1]["content"]


def render_pair(record: dict, tokenizer, where: str) -> tuple[str, str]:
    """``(prompt_text, response_text)`` of an SFT record.

    ``{"prompt": str, "response": str}`` or ``{"messages": [..., {"role": "assistant", ...}]}``.
    """
    if "messages" in record and "response" not in record:
        if "prompt" in record:
            raise DataError(f"{where}: give either 'prompt' or 'messages', not both")
        return split_conversation(record["messages"], tokenizer, where)
    prompt = render_prompt(record, tokenizer, where)
    if "response" not in record:
        raise DataError(
            f"{where}: missing field 'response' (fields present: {', '.join(sorted(record))})"
        )
    response = record["response"]
    if not isinstance(response, str):
        raise DataError(
            f"{where}: field 'response' must be a string, got "
            f"{type(response).__name__} {response!r:.60}"
        )
    return prompt, response


def encode_prompt(text: str, tokenizer) -> list[int]:
    """Token ids of a prompt, with the tokenizer's usual special tokens (e.g. BOS) added once.

    A chat template usually writes the BOS token itself; adding it again would give two, so special
    tokens are added only when the text does not already start with the BOS string.
    """
    bos = getattr(tokenizer, "bos_token", None)
    add = not (bos and text.startswith(bos))
    return list(tokenizer(text, add_special_tokens=add)["input_ids"])


def encode_response(text: str, tokenizer) -> list[int]:
    """Token ids of a response followed by EOS (the token that ends the episode; docs/formulas.md,
    "The MDP of autoregressive generation")."""
    if tokenizer.eos_token_id is None:
        raise DataError(
            f"tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no EOS token; "
            "responses must end with one"
        )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
