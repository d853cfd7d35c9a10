"""The official `openai` package against a live server: chat and completions, streaming and not,
n, stop, logprobs, penalties and logit_bias, response_format, cached-token usage, and the error
cases with their status and OpenAI's error shape."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from .stacks import start, stop

PRE = "You are a meticulous assistant with these tools: search, calculator, calendar. " * 20
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}


@pytest.fixture(scope="module")
async def server(models):
    st = await start(models["tiny-hybrid"])
    st.client = openai.AsyncOpenAI(base_url=st.base + "/v1", api_key="none", timeout=120, max_retries=0)
    st.model = (await st.client.models.list()).data[0].id
    yield st
    await st.client.close()
    await stop(st)


def msgs(user: str = "Plan my day.") -> list[dict]:
    return [{"role": "system", "content": PRE}, {"role": "user", "content": user}]


async def test_chat_and_completion_plain(server):
    c, m = server.client, server.model
    r = await c.chat.completions.create(model=m, messages=msgs(), max_tokens=5, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 5
    r2 = await c.completions.create(model=m, prompt="The sky is", max_tokens=4, temperature=0)
    assert r2.object == "text_completion" and r2.usage.completion_tokens == len(r2.choices) * 4 \
        or r2.choices[0].finish_reason == "stop"


async def test_streaming_matches_non_streaming(server):
    c, m = server.client, server.model
    full = await c.chat.completions.create(model=m, messages=msgs(), max_tokens=8, temperature=0)
    stream = await c.chat.completions.create(model=m, messages=msgs(), max_tokens=8, temperature=0, stream=True,
                                             stream_options={"include_usage": True})
    text, usage, reasons = "", None, []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            reasons.append(ch.finish_reason)
    assert text == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert reasons[-1] == full.choices[0].finish_reason
    cs = await c.completions.create(model=m, prompt="Once upon", max_tokens=6, temperature=0, stream=True,
                                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = [ch async for ch in cs]
    parts = [ch.choices[0].text for ch in chunks if ch.choices]
    running = [ch.usage.completion_tokens for ch in chunks]        # usage on every chunk, growing
    assert all(ch.usage is not None for ch in chunks) and running == sorted(running) and running[-1] == 6
    ref = await c.completions.create(model=m, prompt="Once upon", max_tokens=6, temperature=0)
    assert "".join(parts) == ref.choices[0].text


async def test_n_siblings_share_the_prefill(server):
    c, m = server.client, server.model
    r = await c.chat.completions.create(model=m, messages=msgs("n please"), max_tokens=6, n=3, temperature=1.0, seed=3)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == sum(1 for _ in r.choices) * 6 or any(
        ch.finish_reason == "stop" for ch in r.choices)
    again = await c.chat.completions.create(model=m, messages=msgs("n please"), max_tokens=6, n=3, temperature=1.0, seed=3)
    assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in r.choices]   # seeded
    assert len({ch.message.content for ch in r.choices}) > 1                                        # distinct seeds
    # n with streaming: every index gets its own deltas and its finish reason
    stream = await c.completions.create(model=m, prompt="Count:", max_tokens=4, n=2, temperature=1.0, seed=1, stream=True)
    seen: dict[int, str | None] = {}
    async for chunk in stream:
        for ch in chunk.choices:
            seen[ch.index] = ch.finish_reason or seen.get(ch.index)
    assert set(seen) == {0, 1} and all(seen.values())


async def _prefill_computed(server) -> float:
    async with server.http.get(server.base + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("radixflow_prefill_tokens_computed_total{"))


async def test_n_prefills_the_prompt_once(server):
    c, m = server.client, server.model
    before = await _prefill_computed(server)
    r = await c.chat.completions.create(model=m, messages=msgs("once, n times " * 30), max_tokens=2, n=4,
                                        temperature=1.0)
    computed = await _prefill_computed(server) - before
    # the prompt once (less its cached system part), then each child only its last partial page
    assert computed <= r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens + 4 * 16, computed
    assert computed < 2 * r.usage.prompt_tokens


async def test_stop_strings(server):
    c, m = server.client, server.model
    ref = await c.completions.create(model=m, prompt="Stop test", max_tokens=12, temperature=0)
    text = ref.choices[0].text
    i = next(i for i in range(1, len(text) - 1) if text[i:i + 2].strip())      # a stop string inside the text
    stop_at = text[i:i + 2]
    r = await c.completions.create(model=m, prompt="Stop test", max_tokens=12, temperature=0, stop=[stop_at, "@@@"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop_at)]


async def test_logprobs_chat_and_completions(server):
    c, m = server.client, server.model
    r = await c.chat.completions.create(model=m, messages=msgs(), max_tokens=4, temperature=0, logprobs=True,
                                        top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert abs(t.logprob - t.top_logprobs[0].logprob) < 1e-5          # greedy: the top token
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
    assert "".join(t.token for t in content) == r.choices[0].message.content
    cp = await c.completions.create(model=m, prompt="The sea is", max_tokens=3, temperature=0, logprobs=2, echo=True)
    lp = cp.choices[0].logprobs
    assert cp.choices[0].text.startswith("The sea is")
    assert len(lp.tokens) == cp.usage.prompt_tokens + cp.usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


async def _native(server, body: dict) -> dict:
    async with server.http.post(server.base + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_penalties_and_logit_bias(server):
    c, m = server.client, server.model
    prompt = "Repeat repeat repeat"
    base = await _native(server, {"text": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    biased = await c.completions.create(model=m, prompt=prompt, max_tokens=6, temperature=0,
                                        logit_bias={str(base["output_ids"][0]): -100})
    assert biased.choices[0].text != base["text"]
    forced = await _native(server, {"text": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                                         "logit_bias": {"42": 100}}})
    assert forced["output_ids"] == [42, 42, 42]
    # a bias of +30 makes the greedy text repeat one token; penalties must break that up (a
    # frequency + presence penalty of 2 outweighs the bias after at most 15 repeats)
    bias = {"100": 30.0}
    sp = {"max_new_tokens": 32, "temperature": 0, "logit_bias": bias}
    plain = await _native(server, {"text": prompt, "sampling_params": sp})
    assert plain["output_ids"] == [100] * 32
    pen = await _native(server, {"text": prompt, "sampling_params": sp | {"frequency_penalty": 2.0,
                                                                           "presence_penalty": 2.0}})
    rep = await _native(server, {"text": prompt, "sampling_params": sp | {"repetition_penalty": 10.0}})
    assert pen["output_ids"][0] == 100 and len(set(pen["output_ids"])) > 1
    assert rep["output_ids"][0] == 100 and len(set(rep["output_ids"])) > 1
    oa = await c.completions.create(model=m, prompt=prompt, max_tokens=32, temperature=0, logit_bias=bias,
                                    frequency_penalty=2.0, presence_penalty=2.0)
    assert oa.choices[0].text == pen["text"]           # the same sampler behind both dialects


async def test_response_format_json_schema(server):
    c, m = server.client, server.model
    r = await c.chat.completions.create(model=m, messages=msgs("Where to?"), max_tokens=64, temperature=0.7, seed=2,
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "trip", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


async def test_cached_tokens_on_a_repeated_system_prompt(server):
    c, m = server.client, server.model
    first = await c.chat.completions.create(model=m, messages=msgs("first question"), max_tokens=2, temperature=0)
    second = await c.chat.completions.create(model=m, messages=msgs("second question"), max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 2
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens - 1


@pytest.mark.parametrize("kwargs,status,param", [
    (dict(n=0), 400, "n"),
    (dict(n=2, max_tokens=10**6), 400, "max_new_tokens"),      # checked before the shared prefill runs
    (dict(top_logprobs=3), 400, "top_logprobs"),
    (dict(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    (dict(temperature=-1), 400, "temperature"),
    (dict(frequency_penalty=5), 400, "frequency_penalty"),
    (dict(logit_bias={"x": 1}), 400, "logit_bias"),
    (dict(response_format={"type": "xml"}), 400, "response_format"),
    (dict(extra_body={"tools_mode": 1}), 400, None),
])
async def test_errors_have_openai_shape(server, kwargs, status, param):
    c = server.client
    args = dict(model=server.model, messages=msgs(), max_tokens=2) | kwargs
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(**args)
    assert e.value.status_code == status
    err = e.value.body if isinstance(e.value.body, dict) else {}
    err = err.get("error", err)
    assert err["code"] == status and err["message"] and err["type"]
    if param:
        assert err["param"] == param, err
    if kwargs.get("extra_body"):
        assert "tools_mode" in err["message"]          # an unknown field is named, never ignored


async def test_echo_of_token_ids_is_their_text(server):
    text = "Hello, wörld! héllo"
    async with server.http.post(server.base + "/tokenize", json={"text": text}) as r:
        ids = (await r.json())["tokens"]
    e = await server.client.completions.create(model=server.model, prompt=ids, max_tokens=0, echo=True)
    assert e.choices[0].text == text


async def test_one_served_model_answers_to_any_name(server):
    # as SGLang: clients written for other servers send their own model names (with several models
    # served, an unknown name is a 404: tests/test_gateway_units.py)
    r = await server.client.chat.completions.create(model="gpt-4o", messages=msgs(), max_tokens=2)
    assert r.model == server.model


async def test_completion_errors(server):
    c = server.client
    with pytest.raises(openai.BadRequestError) as e:
        await c.completions.create(model=server.model, prompt="x", max_tokens=2, best_of=2)
    assert "best_of" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        await c.completions.create(model=server.model, prompt="x", max_tokens=2, stream=True,
                                   stream_options={"include_usage": True, "bogus": True})


async def _scrape(server) -> dict:
    """/metrics parsed by prometheus-client's own parser: {sample name: {labels tuple: value}}."""
    from prometheus_client.parser import text_string_to_metric_families
    async with server.http.get(server.base + "/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _total(m: dict, name: str, **labels) -> float:
    return sum(v for key, v in m.get(name, {}).items() if all((k, val) in key for k, val in labels.items()))


async def test_latency_histograms_and_the_dashboard(server):
    """TTFT, inter-token latency, end-to-end, executor queue time and step time are Prometheus
    histograms in /metrics (written by prometheus-client), counted once per request / output;
    every metric the Grafana dashboard queries is served."""
    import json
    import re
    from pathlib import Path
    c, m = server.client, server.model
    before = await _scrape(server)
    n, tokens = 2, 8
    for i in range(n):
        stream = await c.completions.create(model=m, prompt=f"histograms {i}", max_tokens=tokens, stream=True,
                                            extra_body={"ignore_eos": True})
        async for _ in stream:
            pass
    after = await _scrape(server)

    def delta(name: str, **labels) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)
    assert delta("radixflow_time_to_first_token_seconds_count") == n
    assert delta("radixflow_e2e_request_latency_seconds_count") == n
    assert delta("radixflow_queue_seconds_count") == n
    # one output per step per request: the first is the TTFT, the rest inter-token gaps
    assert delta("radixflow_inter_token_latency_seconds_count") == n * (tokens - 1)
    assert delta("radixflow_step_seconds_count", phase="decode") >= tokens - 1
    assert delta("radixflow_step_seconds_count", phase="prefill") >= 1
    assert delta("radixflow_time_to_first_token_seconds_sum") > 0
    assert delta("radixflow_time_to_first_token_seconds_bucket", le="+Inf") == n
    for key in after["radixflow_step_seconds_count"]:
        assert ("service", "executor") in key and any(k == "instance" for k, _ in key)
    dashboard = (Path(__file__).parent.parent / "deploy" / "grafana" / "radixflow.json").read_text()
    queried = set(re.findall(r"radixflow_[a-z0-9_]+", dashboard))
    assert len(queried) > 10
    assert queried <= set(after), queried - set(after)
    assert json.loads(dashboard)["panels"]
