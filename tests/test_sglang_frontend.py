"""SGLang's own frontend language runs unchanged against a live radixflow server: the published
`sglang` wheel (installed without its GPU dependencies), `sgl.RuntimeEndpoint(url)`, `@sgl.function`,
`gen` with regex / json_schema / logprobs, `select`, `fork` and `join`, `run_batch`, streaming,
`flush_cache` and `get_server_info`.

What the frontend sends (sglang 0.5.10.post1's RuntimeEndpoint; unchanged up to 0.5.23):
  GET  /get_model_info      once, at construction; reads "model_path" (picks the chat template by it)
  POST /generate            gen: {"text", "sampling_params": {skip_special_tokens, spaces_between_special_tokens,
                            max_new_tokens, min_new_tokens, n, stop, stop_token_ids, stop_regex, temperature, top_p,
                            top_k, min_p, frequency_penalty, presence_penalty, ignore_eos, regex, json_schema}}
                            (+ return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs when
                            set; + "stream": true for run(stream=True), read as SSE "data:" lines up to [DONE])
  POST /generate            select: {"text": prompt, "sampling_params": {"max_new_tokens": 0}} -> reads
                            meta_info.prompt_tokens; then {"text": [prompt + c for c in choices],
                            "sampling_params": {"max_new_tokens": 0, "temperature": 0}, "return_logprob": true,
                            "return_text_in_logprobs": true, "logprob_start_len": max(prompt_tokens - 2, 0)}
                            -> a list, one per choice, each meta_info with input_token_logprobs and
                            output_token_logprobs as [[logprob | null, token_id, text], ...]
  POST /generate            run_batch with more than one program: the traced constant prefix, when longer
                            than 64 characters, as {"text": prefix, "sampling_params": {"max_new_tokens": 0}};
                            fork(n > 1) may send the parent text the same way
  POST /flush_cache         no body; any status but 200 is an error
  GET  /server_info         sgl.get_server_info (not /get_server_info)

The frontend is threaded and synchronous; the stack runs on an event loop of its own in a thread.
The tiny models have random weights, so outputs are gibberish, but they must obey every constraint.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import threading

import jsonschema
import pytest
from radixflow.services.modelgen.presets import ENDOFTEXT_ID, IM_END_ID, IM_START_ID

from .stacks import start, stop

try:
    import sglang as sgl
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
except ImportError as e:      # CI installs it; a fallback for a checkout without it
    pytest.skip(f"SGLang's frontend is not importable ({e}); install it without its GPU dependencies: "
                "pip install --no-deps sglang==0.5.10.post1 && pip install pybase64==1.5.1 ipython==9.18.1",
                allow_module_level=True)


SCHEMA = {"type": "object",
          "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 9},
                         "ok": {"type": "boolean"},
                         "tag": {"type": "string", "maxLength": 6}},
          "required": ["color", "count", "ok", "tag"], "additionalProperties": False}
SPECIAL_IDS = {ENDOFTEXT_ID, IM_START_ID, IM_END_ID}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PREAMBLE = ("You are a terse assistant. Answer every question with one word.\n"
            "Rules: no punctuation, no explanations, no greetings, and never repeat the question.\n")


@pytest.fixture(scope="module")
def server(models):
    loop = asyncio.new_event_loop()
    st = loop.run_until_complete(start(models["tiny-dense"]))
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield st
    asyncio.run_coroutine_threadsafe(stop(st), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


@pytest.fixture(scope="module")
def backend(server):
    return sgl.RuntimeEndpoint(server.base)


def ok(state):
    """The program's state once its worker thread is done; the frontend keeps a failed request's
    exception on the state instead of raising it."""
    err = state.error()
    assert err is None, f"the program failed: {err!r}\ntext so far: {state.text()!r}"
    return state


def test_endpoint_reads_model_info(backend, server):
    assert isinstance(backend, RuntimeEndpoint)
    assert isinstance(backend.model_info["model_path"], str) and backend.get_model_name()
    assert backend.get_chat_template() is not None


def test_server_info_and_flush_cache(backend):
    info = sgl.get_server_info(backend)          # GET /server_info
    assert isinstance(info, dict)
    assert sgl.flush_cache(backend) is None      # POST /flush_cache, 200


def test_gen_plain_with_sampling_params(backend):
    @sgl.function
    def plain(s):
        s += "Q: Name three colours.\nA:" + sgl.gen("a", max_tokens=6, temperature=0.7, top_p=0.9, top_k=20)
        s += "\nQ: And one more?\nA:" + sgl.gen("b", max_tokens=5, ignore_eos=True, temperature=0)

    st = ok(plain.run(backend=backend))
    a, b = st["a"], st["b"]
    assert isinstance(a, str) and isinstance(b, str)
    assert st.text() == f"Q: Name three colours.\nA:{a}\nQ: And one more?\nA:{b}"
    ma, mb = st.get_meta_info("a"), st.get_meta_info("b")
    assert isinstance(ma["id"], str) and ma["prompt_tokens"] > 0 and 0 <= ma["completion_tokens"] <= 6
    assert mb["completion_tokens"] == 5 and mb["finish_reason"]["type"] == "length"    # ignore_eos runs to the limit
    assert mb["prompt_tokens"] > ma["prompt_tokens"]


def test_gen_stop_is_trimmed(backend):
    @sgl.function
    def stopping(s):
        s += "List:\n1." + sgl.gen("x", max_tokens=24, stop=["\n", "2."], temperature=1.0)

    st = ok(stopping.run(backend=backend))
    x = st["x"]
    assert "\n" not in x and "2." not in x


def test_gen_regex(backend):
    @sgl.function
    def phone(s):
        s += "Call me at " + sgl.gen("num", regex=PHONE, max_tokens=32, temperature=0)
        s += ". Or at " + sgl.gen("num2", regex=PHONE, max_tokens=32, temperature=1.0)

    st = ok(phone.run(backend=backend))
    assert re.fullmatch(PHONE, st["num"]), st["num"]
    assert re.fullmatch(PHONE, st["num2"]), st["num2"]
    assert st.text() == f"Call me at {st['num']}. Or at {st['num2']}"


def test_gen_int_and_bool_dtypes(backend):
    @sgl.function
    def typed(s):
        s += "Hours in a day: " + sgl.gen_int("hours", max_tokens=6) + "\n"
        s += "Is the sky blue? " + sgl.gen("yes", dtype=bool, max_tokens=8) + "\n"

    st = ok(typed.run(backend=backend, temperature=0))
    int(st["hours"])
    assert st["yes"] in ("True", "False")


def test_gen_json_schema(backend):
    @sgl.function
    def extract(s, text):
        s += "Extract the fields as JSON.\nText: " + text + "\nJSON: "
        s += sgl.gen("obj", json_schema=json.dumps(SCHEMA), max_tokens=128)

    for temperature in (0, 1.0):
        st = ok(extract.run(text="a small red ball, three of them", backend=backend, temperature=temperature))
        obj = json.loads(st["obj"])
        jsonschema.validate(obj, SCHEMA)


def test_gen_with_logprobs(backend):
    @sgl.function
    def scored(s):
        s += "The quick brown fox" + sgl.gen("x", max_tokens=3, ignore_eos=True, return_logprob=True,
                                             logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)

    st = ok(scored.run(backend=backend, temperature=0))
    m = st.get_meta_info("x")
    inp, out = m["input_token_logprobs"], m["output_token_logprobs"]
    assert len(inp) == m["prompt_tokens"] and inp[0][0] is None           # the first prompt token has no logprob
    assert len(out) == m["completion_tokens"] == 3
    for lp, tok, text in inp[1:] + out:
        assert isinstance(lp, float) and lp <= 0 and isinstance(tok, int) and isinstance(text, str)
    assert "".join(e[2] for e in inp).endswith("The quick brown fox")
    if all(e[1] not in SPECIAL_IDS for e in out):                          # skip_special_tokens drops those from text
        assert "".join(e[2] for e in out) == st["x"]
    tops = m["output_top_logprobs"]
    assert len(tops) == 3 and all(len(t) == 2 for t in tops)
    for (lp, tok, _), top in zip(out, tops):
        assert top[0][0] >= top[1][0]                                       # best first
        assert tok == top[0][1] or math.isclose(top[0][0], lp, abs_tol=1e-4)   # greedy took the best one


def test_input_logprob_positions_follow_sglang(backend):
    """SGLang's positions: without logprob_start_len (-1) no prompt entries; from logprob_start_len k
    on, prompt_tokens - k entries whose first has no logprob (None) whatever k is, so clients that
    average them (select's normalized_prompt_logprobs) get SGLang's numbers."""
    @sgl.function
    def scored(s):
        s += "Pack my box with five dozen liquor jugs." + sgl.gen("a", max_tokens=2, return_logprob=True)
        s += " Again:" + sgl.gen("b", max_tokens=2, return_logprob=True, logprob_start_len=3)

    st = ok(scored.run(backend=backend, temperature=0))
    a, b = st.get_meta_info("a"), st.get_meta_info("b")
    assert a["input_token_logprobs"] == [] and len(a["output_token_logprobs"]) == a["completion_tokens"]
    inp = b["input_token_logprobs"]
    assert len(inp) == b["prompt_tokens"] - 3 and inp[0][0] is None
    assert all(isinstance(e[0], float) and e[2] is None for e in inp[1:])     # no text unless asked for


def _check_select(st, name, choices, prompt):
    decision = st[name]
    assert decision in choices
    assert st.text() == prompt + decision
    meta = st.get_meta_info(name)
    norm = meta["normalized_prompt_logprobs"]
    assert len(norm) == len(choices) and all(isinstance(v, float) and math.isfinite(v) and v <= 0 for v in norm)
    assert decision == choices[max(range(len(choices)), key=lambda i: norm[i])]
    for choice, entries in zip(choices, meta["input_token_logprobs"]):
        # [logprob, token_id, text] from logprob_start_len on; the first entry alone may have no logprob
        assert all(len(e) == 3 and isinstance(e[1], int) and isinstance(e[2], str) for e in entries)
        assert all(isinstance(e[0], float) for e in entries[1:])
        assert "".join(e[2] for e in entries).endswith(choice)        # the entries line up with the tokens
    assert meta["output_token_logprobs"] == [[]] * len(choices)         # max_new_tokens 0 generates nothing


def test_select(backend):
    prompt = ("Determine whether the statement below is True, False, or Unknown.\n"
              "Statement: The capital of France is Paris.\nAnswer:")
    choices = ["True", "False", "Unknown"]

    @sgl.function
    def true_or_false(s):
        s += prompt + sgl.select("answer", choices)

    st = ok(true_or_false.run(backend=backend))
    _check_select(st, "answer", choices, prompt)
    again = ok(true_or_false.run(backend=backend))
    assert again["answer"] == st["answer"]                    # greedy scoring: the same choice every time


def test_select_where_the_prompt_ends_inside_the_choice_token(backend):
    """The prompt ends with a space that the tokenizer merges into each choice (" yes"), so the
    prompt's last token is not a prefix token of prompt + choice."""
    prompt = "Is water wet? Answer: "
    choices = ["yes", "no", "it depends"]

    @sgl.function
    def ask(s):
        s += prompt + sgl.select("answer", choices=choices)
        s += "\nWhy?" + sgl.gen("why", max_tokens=4)

    st = ok(ask.run(backend=backend))
    assert st["answer"] in choices
    assert st.text().startswith(prompt + st["answer"] + "\nWhy?")
    meta = st.get_meta_info("answer")
    for choice, entries in zip(choices, meta["input_token_logprobs"]):
        assert "".join(e[2] for e in entries).endswith(choice)


def test_gen_with_choices_is_a_select(backend):
    @sgl.function
    def pick(s):
        s += "Pick a fruit: " + sgl.gen("fruit", choices=["apple", "banana", "cherry"])

    st = ok(pick.run(backend=backend))
    _check_select(st, "fruit", ["apple", "banana", "cherry"], "Pick a fruit: ")


def test_fork_and_join(backend):
    seen = []

    @sgl.function
    def tips(s, topic):
        s += f"Here are two short tips about {topic}.\n"
        s += "Title:" + sgl.gen("title", max_tokens=4, temperature=0) + "\n"
        forks = s.fork(2)
        seen.append(forks)
        for i, f in enumerate(forks):
            f += f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=6, temperature=0)
            f += " Rated " + sgl.gen("rating", regex=r"[1-5]/5", max_tokens=4)
        forks.join()
        s += "Tip 1:" + forks[0]["tip"] + "\nTip 2:" + forks[1]["tip"] + "\n"
        s += "Summary:" + sgl.gen("summary", max_tokens=4)
        return forks

    try:
        st = ok(tips.run(topic="caching", backend=backend))
    except KeyError:              # a fork failed, so its variable never came back: show why
        pytest.fail(f"a fork failed: {[f.error() for f in seen[0]] if seen else 'before forking'}")
    forks = st.ret_value
    head = f"Here are two short tips about caching.\nTitle:{st['title']}\n"
    for i in range(2):
        f = ok(forks[i])
        assert f.text() == f"{head}Tip {i + 1}:{f['tip']} Rated {f['rating']}"     # each fork continues the parent
        assert re.fullmatch(r"[1-5]/5", f["rating"])
    assert st["tip"] == [forks[0]["tip"], forks[1]["tip"]]                         # join gathers the variables
    assert st["rating"] == [forks[0]["rating"], forks[1]["rating"]]
    assert st.text() == f"{head}Tip 1:{forks[0]['tip']}\nTip 2:{forks[1]['tip']}\nSummary:{st['summary']}"


