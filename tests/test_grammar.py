"""The grammar service's plain parts: keys, lint, cache, tokenizer info, compiled grammars (the
service itself over NATS: test_grammar_service.py)."""
from __future__ import annotations

import json
import random

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from radixflow.services.grammar.cache import CacheEntry, GrammarCache
from radixflow.services.grammar.keys import JSON_OPTIONS, canonicalize, grammar_key
from radixflow.services.grammar.lint import check_schema, needs_validation, prepare
from radixflow.services.grammar.tokenizer_info import make_tokenizer_info, tokenizer_identity
from radixflow.services.grammar.backends.xgrammar import choice_ebnf, compile_text
from radixflow.services.tokenizer.tokenizer import Tokenizer
from radixflow.shared.errors import BadRequest
from .structured.corpus import ACCEPTED, NOW_SERVED, PERSON, REJECTED, SERVED_NOW, STILL_REJECTED, dumps
from .structured.walk import Walker



# ---------------------------------------------------------------- keys


def test_key_ignores_whitespace_keeps_property_order():
    ident = "tok-v8192"
    a = grammar_key(canonicalize("json_schema", dumps(PERSON)), ident)
    b = grammar_key(canonicalize("json_schema", dumps(PERSON, indent=4)), ident)
    assert a == b
    reordered = dict(PERSON, properties=dict(reversed(list(PERSON["properties"].items()))))
    assert grammar_key(canonicalize("json_schema", dumps(reordered)), ident) != a
    assert grammar_key(canonicalize("json_schema", dumps(PERSON)), "other-tokenizer") != a
    # a choice is a set: order and duplicates do not matter
    c1 = grammar_key(canonicalize("choice", '["b", "a", "a"]'), ident)
    assert c1 == grammar_key(canonicalize("choice", '["a","b"]'), ident)
    # regex text is taken as given
    assert grammar_key(canonicalize("regex", "a+"), ident) != grammar_key(canonicalize("regex", "a{1,}"), ident)


@pytest.mark.parametrize("kind,spec,needle", [
    ("json_schema", '{"type": "object",', "invalid JSON in json_schema"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("json_schema", '{"minimum": NaN}', "NaN"),
    ("choice", '["a", 3]', "choice must be"),
    ("choice", "[]", "choice must be"),
    ("regex", "", "non-empty"),
    ("yaml", "a: 1", "unknown constraint kind"),
])
def test_canonicalize_rejects(kind, spec, needle):
    with pytest.raises(BadRequest, match=needle):
        canonicalize(kind, spec)


# ---------------------------------------------------------------- lint


# Of the schemas refused before lint.prepare (corpus REJECTED + SERVED_NOW) only these are still
# refused (construct named in the 400); the others are served since (normalize.py): rewritten so
# that the grammar enforces them ("full"), or relaxed in the grammar and validated on the output ("checked").
@pytest.mark.parametrize("name,schema,construct", REJECTED + SERVED_NOW, ids=[r[0] for r in REJECTED + SERVED_NOW])
def test_lint_rejects_unsupported_construct(name, schema, construct):
    if name in NOW_SERVED:
        assert prepare(schema)[1] == NOW_SERVED[name]
        return
    with pytest.raises(BadRequest) as ei:
        check_schema(schema)
    msg = str(ei.value)
    assert f"'{STILL_REJECTED[name]}'" in msg and "unsupported JSON Schema construct" in msg and " at $" in msg
    assert ei.value.code == 400


def test_lint_names_the_path():
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"$ref": "https://x/tag.json"}}}}
    with pytest.raises(BadRequest, match=r"'\$ref' at \$\.properties\.tags\.items"):
        check_schema(schema)


def test_lint_accepts_corpus_and_flags_approximations():
    for name, schema in ACCEPTED:
        check_schema(schema)
    flagged = {name for name, schema in ACCEPTED if needs_validation(schema)}
    assert {"oneof_tagged", "date_format", "pattern_and_length"} <= flagged
    assert not flagged & {"person", "tags_minmax", "tree_bounded", "custom_format", "string_lengths"}


def test_invalid_json_schema_carries_validator_message():
    with pytest.raises(BadRequest, match=r"invalid JSON Schema at \$\.properties\.a\.type: 'strin' is not valid"):
        check_schema({"type": "object", "properties": {"a": {"type": "strin"}}})


# ---------------------------------------------------------------- cache


def test_cache_lru_bounded_in_bytes():
    c = GrammarCache(100)
    for k in "abc":
        assert c.put(k, CacheEntry(b"x" * 40, 400, 0.1))
    assert c.bytes == 80 and len(c) == 2 and "a" not in c and c.evictions == 1   # a evicted
    assert c.get("b") is not None                                                # b is now most recent
    c.put("d", CacheEntry(b"x" * 40, 400, 0.1))
    assert "c" not in c and "b" in c and "d" in c and c.evictions == 2
    assert c.get("zz") is None
    assert not c.put("huge", CacheEntry(b"x" * 101, 1, 0.0)) and "huge" not in c
    st = c.stats()
    assert st["hits"] == 1 and st["misses"] == 1 and st["entries"] == 2 and st["bytes"] == 80


# ---------------------------------------------------------------- tokenizer info


