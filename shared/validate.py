"""Semantic checks of a request, shared by the gateway (HTTP) and the scheduler (NATS clients)."""
from __future__ import annotations

import math

import json

from .errors import BadRequest

from .messages import Constraint, GenerateRequest, SamplingParams

MAX_STOPS = 16
MAX_STOP_LEN = 256
MAX_TOP_LOGPROBS = 20     # OpenAI's bound
MAX_N = 128
MAX_RID = 256            # request ids: subject-safe logs and bounded table keys
MAX_BATCH = 256          # completions one HTTP call may ask for (prompts times n): one call cannot fill the queue


def check_sampling(p: SamplingParams) -> None:
    if p.max_new_tokens < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {p.max_new_tokens}", param="max_new_tokens")
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise BadRequest(f"temperature must be a finite number >= 0, got {p.temperature}", param="temperature")
    if not (0.0 < p.top_p <= 1.0):
        raise BadRequest(f"top_p must be in (0, 1], got {p.top_p}", param="top_p")
    if p.top_k < -1:
        raise BadRequest(f"top_k must be -1 (disabled) or >= 0, got {p.top_k}", param="top_k")
    if not (0.0 <= p.min_p <= 1.0):
        raise BadRequest(f"min_p must be in [0, 1], got {p.min_p}", param="min_p")
    if len(p.stop) > MAX_STOPS:
        raise BadRequest(f"at most {MAX_STOPS} stop strings, got {len(p.stop)}", param="stop")
    for s in p.stop:
        if not s or len(s) > MAX_STOP_LEN:
            raise BadRequest(f"stop strings must be 1..{MAX_STOP_LEN} characters", param="stop")
    if any(t < 0 for t in p.stop_token_ids):
        raise BadRequest("stop_token_ids must be non-negative", param="stop_token_ids")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not (math.isfinite(v) and -2.0 <= v <= 2.0):
            raise BadRequest(f"{name} must be in [-2, 2], got {v}", param=name)
    if not (math.isfinite(p.repetition_penalty) and 0.0 < p.repetition_penalty <= 10.0):
        raise BadRequest(f"repetition_penalty must be in (0, 10], got {p.repetition_penalty}", param="repetition_penalty")
    for tok, bias in p.logit_bias.items():
        if tok < 0 or not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
            raise BadRequest(f"logit_bias maps token ids >= 0 to values in [-100, 100], got {tok}: {bias}",
                             param="logit_bias")
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}", param="top_logprobs")


def one_constraint(json_schema: str | None = None, regex: str | None = None, ebnf: str | None = None,
                   choice: list[str] | None = None, param: str = "sampling_params") -> Constraint | None:
    """The structured-output constraint among these (SGLang's names), or None; more than one is a 400."""
    found = [Constraint(kind=k, spec=v) for k, v in (("json_schema", json_schema), ("regex", regex), ("ebnf", ebnf),
                                                     ("choice", None if choice is None else json.dumps(choice)))
             if v is not None]
    if len(found) > 1:
        raise BadRequest("give at most one structured-output constraint", param=param)
    return found[0] if found else None


def check_stream_subject(subject: str, param: str = "stream_subject") -> None:
    """A stream goes to its reader's inbox (inbox.InboxStream) and nowhere else: not a service's
    subject (NATS would refuse the scheduler's publish there anyway: shared/creds.py), not a wildcard."""
    if subject and (not subject.startswith("_INBOX.") or any(c in subject for c in "*> \t\r\n")
                    or len(subject) > 256):
        raise BadRequest(f"{param} must be an inbox subject (_INBOX.<...>, no wildcards)", param=param)


def check_request(r: GenerateRequest) -> None:
    check_stream_subject(r.stream_subject)
    check_stream_subject(r.stream_batch, "stream_batch")
    if len(r.rid) > MAX_RID or not r.rid.isprintable():
        raise BadRequest(f"rid must be at most {MAX_RID} printable characters", param="rid")
    if not r.tenant or "/" in r.tenant:
        raise BadRequest("tenant must be a non-empty name without '/' (ids are scoped by it: shared/ids.py)",
                         param="tenant")
    given = [n for n, v in (("text", r.text), ("messages", r.messages), ("input_ids", r.input_ids)) if v is not None]
    if len(given) != 1:
        raise BadRequest("exactly one of text, messages or input_ids is required" if not given
                         else f"only one of text, messages or input_ids may be given, got {', '.join(given)}")
    if r.text is not None and not r.text:
        raise BadRequest("the prompt is empty", param="text")
    if r.input_ids is not None and not r.input_ids:
        raise BadRequest("input_ids is empty", param="input_ids")
    # input_ids >= 0: checked by the message type (TokenId) as it is decoded, and by the gateway
    # (protocol.token_ids) before it builds one
    if r.messages is not None and not r.messages:
        raise BadRequest("messages is empty", param="messages")
    check_sampling(r.sampling)
    if not 1 <= r.n <= MAX_N:
        raise BadRequest(f"n must be in [1, {MAX_N}], got {r.n}", param="n")
    if r.n > 1 and r.sampling.max_new_tokens == 0:
        raise BadRequest("n > 1 needs max_new_tokens > 0", param="n")


def check_batch(reqs: list[GenerateRequest], param: str = "prompt") -> None:
    total = sum(r.n for r in reqs)
    if total > MAX_BATCH:
        raise BadRequest(f"the call asks for {total} completions (prompts times n); at most {MAX_BATCH} in one "
                         "call: send the rest in further calls", param=param)
