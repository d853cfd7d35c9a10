"""Tokenizer facade: exact round trips, ChatML ids, and streaming detokenization equal to a full decode."""
from __future__ import annotations

import hashlib
import json
import random
import shutil

import pytest

# Only the tokenizer files are written: the tests need no weights.
from radixflow.services.modelgen.make import generation_config, tokenizer_asset, tokenizer_config
from radixflow.services.tokenizer.tokenizer import REPLACEMENT_CHAR, Tokenizer

ENDOFTEXT, IM_START, IM_END = 0, 1, 2

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45 p.m., isn't it?",
    "code": "def f(x: int) -> int:\n    \"\"\"Doc.\"\"\"\n\treturn {'a': [x ** 2, x // 3]}  # ok\n\n\n",
    "emoji": "ship it 🚀🎉 family 👨\u200d👩\u200d👧\u200d👦 flag 🇯🇵 skin 👍🏽",
    "cjk": "你好，世界！日本語のテキスト。한국어 문장도 있습니다.",
    "mixed": "  leading spaces, trailing tabs\t\t\r\n é vs e\u0301, ß, Ω, ∑x², \u00a0nbsp",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    shutil.copyfile(tokenizer_asset(), d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    (d / "generation_config.json").write_text(json.dumps(generation_config()))
    return d


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


def stream(tok: Tokenizer, ids: list[int], skip: bool = True, windowed: bool = False) -> list[str]:
    """Feed ids one at a time as a server would, flushing on the last step."""
    deltas, p, r = [], 0, 0
    for n in range(1, len(ids) + 1):
        last = n == len(ids)
        if windowed:
            d, p2, r2 = tok.detokenize_incremental(ids[p:n], 0, r - p, skip, flush=last)
            p, r = p + p2, p + r2
        else:
            d, p, r = tok.detokenize_incremental(ids[:n], p, r, skip, flush=last)
        assert 0 <= p <= r <= n
        deltas.append(d)
    return deltas


def test_metadata(tok, model_dir):
    assert tok.vocab_size == 8192
    assert tok.eos_token_ids == {IM_END, ENDOFTEXT}
    assert tok.special_ids == {ENDOFTEXT, IM_START, IM_END}
    want = hashlib.sha256((model_dir / "tokenizer.json").read_bytes()).hexdigest()[:16]
    assert tok.identity == want == Tokenizer(model_dir).identity


def test_shipped_tokenizer_asset():
    path = tokenizer_asset()
    assert path.stat().st_size < 1_000_000
    data = json.loads(path.read_text(encoding="utf-8"))
    assert [t["content"] for t in data["added_tokens"]] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert [t["id"] for t in data["added_tokens"]] == [0, 1, 2]
    assert len(data["model"]["vocab"]) == 8192


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_roundtrip(tok, kind):
    text = TEXTS[kind]
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert not set(ids) & tok.special_ids  # nothing added around the text
    assert tok.decode(ids) == text


def test_special_token_text_is_special(tok):
    ids = tok.encode("a<|im_end|>b")
    assert IM_END in ids
    assert tok.decode(ids, skip_special_tokens=False) == "a<|im_end|>b"
    assert tok.decode(ids) == "ab"


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好 🎉"}]
    text = tok.render_chat(msgs)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 你好 🎉<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat(msgs)
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert ids[0] == IM_START and ids.count(IM_START) == 3 and ids.count(IM_END) == 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    no_prompt = tok.encode_chat(msgs, add_generation_prompt=False)
    assert no_prompt[-2:] == [IM_END, tok.encode("\n")[0]]
    assert ids[: len(no_prompt)] == no_prompt  # the generation prompt only appends
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.render_chat(parts, add_generation_prompt=False) == "<|im_start|>user\nab<|im_end|>\n"


def test_incremental_matches_full_decode_on_every_prefix(tok):
    ids = tok.encode("Answer: 你好世界 🚀 emoji 👨\u200d👩\u200d👧 and code `x = 1`<|im_end|>")
    # The test is only meaningful if some token boundary splits a multi-byte character.
    assert any(tok.decode(ids[:n]).endswith(REPLACEMENT_CHAR) for n in range(1, len(ids)))
    for n in range(1, len(ids) + 1):
        prefix = ids[:n]
        for skip in (True, False):
            deltas = stream(tok, prefix, skip)
            assert "".join(deltas) == tok.decode(prefix, skip)
            assert stream(tok, prefix, skip, windowed=True) == deltas


def test_split_character_emitted_whole(tok):
    text = "中文🎉한"
    ids = tok.encode(text)
    deltas = stream(tok, ids)
    assert "".join(deltas) == text
    assert len(ids) > len(text)  # characters really are split across tokens here
    emitted = [d for d in deltas if d]
    assert all(REPLACEMENT_CHAR not in d for d in emitted)
    running = ""
    for d in deltas:
        running += d
        assert text.startswith(running)


def test_deltas_are_prefixes_of_final_text(tok):
    ids = tok.encode(TEXTS["emoji"] + TEXTS["cjk"])
    final = tok.decode(ids)
    running = ""
    for d in stream(tok, ids):
        running += d
        assert final.startswith(running)
        assert REPLACEMENT_CHAR not in running
    assert running == final


@pytest.mark.parametrize("seed", range(6))
def test_random_ids(tok, seed):
    rng = random.Random(seed)
    # Bias towards byte tokens (ids 3..258) so invalid and incomplete UTF-8 sequences are common.
    ids = [rng.randrange(3, 259) if rng.random() < 0.6 else rng.randrange(0, 8192) for _ in range(120)]
    for skip in (True, False):
        deltas = stream(tok, ids, skip)
        assert "".join(deltas) == tok.decode(ids, skip)
        assert stream(tok, ids, skip, windowed=True) == deltas


def test_batch_matches_single(tok):
    rng = random.Random(7)
    seqs = [tok.encode(TEXTS[k]) for k in sorted(TEXTS)] + [[rng.randrange(3, 259) for _ in range(30)]]
    states = [(0, 0)] * len(seqs)
    out = [""] * len(seqs)
    longest = max(len(s) for s in seqs)
    for n in range(1, longest + 1):
        items = [(s[: min(n, len(s))], p, r) for s, (p, r) in zip(seqs, states)]
        batch = tok.detokenize_batch(items, flush=n == longest)
        single = [tok.detokenize_incremental(i, p, r, flush=n == longest) for i, p, r in items]
        assert batch == single
        states = [(p, r) for _, p, r in batch]
        out = [o + d for o, (d, _, _) in zip(out, batch)]
    assert out == [tok.decode(s) for s in seqs]
    assert tok.detokenize_batch([]) == []


def test_decode_through_the_rust_tokenizer_equals_transformers(tok):
    """Tokenizer.decode skips transformers' wrapper where it changes nothing: the text is the same
    for any ids, special tokens among them, skipping them or not."""
    import random
    assert tok._raw is not None          # the fast path is the one taken for this tokenizer
    rng = random.Random(3)
    n = tok.vocab_size
    for _ in range(500):
        ids = [rng.randrange(n) for _ in range(rng.randrange(0, 12))] + rng.sample(sorted(tok.special_ids), 1)
        rng.shuffle(ids)
        for skip in (True, False):
            assert tok.decode(ids, skip) == tok.hf.decode(ids, skip_special_tokens=skip)
