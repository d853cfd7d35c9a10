"""The chat formats of the families the tiny presets stand for: each a chat template in the family's
shape (its turn markers, where the system prompt and the tools go, how a tool call and its result are
written, whether a generation prompt exists) and the special tokens it needs, added after the shipped
8k BPE vocabulary as the real checkpoints add theirs after their own.

    chatml    Qwen3's turns (<|im_start|>role ... <|im_end|>), one line per message; no tools
    qwen2.5   ChatML with Qwen2.5's default system prompt, tools in the system turn inside <tools>, calls
              in <tool_call> (added tokens, not special), results as <tool_response> in a user turn
    llama3    Llama 3.1's header turns (<|start_header_id|>role<|end_header_id|>, <|eot_id|>), the
              knowledge-date system block, tools in the first user turn, calls as one JSON object,
              results in an ipython turn
    mistral   Mistral v0.3's [INST] ... [/INST], the system prompt folded into the last user turn, tools
              as [AVAILABLE_TOOLS] before it, calls after [TOOL_CALLS], results in [TOOL_RESULTS]; no
              generation prompt (the model answers after [/INST])

The templates are written here for these checkpoints (they are not the vendors' files); a test holds
radixflow's rendering of each to transformers' apply_chat_template.
"""
from __future__ import annotations

from dataclasses import dataclass

# One line per message so that a prompt's token ids are a pure concatenation of per-message pieces,
# which is what makes multi-turn prefixes shareable in the radix cache. Content given as OpenAI-style
# parts is flattened to its text parts.
CHATML = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

QWEN25 = """\
{%- set default_system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set messages = messages[1:] %}
{%- else %}{%- set system = default_system %}{%- endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
    {{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
        '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
        '<args-json-object>}\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls is defined %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": '
                + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA3 = """\
{{- bos_token }}
{%- if date_string is not defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content | trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' + system + '<|eot_id|>' }}
{%- if tools %}
    {%- if not messages or messages[0].role != 'user' %}
        {{- raise_exception('tools go in the first user message, and there is none') }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
    {{- 'Given the following functions, please respond with a JSON for a function call with its proper '
        'arguments that best answers the given prompt.\\n\\nRespond in the format {"name": function name, '
        '"parameters": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}
    {%- for tool in tools %}{{- (tool | tojson(indent=4)) + '\\n\\n' }}{%- endfor %}
    {{- messages[0].content | trim }}{{- '<|eot_id|>' }}
    {%- set messages = messages[1:] %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls is defined %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + call.name + '", "parameters": '
            + (call.arguments | tojson) + '}<|eot_id|>' }}
    {%- elif message.role in ('tool', 'ipython') %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + (message.content | trim)
            + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

MISTRAL = """\
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set messages = messages[1:] %}
{%- endif %}
{%- set users = messages | selectattr('role', 'equalto', 'user') | list %}
{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if tools and message == users[-1] %}
            {{- '[AVAILABLE_TOOLS] [' }}
            {%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}
            {{- '][/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {%- if system is defined and message == users[-1] %}
            {{- '[INST] ' + system + '\\n\\n' + message.content + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message.content + '[/INST]' }}
        {%- endif %}
    {%- elif message.role == 'assistant' and message.tool_calls is defined %}
        {{- '[TOOL_CALLS] [' }}
        {%- for call in message.tool_calls %}
            {{- {'name': call.function.name, 'arguments': call.function.arguments, 'id': call.id | default('')}
                | tojson }}
            {%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']' + eos_token }}
    {%- elif message.role == 'assistant' %}
        {{- ' ' + (message.content | trim) + eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS] {"content": ' + (message.content | tojson) + ', "call_id": "'
            + (message.tool_call_id or '') + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('after an optional first system message, only user, assistant and tool roles') }}
    {%- endif %}
{%- endfor %}
"""


@dataclass(frozen=True)
class ChatFormat:
    template: str
    added: tuple[tuple[str, bool], ...] = ()   # (text, special) after the BPE vocabulary, in id order
    bos: str | None = None                     # tokenizer_config's bos_token (the template writes it)
    eos: str = "<|im_end|>"                    # tokenizer_config's eos_token
    stops: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")   # generation_config's eos_token_id


FORMATS: dict[str, ChatFormat] = {
    "chatml": ChatFormat(CHATML),
    "qwen2.5": ChatFormat(QWEN25, added=(("<tool_call>", False), ("</tool_call>", False))),
    "llama3": ChatFormat(
        LLAMA3, added=tuple((t, True) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                                 "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")),
        bos="<|begin_of_text|>", eos="<|eot_id|>", stops=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")),
    "mistral": ChatFormat(
        MISTRAL, added=tuple((t, True) for t in ("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                                                 "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
                                                 "[/TOOL_RESULTS]")),
        bos="<s>", eos="</s>", stops=("</s>",)),
}
