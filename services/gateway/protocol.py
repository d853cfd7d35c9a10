"""HTTP request bodies (every dialect's, so that the route table in openapi.py needs no handler),
decoded strictly with msgspec, and their translation into the bus's GenerateRequest. A wrong type
or an unknown field is a 400 naming it."""
from __future__ import annotations

import json
from typing import Any

import msgspec

from radixflow.shared.errors import BadRequest
from radixflow.shared.messages import ChatMessage, ChatOptions, Constraint, ProgramNode, SamplingParams, TokenId
from radixflow.shared.validate import one_constraint


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class NativeSampling(_Body, kw_only=True):
    """SGLang's sampling_params (the subset radixflow serves)."""
    max_new_tokens: int = 128
    # None: the model's default (generation_config.json), else the API's (_sampled)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    sampling_seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    no_stop_trim: bool = False
    # sent by SGLang's frontend with every gen; only their defaults are served
    min_new_tokens: int = 0
    stop_regex: str | list[str] | None = None
    spaces_between_special_tokens: bool = True
    # structured output (SGLang's names; `choice` as in vLLM's guided_choice)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    choice: list[str] | None = None


class GenerateBody(_Body, kw_only=True):
    """SGLang's GenerateReqInput: one prompt, or a batch (a list of texts or of token-id lists;
    per-prompt lists of sampling_params / return_logprob / logprob_start_len / top_logprobs_num / rid)."""
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None                 # list[int] or list[list[int]] (msgspec has no such union)
    sampling_params: NativeSampling | list[NativeSampling] = msgspec.field(default_factory=NativeSampling)
    stream: bool = False
    rid: str | list[str] | None = None
    cache_salt: str | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1           # -1: no prompt logprobs (SGLang's default)
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False