@pytest.fixture(scope="module")
def info(models):
    return make_tokenizer_info(models["tiny-hybrid"])


def test_tokenizer_info_deterministic(models, info):
    again = make_tokenizer_info(models["tiny-hybrid"])
    assert again.dump_metadata() == info.dump_metadata()
    assert info.vocab_size == 8192 and sorted(info.stop_token_ids) == [0, 2]
    assert 1 in info.special_token_ids
    ident = tokenizer_identity(models["tiny-hybrid"])
    assert ident.startswith(Tokenizer(models["tiny-hybrid"]).identity) and "v8192" in ident


def _compile_all_kinds(info: xgr.TokenizerInfo) -> dict[str, xgr.CompiledGrammar]:
    c = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    return {
        "json_schema": c.compile_json_schema(dumps({"type": "object", "properties": {"s": {"type": "string"}},
                                                    "required": ["s"]}), **JSON_OPTIONS),
        "regex": c.compile_regex(r"[^\n]{0,30}"),
        "ebnf": c.compile_grammar('root ::= "<" [a-z|_]* ">"'),
        "choice": c.compile_grammar(choice_ebnf(["<|im_start|>", "ok"])),
    }


def test_special_tokens_never_allowed_stop_only_at_end(info):
    """No grammar can emit <|im_start|> (id 1) even where its text would match; the stop ids are
    allowed exactly where the text so far is a complete match."""
    walker = Walker(info)
    vocab = info.decoded_vocab
    rng = random.Random(0)
    for kind, g in _compile_all_kinds(info).items():
        for _ in range(3):
            m = xgr.GrammarMatcher(g)
            text = b""
            for _ in range(60):
                ok = walker.allowed(m)
                assert not ok[1], f"{kind}: <|im_start|> allowed after {text!r}"
                complete = _is_grammar_accept_string(g.grammar, text.decode(errors="replace"))
                assert bool(ok[0]) == bool(ok[2]) == complete, (kind, text)
                ids = (ok & ~walker.stop).nonzero().flatten().tolist()
                if not ids or (complete and rng.random() < 0.3):
                    break
                tok = rng.choice(ids)
                assert m.accept_token(tok)
                text += vocab[tok]


def test_blanking_specials_changes_nothing_else(models, info):
    tok = Tokenizer(models["tiny-hybrid"])
    plain = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=8192, stop_token_ids=[0, 2])
    ours, theirs = _compile_all_kinds(info), _compile_all_kinds(plain)
    walker, rng = Walker(info), random.Random(1)
    special = walker.stop.clone()
    special[list(tok.special_ids)] = True
    for kind in ours:
        m1, m2 = xgr.GrammarMatcher(ours[kind]), xgr.GrammarMatcher(theirs[kind])
        for _ in range(40):
            a, b = walker.allowed(m1), walker.allowed(m2)
            diff = a ^ b
            assert not (diff & ~special).any(), kind
            ids = (a & ~walker.stop).nonzero().flatten().tolist()
            if not ids:
                break
            t = rng.choice(ids)
            assert m1.accept_token(t) and m2.accept_token(t)


def test_compiled_kinds_accept_exactly(info):
    c = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def accepts(kind: str, spec: str, text: str) -> bool:
        m = xgr.GrammarMatcher(compile_text(c, kind, canonicalize(kind, spec).text))
        return m.accept_string(text) and m.accept_token(2) and m.is_terminated()

    # json_object: any object, with at most 2 whitespace characters per gap (no newline loops)
    assert accepts("json_object", "", '{"a": [1, {"b": null}], "c": "d"}')
    assert not accepts("json_object", "", '{"a":   1}')
    assert not accepts("json_object", "", "[1]")
    # choice: exactly one of the strings, quotes/backslashes/newlines/non-ASCII intact
    choices = ['say "hi"', "back\\slash", "two\nlines", "café ☕", "😀"]
    for ch in choices:
        assert accepts("choice", dumps(choices), ch), ch
    assert not accepts("choice", dumps(choices), "caf")
    assert not accepts("choice", dumps(choices), "😀😀")
    # xgrammar 0.2.9 lets raw control characters into length-bounded strings; ours does not
    bounded = dumps({"type": "string", "maxLength": 8})
    assert accepts("json_schema", bounded, '"a b"')
    assert not accepts("json_schema", bounded, '"a\tb"') and not accepts("json_schema", bounded, '"a\x1cb"')
    assert not accepts("json_schema", bounded, '"123456789"')


def test_corpus_outputs_validate(info):
    """Soundness: random walks through each accepted schema's grammar that finish must validate,
    unless the schema is flagged for post-validation."""
    from jsonschema import Draft202012Validator
    c = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    walker, vocab, rng = Walker(info), info.decoded_vocab, random.Random(0)
    checked = 0
    for name, schema in ACCEPTED:
        if needs_validation(schema):
            continue
        g = c.compile_json_schema(dumps(schema), **JSON_OPTIONS)
        v = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
        ids, done = walker.walk(g, rng, max_tokens=150)
        if done:
            value = json.loads(b"".join(vocab[i] for i in ids).decode())
            err = next(iter(v.iter_errors(value)), None)
            assert err is None, f"{name}: {value!r}: {err.message}"
            checked += 1
    assert checked >= 40