def test_fork_then_select_in_each_branch(backend):
    @sgl.function
    def branches(s):
        s += "Weather report.\n"
        forks = s.fork(3)
        forks += lambda i: f"Day {i}: the sky is"
        for f in forks:
            f += sgl.select("sky", choices=[" clear", " cloudy"])
        forks.join()

    st = ok(branches.run(backend=backend))
    assert len(st["sky"]) == 3 and all(x in (" clear", " cloudy") for x in st["sky"])


def test_run_batch(backend):
    @sgl.function
    def qa(s, question):
        s += PREAMBLE
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n")
        s += "\nConfidence: " + sgl.gen("conf", regex=r"(low|medium|high)", max_tokens=4)

    questions = ["What colour is grass?", "Is ice cold?", "How many legs has a cat?", "Where is Paris?"]
    states = qa.run_batch([{"question": q} for q in questions], backend=backend, temperature=0)
    assert len(states) == len(questions)
    for st, q in zip(states, questions):
        ok(st)
        assert st.text() == f"{PREAMBLE}Q: {q}\nA:{st['answer']}\nConfidence: {st['conf']}"
        assert "\n" not in st["answer"] and st["conf"] in ("low", "medium", "high")
        # the frontend pre-cached the common preamble, so every program starts on a cache hit
        assert st.get_meta_info("answer")["cached_tokens"] > 0

    # positional arguments, one thread, sampling
    states = qa.run_batch([(q,) for q in questions[:2]], backend=backend, num_threads=1, temperature=0.8)
    assert [ok(st).text().startswith(f"{PREAMBLE}Q: {q}\nA:") for st, q in zip(states, questions)] == [True, True]


def test_chat_roles_use_the_template(backend):
    @sgl.function
    def chat(s, question):
        s += sgl.system("You are brief.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=6))

    st = ok(chat.run(question="Hello?", backend=backend))
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    assert msgs[1]["content"] == "Hello?" and msgs[2]["content"] == st["answer"].lstrip()
    tmpl = backend.get_chat_template()
    assert st.text().startswith(tmpl.get_prefix_and_suffix("system", [])[0] + "You are brief.")


def test_stream(backend):
    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("story", max_tokens=12, ignore_eos=True, temperature=0)

    st = story.run(backend=backend, stream=True)
    chunks = list(st.text_iter("story"))
    ok(st)
    assert "".join(chunks) == st["story"]
    assert st.get_meta_info("story")["completion_tokens"] == 12
    assert st.text() == "Once upon a time" + st["story"]


def test_default_backend(backend):
    @sgl.function
    def hello(s):
        s += "Hello," + sgl.gen("x", max_tokens=3)

    before = sgl.global_config.default_backend
    sgl.set_default_backend(backend)
    try:
        st = ok(hello.run())
        assert st.text() == "Hello," + st["x"]
        assert sgl.flush_cache() is None
    finally:
        sgl.set_default_backend(before)
