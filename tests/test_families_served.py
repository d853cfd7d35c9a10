"""Each architecture users bring (Llama, Qwen2, Mistral, Qwen3-MoE) served through the whole stack with
its checkpoint's own chat template: the prompt ids equal transformers' apply_chat_template (tools, tool
calls and results, generation prompt or an open last turn), an agent's fan-out over one long preamble
reuses the preamble from the cache (its prefix hit rate), and greedy outputs with the cache on equal
those with it off."""
from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from . import stacks

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-moe"]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PREAMBLE = ("You are the planner of a travel agency. " + " ".join(
    f"Rule {i}: check the {w} before you answer, and say which source you used." for i, w in
    enumerate(["calendar", "weather", "prices", "timetable", "visa rules", "holidays", "museums", "hotels",
               "trains", "ferries", "flights", "markets", "festivals", "parks", "beaches", "trails"])))
TASKS = ["Plan a day in Paris.", "Plan a day in Rome.", "Plan a day in Oslo.", "Plan a day in Lisbon.",
         "Plan a day in Vienna.", "Plan a day in Porto."]


def _conversations() -> list[tuple[list[dict], dict]]:
    """(messages, template fields) as a client sends them, OpenAI's way (arguments a JSON string)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return [
        ([{"role": "user", "content": "Hello there"}], {}),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What can you do?"}], {}),
        ([{"role": "user", "content": "Weather in Paris?"}], {"tools": TOOLS}),
        ([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": None, "tool_calls": [call]},
          {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}], {"tools": TOOLS}),
        ([{"role": "user", "content": "Say a word"}, {"role": "assistant", "content": "Sure: apple"}],
         {"add_generation_prompt": False, "continue_final_message": True}),
    ]


def _hf_ids(tok, messages: list[dict], fields: dict) -> list[int]:
    """transformers' own rendering: what a client of the checkpoint gets with apply_chat_template."""
    import json
    msgs = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if "tool_calls" in m:      # templates read arguments as an object
            m["tool_calls"] = [c | {"function": c["function"] | {"arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        msgs.append(m)
    return list(tok.apply_chat_template(msgs, tokenize=True, return_dict=False,
                                        add_generation_prompt=fields.get("add_generation_prompt", True),
                                        continue_final_message=fields.get("continue_final_message", False),
                                        tools=fields.get("tools")))


async def _chat(st, messages: list[dict], **fields) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0} | fields
    async with st.http.post(st.base + "/v1/chat/completions", json=body) as r:
        out = await r.json()
        assert r.status == 200, out
        return out


async def _agent(st) -> list[dict]:
    """One request with the preamble first (it computes it), then the fan-out together."""
    def msgs(task):
        return [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": task}]
    first = await _chat(st, msgs(TASKS[0]), tools=TOOLS)
    rest = await asyncio.gather(*(_chat(st, msgs(t), tools=TOOLS) for t in TASKS[1:]))
    return [first, *rest]


@pytest.mark.parametrize("preset", FAMILIES)
async def test_an_architecture_served_with_its_chat_template_and_its_cache(preset, models):
    tok = AutoTokenizer.from_pretrained(models[preset])
    st = await stacks.start(models[preset])
    try:
        for messages, fields in _conversations():
            async with st.http.post(st.base + "/tokenize", json={"messages": messages} | fields) as r:
                got = await r.json()
                assert r.status == 200, got
            assert got["tokens"] == _hf_ids(tok, messages, fields), (preset, messages)
            if fields.get("continue_final_message"):
                continue
            out = await _chat(st, messages, **fields)
            assert out["usage"]["prompt_tokens"] == len(got["tokens"])
        on = await _agent(st)
    finally:
        await stacks.stop(st)
    off_st = await stacks.start(models[preset], ex_disable_radix_cache=True)
    try:
        off = await _agent(off_st)
    finally:
        await stacks.stop(off_st)

    assert [c["choices"][0]["message"]["content"] for c in on] == [c["choices"][0]["message"]["content"] for c in off]
    assert all(c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for c in off)
    # every fan-out request finds the rendered preamble (and the tools) in the cache, whole pages of it
    shared = 0
    ids = [_hf_ids(tok, [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": t}], {"tools": TOOLS})
           for t in TASKS]
    while all(len(x) > shared and x[shared] == ids[0][shared] for x in ids):
        shared += 1
    assert shared > 150, shared
    cached = [c["usage"]["prompt_tokens_details"]["cached_tokens"] for c in on[1:]]
    assert all(c >= shared - 16 for c in cached), (shared, cached)          # page size 16
    prompt = sum(c["usage"]["prompt_tokens"] for c in on)
    assert sum(cached) / prompt >= 0.75 * (len(TASKS) - 1) * shared / prompt


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral"])
async def test_template_fields_a_request_cannot_have_are_refused(preset, models):
    st = await stacks.start(models[preset])
    try:
        user = [{"role": "user", "content": "hi"}]
        for fields, param in [({"tool_choice": "required", "tools": TOOLS}, "tool_choice"),
                              ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                              ({"continue_final_message": True}, "continue_final_message"),
                              ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools")]:
            body = {"model": "m", "messages": user, "max_tokens": 2} | fields
            async with st.http.post(st.base + "/v1/chat/completions", json=body) as r:
                out = await r.json()
                assert r.status == 400 and out["error"]["param"] == param, out
        # a template that raises (Mistral's takes no assistant turn first) is the caller's error
        async with st.http.post(st.base + "/v1/chat/completions", json={
                "model": "m", "max_tokens": 2, "messages": [{"role": "system", "content": "s"},
                                                            {"role": "system", "content": "t"}]}) as r:
            out = await r.json()
            assert r.status == (400 if preset == "tiny-mistral" else 200), out
    finally:
        await stacks.stop(st)
