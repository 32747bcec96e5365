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

Beyond that layout, SFT can train **every assistant turn** of a conversation
(:func:`conversation_tokens`): the whole conversation is rendered once and tokenised once, and a
bool mask marks the tokens of the chosen assistant turns. Which characters belong to an assistant
turn comes from the template's ``{% generation %}`` markers where it has them (transformers'
``return_assistant_tokens_mask``), else from rendering prefixes of the conversation:

* the turn starts where ``template(turns before it, add_generation_prompt=True)`` ends — the same
  text after which the policy starts writing in a rollout;
* it ends where ``template(turns up to and including it)`` ends, less trailing whitespace (the
  newline many templates write *between* turns is not something the model emits);
* both renderings must be prefixes of the whole conversation's rendering, or the row is refused
  (templates that rewrite earlier turns, e.g. dropping reasoning, cannot be split this way).

A token is trained when any of its characters lies in such a span (the rule transformers uses for
generation markers), so a BPE token that merges the last characters of the content with the start
of the end-of-turn text is trained — it is what the model has to emit there — and one that merges
the generation prompt with the first content characters is trained too. The character offsets come
from the fast tokenizer's ``offset_mapping`` over the whole text; nothing is re-tokenised per turn.
The first token of a row is never trained (nothing precedes it to predict it from).

Record shapes (TRL's dataset formats; docs/data.md has the table of shapes × commands):
``{"text"}`` language modelling, ``{"prompt"}`` prompt-only, ``{"prompt", "completion"}``
prompt–completion (``response`` is an alias of ``completion``), both as strings or both as message
lists, ``{"messages"}`` a conversation, and an optional ``tools`` list handed to the chat template.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proximal.data.jsonl import DataError

ROLES = ("system", "user", "assistant", "tool")

#: ``data.loss_on``: which tokens of an SFT row the loss covers (docs/data.md, "Which tokens are
#: trained").
LOSS_ON = ("all_assistant", "last_assistant", "completion_only", "all_tokens")

#: The fields naming a completion: TRL's ``completion`` and this project's first name, ``response``.
COMPLETION_KEYS = ("completion", "response")

#: What an SFT row may look like, for the message naming a row in another shape.
SFT_SHAPES = (
    '{"text": str}, {"prompt": str, "completion": str}, {"prompt": [messages], "completion": '
    '[messages]}, {"messages": [messages]} (optionally with "tools"; "response" is an alias of '
    '"completion")'
)

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def chat_template_text(value: str) -> str:
    """``model.chat_template`` as template text: the contents of the file it names, or the string itself.

    A value with no Jinja syntax (``{{`` or ``{%``) is taken as a path; a path that does not exist
    is an error naming it (a typo would otherwise become a template that prints its own name).
    """
    if "{{" in value or "{%" in value:
        return value
    p = Path(value).expanduser()
    if not p.is_file():
        raise DataError(
            f"model.chat_template = {value!r}: no such file, and not a template either (no '{{{{' "
            "or '{%'); give a Jinja template file or the template text"
        )
    return p.read_text(encoding="utf-8")


def set_chat_template(tokenizer, value: str | None) -> None:
    """Give ``tokenizer`` the chat template of ``model.chat_template`` (None: keep its own).

    The field replaces a template the tokenizer already has: a user who sets it wants that one. The
    tokenizer is saved with the trained model, so the template travels with the checkpoint.
    """
    if value:
        tokenizer.chat_template = chat_template_text(value)


#: A row's tool schemas computed from its record (``render_prompt``'s ``tools``): None or a list of
#: JSON-schema objects for the chat template; ValueError for a row it refuses.
RowTools = Callable[[dict], list[dict] | None]


def check_tools(record: dict, where: str) -> list[dict] | None:
    """The row's ``tools`` (a list of JSON-schema objects) or None."""
    tools = record.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(
            f"{where}: field 'tools' must be a list of objects (JSON schemas of functions), got "
            f"{type(tools).__name__} {tools!r:.60}"
        )
    return tools


#: A tool call as OpenAI and TRL write it, for the messages naming a malformed one.
TOOL_CALL_SHAPE = (
    '{"type": "function", "function": {"name": str, "arguments": object or JSON string}}'
)


def check_messages(value: Any, where: str, field: str = "messages") -> list[dict]:
    """``value`` as a non-empty list of ``{"role": str, "content": str}``; DataError naming ``where``
    otherwise. An assistant turn that calls tools, as OpenAI and TRL write it, has ``tool_calls``
    (:func:`check_tool_calls`) and may have ``content`` None or none at all. Returns the messages
    with each call's ``arguments`` as an object (a JSON string parsed), as chat templates take them;
    the list itself when nothing needed parsing."""
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: field {field!r} must be a non-empty list of messages, "
            f"got {type(value).__name__} {value!r:.60}"
        )
    out = value
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(
                f"{where}: {field}[{i}] must be an object with 'role' and 'content', "
                f"got {type(m).__name__} {m!r:.60}"
            )
        calls = m.get("tool_calls")
        for key in ("role", "content"):
            if key == "content" and calls is not None and m.get(key) is None:
                continue  # a turn that only calls tools: content null or absent
            if key not in m:
                raise DataError(f"{where}: {field}[{i}] is missing {key!r}")
            if not isinstance(m[key], str):
                raise DataError(
                    f"{where}: {field}[{i}].{key} must be a string, got "
                    f"{type(m[key]).__name__} {m[key]!r:.60}"
                    + (" (null only beside tool_calls)" if m[key] is None else "")
                )
        if m["role"] not in ROLES:
            raise DataError(
                f"{where}: {field}[{i}].role is {m['role']!r}; expected one of {', '.join(ROLES)}"
            )
        if calls is not None:
            if m["role"] != "assistant":
                raise DataError(
                    f"{where}: {field}[{i}] has tool_calls but role {m['role']!r}; only an "
                    "assistant turn calls tools"
                )
            checked = check_tool_calls(calls, where, f"{field}[{i}].tool_calls")
            if checked is not calls:
                if out is value:
                    out = list(value)
                out[i] = {**m, "tool_calls": checked}
    return out


