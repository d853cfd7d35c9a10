"""Programs: the DAG format (the HTTP body of POST /v1/programs and the bus message), events, queries."""
from __future__ import annotations

from typing import Any

from .base import Msg
from .requests import StreamChunk, StreamError, TenantLimits, TokenId


# ---------------------------------------------------------------- programs
#
# A program is a DAG of nodes. A node's prompt is its parent's full text (prompt and output) followed
# by its own text; `after` makes it wait for other nodes, whose outputs its text may name as {id}.
# These structs are both the HTTP body of POST /v1/programs (decoded strictly) and the bus message.


class NodeGen(Msg, forbid_unknown_fields=True):
    """Generate after the node's text: sampling parameters and at most one output constraint."""
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    ebnf: str | None = None
    choices: list[str] | None = None  # constrained generation among these strings (compare `select`)


class NodeSelect(Msg, forbid_unknown_fields=True):
    """Pick one of `choices` by the model's likelihood (mean token logprob after the node's text),
    computed from prompt logprobs in one batched prefill, not by generating. A choice may name
    another node's output as {id} (that node must be in `after`)."""
    choices: list[str]


class ProgramNode(Msg, forbid_unknown_fields=True):
    id: str
    text: str = ""
    input_ids: list[TokenId] | None = None   # token ids to append instead of text
    parent: str | None = None
    after: list[str] = []
    gen: NodeGen | None = None
    select: NodeSelect | None = None
    speculative: bool = False


class ProgramRequest(Msg):
    """rf.scheduler.program: run a program; ProgramEvents arrive on `stream_subject`."""
    id: str
    stream_subject: str
    nodes: list[ProgramNode]
    tenant: str = "default"
    cache_salt: str | None = None
    cache_scope: str = ""             # as GenerateRequest.cache_scope
    limits: TenantLimits | None = None
    stream: bool = False              # also send each node's text deltas as it generates
    timeout_s: float = 0.0            # the program's one deadline (0: the scheduler's request timeout)
    json_stream: bool = False         # events in JSON (set when the request itself came as JSON)
    origin: str = ""                  # as GenerateRequest.origin


class ProgramAccepted(Msg):
    id: str
    scheduler: str                    # the scheduler instance that runs the program
    nodes: int


class NodeResult(Msg):
    id: str
    state: str                        # pending | running | done | failed | cancelled
    parent: str | None = None
    after: list[str] = []
    kind: str = "gen"                 # gen | select | prefill
    speculative: bool = False
    text: str = ""                    # the node's own text, {id} references substituted
    output: str = ""                  # generated text, or the selected choice
    output_ids: list[int] = []
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    scores: list[float] = []          # select: each choice's mean token logprob
    discarded: bool = False           # a speculative branch that lost a select
    error: str | None = None
    error_code: int = 0
    executor: str = ""


class ProgramEvent(Msg):
    """One item of a program's stream. kind: started | delta | finished (a node ended, in any
    state; `result` holds it) | discarded (a finished speculative branch lost a select; `result`
    again) | done (the program's terminal event, `finished` is true)."""
    program: str
    seq: int
    kind: str
    node: str = ""
    text: str = ""                    # delta: new output text of `node`
    result: NodeResult | None = None
    finished: bool = False
    status: str = ""                  # done: finished | cancelled | timeout


class ProgramQuery(Msg):
    """GET (get) or cancel a program, or one node and its dependents (`node`)."""
    id: str
    tenant: str = "default"
    node: str | None = None


class ProgramInfo(Msg):
    id: str
    state: str                        # running | finished | cancelled | timeout
    nodes: list[NodeResult] = []


class Resend(Msg):
    """A gateway lost items of a stream on the way (NATS delivers at most once: a reconnect, a
    node failover): the items of stream `subject` from `seq` on, asked of the scheduler that
    sent them (rf.scheduler.<id>.resend)."""
    subject: str
    seq: int


class Resent(Msg):
    found: bool                       # False: the scheduler no longer has that stream's items
    items: list[StreamChunk | StreamError | ProgramEvent] = []
