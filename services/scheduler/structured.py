"""The structured-output guarantee, checked once more on the finished text.

The grammar mask makes the format hold token by token; this check is the backstop the issue asks
for: a schema construct xgrammar enforces only approximately, or an output cut short by max_tokens,
becomes a clear error instead of text that fails the caller's parser.

The check runs a caller's patterns, so it runs where they cannot stall anything (shared/patterns.py):
in a thread of its own (off the event loop; the `regex` engine releases the GIL while it matches),
within one time budget per output. A schema whose check ran past it fails that request with a 400,
and further requests with the same compiled grammar are refused at submission for a while.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

from radixflow.shared import patterns
from radixflow.shared.errors import BadRequest
from radixflow.shared.messages import Constraint
from radixflow.shared.recent import Recent

KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice")


def check_constraint(c: Constraint) -> None:
    if c.kind not in KINDS:
        raise BadRequest(f"unknown constraint kind {c.kind!r}; one of {', '.join(KINDS)}", param="response_format")
    if c.kind != "json_object" and not c.spec:
        raise BadRequest(f"a {c.kind} constraint needs a non-empty spec", param="response_format")
    if c.kind == "choice":
        try:
            choices = json.loads(c.spec)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(x, str) and x for x in choices):
            raise BadRequest("choice must be a non-empty list of non-empty strings", param="choice")


class OutputCheck:
    def __init__(self, c: Constraint, backend: str = "", enforcement: str = "full", compile_s: float = 0.0,
                 key: str = "", budget_s: float = 1.0):
        self.key = key                    # the compiled grammar's (Checks remembers slow ones by it)
        self.budget_s = budget_s
        self.kind = c.kind
        self.spec = c.spec                # sent with the key: any grammar instance can compile it again
        self.backend = backend            # the grammar engine that enforces the rest
        self.enforcement = enforcement    # checked: only this check enforces some constructs
        self.compile_s = compile_s        # the grammar service's compile time, reported in Accepted
        self.validator = None
        self.choices: list[str] = json.loads(c.spec) if c.kind == "choice" else []
        if c.kind == "json_schema":
            from jsonschema import Draft202012Validator
            from jsonschema.validators import validator_for
            schema = json.loads(c.spec)
            cls = validator_for(schema, default=Draft202012Validator)     # the draft the schema declares
            self.validator = cls(schema, format_checker=cls.FORMAT_CHECKER)

    def error(self, text: str, finish_reason: str | None) -> str | None:
        """Why `text` may not be returned, or None when it satisfies the constraint. A check that
        runs past its budget raises BadRequest: the schema's patterns, not the output, are at fault
        (sampling again would only spend the budget again)."""
        try:
            with patterns.budget(self.budget_s):
                return self._error(text, finish_reason)
        except patterns.PatternTimeout as e:
            raise BadRequest(f"the output check of this schema ran past its {self.budget_s:g} s budget: "
                             f"{e.describe()}", param="response_format") from None

    def _error(self, text: str, finish_reason: str | None) -> str | None:
        if finish_reason == "length":
            return ("max_tokens was reached before the structured output was complete; "
                    "raise max_tokens (nothing valid could be returned)")
        if finish_reason == "abort":
            return None
        if self.kind in ("json_schema", "json_object"):
            try:
                value = json.loads(text)
            except ValueError as e:
                return f"the output is not valid JSON: {e}"
            if self.kind == "json_object" and not isinstance(value, dict):
                return "the output is JSON but not an object"
            if self.validator is not None:
                err = next(iter(self.validator.iter_errors(value)), None)
                if err is not None:
                    path = "$" + "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
                    return f"the output does not satisfy the schema at {path}: {err.message}"
        if self.kind == "choice" and text not in self.choices:
            return f"the output {text[:80]!r} is not one of the choices"
        return None


class Checks:
    """Runs output checks off the event loop and remembers the grammars whose check ran past its
    budget: their next requests are refused at once (for `refuse_s`) instead of burning a check
    thread each for the whole budget."""

    def __init__(self, threads: int = 2, refuse_s: float = 600.0):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="output-check")
        self.slow = Recent(refuse_s)
        self.timeouts = 0
        self.running = 0          # checks started and not yet ended

    def refuse_slow(self, key: str) -> None:
        if key and key in self.slow:
            raise BadRequest("the output check of this schema ran past its time budget recently (a pattern that "
                             "backtracks without bound); simplify its patterns", param="response_format")

    async def error(self, check: OutputCheck, text: str, finish_reason: str | None) -> str | None:
        self.running += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, check.error, text, finish_reason)
        except BadRequest:
            self.timeouts += 1
            if check.key:
                self.slow.add(check.key)
            raise
        finally:
            self.running -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