def check_tool_calls(calls: Any, where: str, field: str) -> list[dict]:
    """An assistant turn's ``tool_calls`` in OpenAI's and TRL's form, ``[{"type": "function",
    "function": {"name": str, "arguments": {...}}}]`` (``type`` may be left out; other keys such as
    ``id`` are kept). ``arguments`` may be an object or, as OpenAI's API writes it, a string holding
    one: the result has it as the object (what transformers' chat templates take; the list itself
    when every one already was). DataError naming ``where`` and the call otherwise."""
    if not isinstance(calls, list) or not calls:
        raise DataError(
            f"{where}: {field} must be a non-empty list of calls {TOOL_CALL_SHAPE}, got "
            f"{type(calls).__name__} {calls!r:.60}"
        )
    out = calls
    for j, call in enumerate(calls):
        at = f"{field}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise DataError(f"{where}: {at} must be {TOOL_CALL_SHAPE}, got {call!r:.80}")
        if call.get("type", "function") != "function":
            raise DataError(f"{where}: {at}.type is {call['type']!r}; expected 'function'")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise DataError(
                f"{where}: {at}.function.name must be a non-empty string, got "
                f"{type(name).__name__} {name!r:.60}"
            )
        if "arguments" not in fn:
            raise DataError(f"{where}: {at}.function (the call of {name!r}) is missing 'arguments'")
        arguments = fn["arguments"]
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{where}: {at}.function.arguments (the call of {name!r}) is a string but not "
                    f"valid JSON ({e.msg} at column {e.colno}): {fn['arguments']!r:.60}"
                ) from None
        if not isinstance(arguments, dict):
            raise DataError(
                f"{where}: {at}.function.arguments (the call of {name!r}) must be an object (or a "
                f"JSON string of one), got {type(arguments).__name__} {arguments!r:.60}"
            )
        if arguments is not fn["arguments"]:
            if out is calls:
                out = list(calls)
            out[j] = {**call, "function": {**fn, "arguments": arguments}}
    return out


def content_of(message: dict) -> str:
    """A message's text: its content, "" for a turn that only calls tools (content null or absent)."""
    return message.get("content") or ""


