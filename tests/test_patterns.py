"""Callers' patterns run where a deadline stops them and the GIL is free (shared/patterns.py):
re's semantics on ordinary patterns, a budget that ends a backtracking one, jsonschema's pattern
keywords routed through it, the output check and the grammar's lint turning it into a 400."""
from __future__ import annotations

import re
import threading
import time

import pytest

from radixflow.shared import patterns
from radixflow.shared.errors import BadRequest
from radixflow.shared.messages import Constraint

# backtracking shapes the `regex` engine cannot cut short (overlapping or identical alternatives
# under a repetition, then a character that is not there)
HOSTILE = [(r"^(a|aa)+b", "a" * 40), (r"^(a|a)+b", "a" * 30), (r"^(a|ab|aa)+c", "a" * 40)]


@pytest.mark.parametrize("pattern,text", [
    (r"^[a-z]+\d{2,3}$", "abc12"), (r"^[a-z]+\d{2,3}$", "abc1"), (r"(?i)^ABC", "abcdef"), (r"\bword\b", "a word here"),
    (r"^\w+$", "héllo"), (r"^(?!x)", "y"), (r"a{2}", "caab")])
def test_same_answers_as_re(pattern, text):
    assert (patterns.search(pattern, text) is None) == (re.search(pattern, text) is None)
    compiled = re.compile(pattern)
    assert (patterns.search(compiled, text) is None) == (compiled.search(text) is None)


def test_a_bad_pattern_is_re_error():
    with pytest.raises(re.error):
        patterns.search("(unclosed", "x")


@pytest.mark.parametrize("pattern,text", HOSTILE)
def test_a_backtracking_pattern_ends_at_its_budget(pattern, text):
    with pytest.raises(patterns.PatternTimeout) as e:
        with patterns.budget(0.2):
            patterns.search(pattern, text)
    assert "budget" in e.value.describe() and pattern in e.value.describe()
    with pytest.raises(patterns.PatternTimeout):       # outside a budget: CALL_S per match
        patterns.search(pattern, text)


def test_a_budget_is_spent_across_matches():
    with patterns.budget(0.0):
        with pytest.raises(patterns.PatternTimeout):
            patterns.search("a", "a")                     # nothing left: refused before it runs
    with patterns.budget(5.0):
        for _ in range(100):
            assert patterns.search("^a+$", "aaaa")        # cheap matches barely draw on it


def test_matching_releases_the_gil():
    """A hostile match in a thread leaves this thread running (re would hold the GIL for all of it)."""
    ticks, done = [0], threading.Event()

    def hostile():
        try:
            with patterns.budget(1.0):
                patterns.search(*HOSTILE[0])
        except patterns.PatternTimeout:
            pass
        done.set()

    threading.Thread(target=hostile).start()
    t0 = time.perf_counter()
    while not done.is_set():
        time.sleep(0.005)
        ticks[0] += 1
    assert time.perf_counter() - t0 >= 0.5       # the match ran its budget ...
    assert ticks[0] >= 20                        # ... while this thread kept running


def test_jsonschema_pattern_keywords_go_through_the_budget():
    """If a jsonschema release moves its matching out of the modules install() patches, this fails."""
    from jsonschema import Draft202012Validator
    pattern, text = HOSTILE[0]
    for schema, value in (({"type": "string", "pattern": pattern}, text),
                          ({"type": "object", "patternProperties": {pattern: {}}}, {text: 1}),
                          ({"type": "object", "propertyNames": {"pattern": pattern}}, {text: 1})):
        v = Draft202012Validator(schema)
        with pytest.raises(patterns.PatternTimeout):
            with patterns.budget(0.2):
                v.is_valid(value)
    assert not Draft202012Validator({"type": "string", "pattern": "^a+$"}).is_valid("b")   # still re's meaning


def test_the_output_check_is_a_400_past_its_budget():
    from radixflow.services.scheduler.structured import OutputCheck
    pattern, text = HOSTILE[1]
    schema = '{"type":"object","properties":{"s":{"type":"string","pattern":"%s"}},"required":["s"]}' % pattern
    check = OutputCheck(Constraint(kind="json_schema", spec=schema), budget_s=0.2)
    with pytest.raises(BadRequest) as e:
        check.error('{"s": "%s"}' % text, "stop")
    assert e.value.code == 400 and e.value.param == "response_format" and "budget" in e.value.message
    assert check.error('{"s": "b"}', "stop") is not None     # an ordinary miss is still a miss, not a timeout
    assert OutputCheck(Constraint(kind="json_schema", spec='{"type":"string","pattern":"^a+$"}')).error('"aaa"', "stop") \
        is None


def test_the_grammar_lint_refuses_a_backtracking_schema():
    """The lint matches a schema's enum values against its own pattern: a hostile pair is a 400 at
    compile time, not a stalled lint thread."""
    from radixflow.services.grammar.compiler import _budgeted
    from radixflow.services.grammar.lint import prepare
    schema = {"type": "string", "pattern": "^(a|aa)+$", "enum": ["a" * 40 + "!"]}
    t0 = time.perf_counter()
    with pytest.raises(BadRequest) as e:
        _budgeted(prepare, schema, False)
    assert e.value.param == "response_format" and "budget" in e.value.message
    assert time.perf_counter() - t0 < 30                 # the budget (1 s) ended it, with room for a loaded CI
