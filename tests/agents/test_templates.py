"""Chat templates checked at start (fault 5): one that raises on a tool message, drops it, or ends
no assistant turn with EOS stops the run before anything trains, in one line suggesting
model.chat_template; the built-in tiny templates and a Qwen2-style one pass."""

from __future__ import annotations

import pytest
from agent_support import TOOLS_TEMPLATE
from ppo_support import ALPHABET

from proximal.agents.env import AgentError
from proximal.agents.trajectory import check_chat_template, observation_ids
from proximal.models.tiny import build_char_tokenizer
from proximal.tasks.calculator import build_tokenizer as calculator_tokenizer

FIXTURE = "tests/fixtures/data/chat_template.jinja"

# Qwen2.5-Instruct's template as it handles tools (its system prompt shortened): a tool call is
# written inside the assistant turn, consecutive tool results go into one user turn as
# <tool_response> blocks, every turn ends with <|im_end|> — the instruct model's EOS.
QWEN2 = """
{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system") or
          (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Each messages' content as it is (no roles), an assistant's followed by EOS — varied below.
ASSISTANT_EOS = "{% if m['role'] == 'assistant' %}{{ m['content'] ~ eos_token }}"
RAISES = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] ~ eos_token }}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)
DROPS_TOOLS = (
    "{% for m in messages %}" + ASSISTANT_EOS + "{% elif m['role'] == 'user' %}{{ m['content'] }}"
    "{% endif %}{% endfor %}"
)
NO_EOS = "{% for m in messages %}{{ m['content'] ~ ' ' }}{% endfor %}"


def char_tokenizer(template: str | None, eos: str | None = None):
    tok = build_char_tokenizer(list(ALPHABET), chat_template=template)
    if eos is not None:
        tok.add_special_tokens({"eos_token": eos})
    return tok


def test_builtin_and_qwen2_templates_pass():
    with open(FIXTURE) as f:
        fixture = f.read()
    for tools in (True, False):
        check_chat_template(char_tokenizer(fixture), tools)
        check_chat_template(char_tokenizer(TOOLS_TEMPLATE), tools)
        check_chat_template(char_tokenizer(QWEN2, eos="<|im_end|>"), tools)
    check_chat_template(calculator_tokenizer(), True)
    check_chat_template(char_tokenizer(None), True)  # no template: observations as text
    # and the Qwen2 observation is what its template writes between the turns (the tiny
    # alphabet lacks most of its characters: compared as ids)
    tok = char_tokenizer(QWEN2, eos="<|im_end|>")
    ids = observation_ids(tok, [{"role": "tool", "name": "f", "content": "12"}])
    between = "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert ids == tok(between, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (
            RAISES,
            "the chat template raises on a tool message after an assistant turn (TemplateError: "
            "Conversation roles must alternate user/assistant); ",
        ),
        (
            DROPS_TOOLS,
            "the chat template drops tool messages: a tool result's text does not appear when it "
            "is rendered after an assistant turn, so the policy would never read one; ",
        ),
        (NO_EOS, "the chat template does not end an assistant turn with the EOS token '<eos>'"),
    ],
)
def test_a_template_that_cannot_carry_tools_is_one_line(template, message):
    with pytest.raises(AgentError) as e:
        check_chat_template(char_tokenizer(template), True)
    text = str(e.value)
    assert text.startswith(message) and "\n" not in text
    assert text.endswith("set model.chat_template to a template that supports multi-turn tool use")