def apply_template(
    messages: list[dict],
    tokenizer,
    where: str,
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    check_calls: bool = False,
) -> str:
    """The chat template over ``messages`` (and ``tools``), by default followed by the assistant-turn
    opener (generation prompt). An assistant turn's ``tool_calls`` go to the template as they are
    (checked by :func:`check_messages`: arguments as objects). ``check_calls`` (the data loaders'
    renderings of a row): a template that leaves them out of its text is refused (DataError), rather
    than training on or answering a conversation whose calls vanished."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"{where}: the record uses chat messages, but the tokenizer "
            f"({getattr(tokenizer, 'name_or_path', '?') or '?'}) has no chat template; "
            "give a plain 'prompt' string, use a tokenizer that has one, or set model.chat_template "
            "(a template file or the template text)"
        )
    kwargs = {"tools": tools} if tools else {}  # no 'tools' key: the template sees it undefined
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    if not isinstance(text, str):  # defensive: some versions return a list for a batch of one
        text = text[0]
    calls = [i for i, m in enumerate(messages) if m.get("tool_calls")] if check_calls else []
    if calls:
        _check_calls_rendered(
            messages, calls, text, tokenizer, where, add_generation_prompt, kwargs
        )
    return text


def _check_calls_rendered(
    messages: list[dict], calls: list[int], text: str, tokenizer, where: str, gen: bool, kwargs
) -> None:
    """DataError unless the template's text changes when the ``calls`` turns lose their tool_calls
    (a template that ignores them would drop the calls without a word)."""
    bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
    try:
        without = tokenizer.apply_chat_template(
            bare, tokenize=False, add_generation_prompt=gen, **kwargs
        )
    except Exception:  # noqa: BLE001 - a template that needs the calls renders them
        return
    if not isinstance(without, str):
        without = without[0]
    if without == text:
        i = calls[0]
        name = messages[i]["tool_calls"][0]["function"]["name"]
        raise DataError(
            f"{where}: turn {i} calls the tool {name!r}, but the chat template of the tokenizer "
            f"({getattr(tokenizer, 'name_or_path', '?') or '?'}) does not render tool_calls; give a "
            "template that does (model.chat_template)"
        )


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


def render_prompt(record: dict, tokenizer, where: str, tools: RowTools | None = None) -> str:
    """The prompt text of ``record`` (``{"prompt": str}`` or ``{"messages": [...]}``).

    With messages, every message is context: the template is applied over all of them with
    ``add_generation_prompt=True``, and with the row's ``tools`` column as the template's
    ``tools=`` (JSON schemas). ``tools``, where given, replaces that column's reading: the schemas
    the row is offered, computed from the record (an agent run's registered tools, which the column
    may name; ValueError for a column it refuses), asked of every row, a text prompt's too, so a
    bad column is found where it is. ``where`` (``file:line``) prefixes every error.
    """
    context = prompt_context(record, where)
    schemas = None
    if tools is not None:
        try:
            schemas = tools(record)
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
    if isinstance(context, str):
        return context  # a text prompt's tools column is data (a single-turn run checks nothing)
    if tools is None:
        schemas = check_tools(record, where)
    return apply_template(context, tokenizer, where, tools=schemas, check_calls=True)


def split_conversation(
    messages: list[dict],
    tokenizer,
    where: str,
    field: str = "messages",
    tools: list[dict] | None = None,
) -> tuple[str, str]:
    """``(prompt_text, response_text)`` from messages that end with an assistant turn.

    The prompt is the template over all earlier turns with the generation prompt; the response is the
    last turn's content.
    """
    messages = check_messages(messages, where, field)
    check_ends_with_reply(messages, where, f"the last message of {field!r}", repr(field))
    check_reply_text(messages[-1], where, f"the last message of {field!r}")
    prompt = apply_template(messages[:-1], tokenizer, where, tools=tools, check_calls=True)
    return prompt, messages[-1]["content"]


def check_reply_text(message: dict, where: str, what: str) -> None:
    """DataError unless ``message`` (a response taken as its content alone: the prompt/response
    layout) has text content: a turn that only calls tools has none to train or compare."""
    if message.get("content") is None:
        raise DataError(
            f"{where}: {what} only calls tools (content null), and this layout takes the response "
            "as the last turn's content; end with a text reply, or for SFT set "
            "data.loss_on: all_assistant (the template renders the calls)"
        )


def check_ends_with_reply(messages: list[dict], where: str, last: str, whole: str) -> None:
    """DataError naming ``where`` unless ``messages`` end with the assistant's reply to at least one
    earlier turn (``last``/``whole`` name the last message and the list in the message)."""
    if messages[-1]["role"] != "assistant":
        raise DataError(
            f"{where}: {last} must be the assistant's response, got role {messages[-1]['role']!r}"
        )
    if len(messages) < 2:
        raise DataError(
            f"{where}: {whole} has only the assistant's response; it needs at least one "
            "earlier turn as the prompt"
        )


def completion_field(record: dict, where: str) -> str | None:
    """Which of ``completion`` / ``response`` the row uses (None: neither); both is an error."""
    present = [k for k in COMPLETION_KEYS if k in record]
    if len(present) > 1:
        raise DataError(f"{where}: give either 'completion' or 'response' (an alias), not both")
    return present[0] if present else None


def sft_parts(record: dict, where: str) -> tuple[str, Any, Any, int]:
    """The shape of an SFT row: ``(kind, a, b, completion_start)``.

    * ``("text", text, None, 0)`` — language modelling;
    * ``("pair", prompt, completion, 0)`` — a prompt (string, or messages rendered with the generation
      prompt) and a completion string: today's prompt/response layout;
    * ``("conversation", messages, tools, k)`` — one message list (``messages``, or a conversational
      ``prompt`` + ``completion``) whose turns from index ``k`` on are the completion (for a plain
      ``messages`` row, ``k`` is its last turn).

    Raises DataError naming ``where``, what was found and what is accepted.
    """
    ckey = completion_field(record, where)
    if "text" in record:
        others = [k for k in ("prompt", "messages", *COMPLETION_KEYS) if k in record]
        if others:
            raise DataError(
                f"{where}: a 'text' row (language modelling) has no {others[0]!r}; give either "
                f"'text' or a prompt/completion or messages row. Accepted: {SFT_SHAPES}"
            )
        text = record["text"]
        if not isinstance(text, str):
            raise DataError(
                f"{where}: field 'text' must be a string, got {type(text).__name__} {text!r:.60}"
            )
        return "text", text, None, 0
    tools = check_tools(record, where)
    if ckey is None:
        if "messages" in record:
            if "prompt" in record:
                raise DataError(f"{where}: give either 'prompt' or 'messages', not both")
            messages = check_messages(record["messages"], where)
            return "conversation", messages, tools, len(messages) - 1
        if "prompt" in record:
            raise DataError(
                f"{where}: missing field 'response' (or 'completion') (fields present: "
                f"{', '.join(sorted(record))}); a prompt alone is a prompt-only row, for ppo and grpo. "
                f"An SFT row is one of: {SFT_SHAPES}"
            )
        raise DataError(
            f"{where}: not an SFT row (fields present: {', '.join(sorted(record)) or 'none'}); "
            f"accepted: {SFT_SHAPES}"
        )
    completion = record[ckey]
    if isinstance(completion, list):
        context = prompt_context(record, where)
        if isinstance(context, str):
            raise DataError(
                f"{where}: {ckey!r} is a message list but the prompt is a string; give both as "
                "strings or both as message lists"
            )
        completion = check_messages(completion, where, ckey)
        return "conversation", context + completion, tools, len(context)
    if not isinstance(completion, str):
        raise DataError(
            f"{where}: field {ckey!r} must be a string, got "
            f"{type(completion).__name__} {completion!r:.60} (or a list of messages)"
        )
    return "pair", prompt_context(record, where), completion, 0


def render_pair(record: dict, tokenizer, where: str) -> tuple[str, str]:
    """``(prompt_text, response_text)`` of an SFT record: today's layout, ``data.loss_on: last_assistant``.

    ``{"prompt": str, "completion": str}`` (or ``"response"``), messages with a completion string, or
    a conversation (``messages``, or conversational ``prompt`` + ``completion``) that ends with an
    assistant turn: the prompt is the template over every earlier turn with the generation prompt.
    """
    kind, a, b, _ = sft_parts(record, where)
    if kind == "text":
        raise DataError(
            f"{where}: a 'text' row has no prompt and response to split; with text rows set "
            "data.loss_on: all_tokens (or all_assistant, which trains a text row's every token)"
        )
    if kind == "conversation":
        return split_conversation(a, tokenizer, where, tools=b)
    tools = check_tools(record, where)
    prompt = (
        a
        if isinstance(a, str)
        else apply_template(a, tokenizer, where, tools=tools, check_calls=True)
    )
    return prompt, b


def has_generation_markers(tokenizer) -> bool:
    """Whether the tokenizer's chat template marks assistant text with ``{% generation %}``."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(_GENERATION_MARKER.search(template))