class StreamOptions(_Body, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body, kw_only=True):
    name: str = ""
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(_Body, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class _OpenAIBase(_Body, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None     # None: the model's default, else the API's (_sampled)
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions accepted by vLLM and SGLang
    repetition_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    # structured output: OpenAI's response_format, and vLLM's guided_* extensions
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None


class CompletionBody(_OpenAIBase, kw_only=True):
    prompt: str | list[Any]                   # a text, token ids, or a batch of either
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Body, kw_only=True):
    type: str
    text: str | None = None


class FunctionCallBody(_Body, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"     # OpenAI: a JSON string


class ToolCallBody(_Body, kw_only=True):
    id: str | None = None
    type: str = "function"
    function: FunctionCallBody


class ChatMessageBody(_Body, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None     # a tool message: the call it answers (passed to the chat template)
    tool_calls: list[ToolCallBody] | None = None


class FunctionBody(_Body, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolBody(_Body, kw_only=True):
    type: str = "function"
    function: FunctionBody


class ChatBody(_OpenAIBase, kw_only=True):
    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: str | dict[str, Any] | None = None
    # what the chat template is given besides the messages (vLLM's and SGLang's names; chat_options)
    tools: list[ToolBody] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None



class TokenizeBody(_Body, kw_only=True):
    text: str | list[str] | None = None
    prompt: str | None = None                       # vLLM's name
    messages: list[ChatMessageBody] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolBody] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeBody(_Body, kw_only=True):
    tokens: list[int]
    model: str | None = None
    skip_special_tokens: bool = False


class AbortBody(_Body, kw_only=True):
    rid: str | list[str]


class ProgramBody(_Body, kw_only=True):
    nodes: list[ProgramNode]
    stream: bool = False
    id: str | None = None
    cache_salt: str | None = None
    timeout: float = 0.0               # seconds; the program's one deadline (0: the server's request timeout)


class FlushBody(_Body, kw_only=True):
    all: bool = False                 # admin: every tenant's cache


def decode_body(raw: bytes, typ: type) -> Any:
    if not raw.strip():
        raise BadRequest("the request body is empty; a JSON object is required")
    try:
        return msgspec.json.decode(raw, type=typ)
    except msgspec.ValidationError as e:
        raise BadRequest(f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None


def _stops(stop: str | list[str] | None) -> list[str]:
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


def _unsupported(cond: bool, what: str, param: str) -> None:
    if cond:
        raise BadRequest(f"{what} is not supported", param=param)


def logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias: token ids as JSON object keys (strings)."""
    out = {}
    for k, v in (raw or {}).items():
        try:
            out[int(k)] = float(v)
        except ValueError:
            raise BadRequest(f"logit_bias keys are token ids, got {k!r}", param="logit_bias") from None
    return out


# the API's defaults, for a field neither the request nor the model's generation_config.json sets
API_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def _sampled(body, defaults: dict[str, float]) -> dict:
    """temperature, top_p, top_k, min_p and repetition_penalty: the request's where it sets them,
    else the model's (generation_config.json, as vLLM and SGLang serve it), else the API's."""
    out = {}
    for k, api in API_DEFAULTS.items():
        v = getattr(body, k)
        out[k] = v if v is not None else type(api)(defaults.get(k, api))
    return out


def native_sampling(s: NativeSampling, logprobs: bool = False, top: int = 0,
                    defaults: dict[str, float] | None = None) -> SamplingParams:
    _unsupported(s.no_stop_trim, "no_stop_trim", "no_stop_trim")
    _unsupported(s.min_new_tokens != 0, "min_new_tokens other than 0", "min_new_tokens")
    _unsupported(bool(s.stop_regex), "stop_regex", "stop_regex")
    _unsupported(not s.spaces_between_special_tokens, "spaces_between_special_tokens: false",
                 "spaces_between_special_tokens")
    return SamplingParams(max_new_tokens=s.max_new_tokens, **_sampled(s, defaults or {}),
                          seed=s.seed if s.seed is not None else s.sampling_seed, stop=_stops(s.stop),
                          stop_token_ids=s.stop_token_ids or [], ignore_eos=s.ignore_eos,
                          skip_special_tokens=s.skip_special_tokens, presence_penalty=s.presence_penalty,
                          frequency_penalty=s.frequency_penalty,
                          logit_bias=logit_bias(s.logit_bias), logprobs=logprobs, top_logprobs=top)


def openai_sampling(b: _OpenAIBase, max_tokens: int | None, default_max: int, logprobs: bool = False,
                    top: int = 0, defaults: dict[str, float] | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=default_max if max_tokens is None else max_tokens,
                          **_sampled(b, defaults or {}), seed=b.seed, stop=_stops(b.stop),
                          stop_token_ids=b.stop_token_ids or [], ignore_eos=b.ignore_eos,
                          skip_special_tokens=b.skip_special_tokens, presence_penalty=b.presence_penalty,
                          frequency_penalty=b.frequency_penalty,
                          logit_bias=logit_bias(b.logit_bias), logprobs=logprobs, top_logprobs=top)


def _one(found: list[Constraint], param: str) -> Constraint | None:
    if len(found) > 1:
        raise BadRequest("give at most one structured-output constraint", param=param)
    return found[0] if found else None


def native_constraint(s: NativeSampling) -> Constraint | None:
    return one_constraint(s.json_schema, s.regex, s.ebnf, s.choice)


def openai_constraint(b: _OpenAIBase) -> Constraint | None:
    found = []
    rf = b.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(Constraint(kind="json_object"))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise BadRequest("response_format json_schema needs json_schema.schema", param="response_format")
            found.append(Constraint(kind="json_schema", spec=json.dumps(rf.json_schema.schema_)))
        else:
            raise BadRequest(f"response_format type {rf.type!r} is not one of text, json_object, json_schema",
                             param="response_format")
    if b.guided_json is not None:
        spec = b.guided_json if isinstance(b.guided_json, str) else json.dumps(b.guided_json)
        found.append(Constraint(kind="json_schema", spec=spec))
    if b.guided_regex is not None:
        found.append(Constraint(kind="regex", spec=b.guided_regex))
    if b.guided_grammar is not None:
        found.append(Constraint(kind="ebnf", spec=b.guided_grammar))
    if b.guided_choice is not None:
        found.append(Constraint(kind="choice", spec=json.dumps(b.guided_choice)))
    return _one(found, "response_format")


def completion_checks(b: CompletionBody) -> None:
    _unsupported(b.best_of not in (None, 1), "best_of", "best_of")
    _unsupported(b.suffix is not None, "suffix", "suffix")
    if b.logprobs is not None and not 0 <= b.logprobs <= 20:
        raise BadRequest(f"logprobs must be in [0, 20], got {b.logprobs}", param="logprobs")


_TOKEN_IDS = list[TokenId]


def token_ids(raw: Any, param: str, what: str) -> list[int]:
    """`raw` as token ids (ints >= 0, not bools), checked by msgspec in C: a long prompt's type
    checks in Python would cost several times as much. `what`: the message for a wrong type."""
    try:
        return msgspec.convert(raw, _TOKEN_IDS)
    except msgspec.ValidationError as e:
        if ">= 0" in str(e):
            raise BadRequest(f"{param} must be non-negative token ids", param=param) from None
        raise BadRequest(what, param=param) from None


def prompts(raw: str | list[Any]) -> list[str | list[int]]:
    """OpenAI's prompt forms: a text, a list of texts, token ids, or a list of token-id lists."""
    what = "prompt must be a string, a list of strings, token ids, or a list of token-id lists"
    if isinstance(raw, str):
        return [raw]
    if not raw:
        raise BadRequest("prompt is empty", param="prompt")
    if isinstance(raw[0], int):
        return [token_ids(raw, "prompt", what)]
    if all(isinstance(x, str) for x in raw):
        return list(raw)
    if all(isinstance(x, list) and x for x in raw):
        return [token_ids(x, "prompt", what) for x in raw]
    raise BadRequest(what, param="prompt")


def chat_messages(b: ChatBody) -> list[ChatMessage]:
    if b.top_logprobs is not None and not b.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    if not b.messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(b.messages):
        if m.role not in ("system", "user", "assistant", "tool", "developer"):
            raise BadRequest(f"messages[{i}].role {m.role!r} is not one of system, user, assistant, tool, developer",
                             param="messages")
        if m.content is None and m.role != "assistant":     # as OpenAI: only an assistant turn may omit it
            raise BadRequest(f"messages[{i}].content is required for role {m.role!r}", param="messages")
        if isinstance(m.content, list):
            parts = []
            for p in m.content:
                if p.type != "text" or p.text is None:
                    raise BadRequest(f"messages[{i}]: only text content parts are supported", param="messages")
                parts.append(p.text)
            content = "".join(parts)
        else:
            content = m.content or ""
        calls = None
        if m.tool_calls:
            if m.role != "assistant":
                raise BadRequest(f"messages[{i}]: only an assistant message has tool_calls", param="messages")
            calls = [_tool_call(c) for c in m.tool_calls]
        out.append(ChatMessage(role="system" if m.role == "developer" else m.role, content=content,
                               tool_call_id=m.tool_call_id, name=m.name, tool_calls=calls))
    return out


def _tool_call(c: ToolCallBody) -> dict[str, Any]:
    """An assistant's tool call as chat templates read it: arguments an object (OpenAI sends a JSON
    string; templates render `arguments | tojson`), as vLLM hands them over. Arguments that are not
    JSON stay a string."""
    args = c.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    call = {"type": c.type, "function": {"name": c.function.name, "arguments": args}}
    return call if c.id is None else {"id": c.id, **call}


# names the chat template is already given; chat_template_kwargs may not set them
_TEMPLATE_OWN = {"messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize", "documents"}


def chat_options(b: Any, tool_choice: Any = None) -> ChatOptions:
    """The template fields of a chat body (ChatBody's, or /tokenize's), checked. tool_choice: "auto" and "none" (the tools are
    rendered; the model's text is returned as it is, with no tool-call parser); a forced call
    ("required" or a named function) is refused, since nothing here would make the model call one."""
    if b.add_generation_prompt and b.continue_final_message:
        raise BadRequest("add_generation_prompt and continue_final_message cannot both be true "
                         "(send add_generation_prompt: false to continue the last message)", param="continue_final_message")
    if tool_choice not in (None, "auto", "none"):
        raise BadRequest("tool_choice may be \"auto\" or \"none\": a forced tool call is not supported", param="tool_choice")
    kwargs = dict(b.chat_template_kwargs or {})
    if clash := sorted(_TEMPLATE_OWN & set(kwargs)):
        raise BadRequest(f"chat_template_kwargs may not set {', '.join(clash)}", param="chat_template_kwargs")
    tools = None
    if b.tools is not None:
        for i, t in enumerate(b.tools):
            if t.type != "function":
                raise BadRequest(f"tools[{i}].type must be \"function\"", param="tools")
        tools = [{"type": "function", "function": {k: v for k, v in msgspec.structs.asdict(t.function).items()
                                                   if v is not None}} for t in b.tools]
    return ChatOptions(add_generation_prompt=b.add_generation_prompt, continue_final_message=b.continue_final_message,
                       tools=tools, template_kwargs=kwargs)