def _add_bos(text: str, tokenizer) -> bool:
    bos = getattr(tokenizer, "bos_token", None)
    return not (bos and text.startswith(bos))


def turn_spans(
    messages: list[dict],
    turns: list[int],
    tokenizer,
    where: str,
    tools: list[dict] | None,
    *,
    whole: bool = False,
) -> tuple[str, list[tuple[int, int]]]:
    """The whole conversation's text and the character span ``[start, end)`` of each turn in ``turns``.

    A turn starts where the template over the turns before it, with the generation prompt, ends,
    and ends where the template over the turns up to it ends, less trailing whitespace (see the module
    docstring). ``whole``: the turn's whole rendering instead (from the end of the turns before it,
    without the generation prompt, to the end of the turn, whitespace included) — the region in which
    a template's ``{% generation %}`` marks are looked for. Raises DataError when a prefix's rendering
    is not a prefix of the whole.
    """
    full = apply_template(
        messages, tokenizer, where, tools=tools, add_generation_prompt=False, check_calls=True
    )
    spans = []
    for i in turns:
        opened = (
            apply_template(
                messages[:i], tokenizer, where, tools=tools, add_generation_prompt=not whole
            )
            if i
            else ""
        )
        closed = apply_template(
            messages[: i + 1], tokenizer, where, tools=tools, add_generation_prompt=False
        )
        closed = closed if whole else closed.rstrip()
        for name, text in (("the turns before it", opened), ("the turns up to it", closed)):
            if not full.startswith(text):
                raise DataError(
                    f"{where}: turn {i} ({messages[i]['role']}): the chat template renders {name} "
                    "differently from the same turns inside the whole conversation, so the turn's "
                    "tokens cannot be located; give the template {% generation %} markers or set "
                    "data.loss_on: last_assistant"
                )
        spans.append((len(opened), max(len(opened), len(closed))))
    return full, spans


def overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """True for each token whose characters ``[s, e)`` overlap one of ``spans`` (as transformers'
    ``return_assistant_tokens_mask`` does). A special token added by the tokenizer has ``(0, 0)``
    and overlaps nothing."""
    return [any(s < b and e > a for a, b in spans) for s, e in offsets]


def conversation_tokens(
    messages: list[dict],
    tokenizer,
    where: str,
    *,
    turns: list[int] | None,
    tools: list[dict] | None = None,
) -> tuple[list[int], list[bool]]:
    """Token ids of the whole conversation and the mask of the tokens to train.

    ``turns``: indices of the assistant turns to train; None = every token. The text is rendered once
    (no generation prompt) and tokenised once, with the tokenizer's BOS added unless the template
    writes it. With ``{% generation %}`` markers, the marked tokens of the chosen turns are trained
    (all of them when ``turns`` lists every assistant turn; else those inside the chosen turns'
    whole renderings); without, the prefix spans of :func:`turn_spans`. The first token is never
    trained.

    Returns ``(ids, mask)``, two lists of length T.
    """
    markers = turns is not None and has_generation_markers(tokenizer)
    every_assistant = turns == [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if turns is None or (markers and every_assistant):
        full = apply_template(
            messages, tokenizer, where, tools=tools, add_generation_prompt=False, check_calls=True
        )
        spans = [(0, len(full))]
    else:
        full, spans = turn_spans(messages, turns, tokenizer, where, tools, whole=markers)
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"{where}: training on assistant turns needs a fast tokenizer (character offsets); "
            f"{type(tokenizer).__name__} is not one; set data.loss_on: last_assistant"
        )
    enc = tokenizer(full, add_special_tokens=_add_bos(full, tokenizer), return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    mask = overlapping(offsets, spans)
    if markers:
        kwargs = {"tools": tools} if tools else {}
        marked = tokenizer.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            tokenizer_kwargs={"return_offsets_mapping": True},
            **kwargs,
        )
        # The same text; the marked tokens, matched to ours by their character offsets (ours may
        # start with a BOS the template did not write).
        by_offset = {
            tuple(o): bool(m)
            for o, m in zip(marked["offset_mapping"], marked["assistant_masks"])
            if o[1] > o[0]
        }
        mask = [m and by_offset.get(o, False) for m, o in zip(mask, offsets)]
    if mask:
        mask[0] = False  # nothing precedes the first token to predict it from
    return ids, mask


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
