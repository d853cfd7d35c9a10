"""Every message that crosses the bus, in one module, encoded one way (msgpack via msgspec).

Structs are tagged with their class name, so a reply can be decoded as `Reply | ErrorReply` and a
stream item as `StreamChunk | StreamError`. Field names are the wire contract: JSON Schemas of all
of them are generated into schemas/ (`radixflow schemas`) and a test fails when they drift.
"""
from __future__ import annotations

from typing import Any

import msgspec


class Msg(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """Base of every bus message."""


# ---------------------------------------------------------------- common


class ErrorReply(Msg):
    """A failed request. `code` follows HTTP (400 bad input, 404, 413, 429, 503, 504, 500)."""
    code: int
    kind: str
    message: str
    param: str | None = None


class StatusRequest(Msg):
    pass


class StatusReply(Msg):
    service: str
    instance: str
    ok: bool = True
    detail: dict[str, Any] = {}


class Heartbeat(Msg):
    """Published by every service instance every heartbeat period."""
    service: str
    instance: str
    ts: float
    detail: dict[str, Any] = {}


# ---------------------------------------------------------------- sampling


class SamplingParams(Msg):
    """What the executor needs to sample one request (SGLang's sampling_params, normalized)."""
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                   # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class ChatMessage(Msg):
    role: str
    content: str


# ---------------------------------------------------------------- gateway -> scheduler


class GenerateRequest(Msg):
    """A request submitted to the scheduler. Exactly one of text / messages / input_ids is set.
    Output arrives on `stream_subject` as StreamChunk / StreamError with sequence numbers."""
    rid: str
    stream_subject: str
    text: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    tenant: str = "default"
    cache_salt: str | None = None
    stream: bool = True               # False: one chunk at the end (no per-step detokenization)
    constraint: Constraint | None = None


class Accepted(Msg):
    rid: str
    prompt_tokens: int
    executor: str
    scheduler: str                    # the scheduler instance that owns the request's lifecycle


class AbortRequest(Msg):
    rids: list[str]
    discard: bool = False             # programs: a cancelled branch; its pages become the first to evict


class Usage(Msg):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class StreamChunk(Msg):
    """One step of one request's output. The last chunk of a request has finished=True."""
    rid: str
    seq: int
    text: str = ""
    token_ids: list[int] = []
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort
    matched_stop: int | str | None = None
    usage: Usage | None = None        # set on the last chunk
    input_logprobs: list[float] = []  # last chunk: logprobs of the prompt tokens from ExecRequest.logprob_start


class StreamError(Msg):
    """Terminal: the request failed after it was accepted."""
    rid: str
    seq: int
    code: int
    kind: str
    message: str


# ---------------------------------------------------------------- tokenizer


class EncodeRequest(Msg):
    """Exactly one of text / messages / texts (a batch of plain texts, answered in `batch`)."""
    text: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    texts: list[str] | None = None


class EncodeReply(Msg):
    input_ids: list[int] = []
    batch: list[list[int]] = []


class DetokItem(Msg):
    """Stateless incremental detokenization: `ids` are the request's output ids from
    `prefix_offset` on; offsets are relative to the full output and are echoed back advanced."""
    ids: list[int]
    prefix_offset: int
    read_offset: int
    skip_special_tokens: bool = True
    flush: bool = False               # the request's last call: release an incomplete trailing character


class DetokenizeRequest(Msg):
    items: list[DetokItem]


class DetokResult(Msg):
    text: str
    prefix_offset: int
    read_offset: int


class DetokenizeReply(Msg):
    items: list[DetokResult]


class TokenizerInfo(Msg):
    vocab_size: int
    eos_token_ids: list[int]
    identity: str


# ---------------------------------------------------------------- scheduler -> executor


class ExecRequest(Msg):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: list[int] = []
    namespace: str = "default"        # cache namespace: tenant plus optional cache_salt
    output_subject: str = ""          # where the executor publishes StepOutput for this request
    checkpoint_at: list[int] = []     # hybrid: also keep the state at these prompt positions (fork points)
    grammar_key: str | None = None    # structured output: fetch the compiled grammar by this key
    priority: int = 0                 # admission order among waiting requests (speculative branches: -1)
    pin: str = ""                     # programs: at release, keep the cached prefix locked under this key
    pin_ttl_s: float = 0.0            # ... at most this long (the program's deadline)
    logprob_start: int = -1           # >= 0: return the logprobs of prompt tokens from this position on
    after: str = ""                   # programs: wait (unadmitted) while this request runs here; its
                                      # release caches the prefix this one continues from


class ExecAccepted(Msg):
    rid: str


class SeqOutput(Msg):
    rid: str
    token_ids: list[int]              # new tokens of this step (possibly empty)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    matched_stop: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_code: int = 500
    input_logprobs: list[float] = []  # on the finished output, when ExecRequest.logprob_start >= 0


class StepOutput(Msg):
    """All outputs of one executor step for one scheduler: one message per step, never one per token."""
    executor: str
    step: int
    outputs: list[SeqOutput]


class ExecutorInfo(Msg):
    """The `detail` of an executor's heartbeat."""
    model: str
    max_model_len: int
    vocab_size: int
    running: int
    waiting: int
    page_size: int = 16


# ---------------------------------------------------------------- radix


class RadixRegister(Msg):
    """An executor announces its pool; the radix service becomes the authority over its KV pages
    and (hybrid models) its state slots."""
    pool: str
    num_pages: int
    page_size: int
    cache: bool = True                # False: --disable-radix-cache (pages are never shared)
    num_state_slots: int = 0          # > 0: a hybrid model; prefixes resume only from checkpoints
    checkpoint_interval: int = 0      # also checkpoint long prefills every this many tokens (0: off)


class RadixRegistered(Msg):
    pool: str


class Candidate(Msg):
    """A waiting request the executor would like to start."""
    rid: str
    namespace: str
    token_ids: list[int]
    reserve: int                      # tokens beyond the prompt to reserve pages for (max_new_tokens)
    checkpoint_at: list[int] = []     # hybrid: extra checkpoints asked for (the programs' fork points)
    priority: int = 0                 # higher first; among equals, longest cached prefix first
    max_cached: int = -1              # >= 0: reuse at most this many tokens (prompt logprobs need the rest)


class Progress(Msg):
    """The first `computed` tokens of a running request now have KV: cache them (prefill chunk done).
    Hybrid: the planned checkpoints up to `computed` now hold their states."""
    rid: str
    computed: int


class Release(Msg):
    """A request ended: cache its computed tokens, unlock, free every page the tree does not keep."""
    rid: str
    output_ids: list[int] = []
    computed: int = 0
    tail: int = 0                     # hybrid: position whose state the tail slot holds (0: none)
    pin: str = ""                     # keep the inserted prefix locked under this key (RadixUnpin frees it)
    pin_ttl_s: float = 0.0            # ... for at most this long
    discard: bool = False             # cancelled: cache nothing more; what it inserted is evicted first


class Demote(Msg):
    """Programs: a lost select choice. The cached pages of `token_ids` past its first `keep`
    tokens (and not shared with another path) become the first to evict."""
    namespace: str
    token_ids: list[int]
    keep: int = 0


class RadixStep(Msg):
    """Everything one executor step needs from the radix service, in one message, applied in this
    order: releases, progress, unpins, demotes, then admission of the candidates."""
    pool: str
    budget: int                       # prefill tokens the step can still take
    max_admit: int                    # free request slots
    candidates: list[Candidate] = []
    progress: list[Progress] = []
    releases: list[Release] = []
    unpins: list[str] = []            # programs: pins (Release.pin keys) no longer needed
    demotes: list[Demote] = []


class Grant(Msg):
    rid: str
    cached_tokens: int                # prompt tokens whose KV is reused (a multiple of page_size)
    pages: list[int]                  # the request's page table: cached pages, then fresh ones
    # hybrid models only
    state_slot: int = -1              # the request's working state
    restore_slot: int = -1            # copy this checkpoint into state_slot first (-1: start from zero)
    tail_slot: int = -1               # decode copies the state here at every page boundary
    checkpoints: list[int] = []       # prefill stops at these positions and copies the state ...
    checkpoint_slots: list[int] = []  # ... into these slots


class Deferred(Msg):
    rid: str
    cached_tokens: int
    reason: str                       # memory | budget | slots | shared-prefix


class RadixStepReply(Msg):
    grants: list[Grant] = []
    deferred: list[Deferred] = []
    free_pages: int = 0
    evictable_pages: int = 0


class RadixFlush(Msg):
    pool: str | None = None           # None: every pool


class RadixFlushed(Msg):
    freed_pages: int


class RadixPlace(Msg):
    """Which executor pool holds the longest prefix of `token_ids` in `namespace`."""
    namespace: str
    token_ids: list[int]
    pools: list[str]


class RadixPlaceReply(Msg):
    cached_tokens: dict[str, int]     # pool -> tokens it would reuse


class CacheHints(Msg):
    """Scheduler -> executor (programs): unpin fork points whose children are admitted, demote lost
    branches. They ride the executor's next RadixStep, after the releases that made the pins."""
    unpins: list[str] = []
    demotes: list[Demote] = []


# ---------------------------------------------------------------- metrics


class Sample(Msg):
    name: str                         # without the radixflow_ prefix; *_total are counters
    value: float
    labels: dict[str, str] = {}


class MemoryReply(Msg):
    """An executor's realized memory: bytes per token and per state slot, dtypes, pool sizes."""
    instance: str
    model: str
    report: dict[str, Any]


class MetricsReply(Msg):
    service: str
    instance: str
    samples: list[Sample]


# ---------------------------------------------------------------- grammar


class Constraint(Msg):
    """Structured output: what the output must match."""
    kind: str                         # json_schema | json_object | regex | ebnf | choice
    spec: str = ""                    # the schema (JSON text), regex, EBNF grammar, or JSON list of choices


class GrammarCompile(Msg):
    kind: str                         # json_schema | json_object | regex | ebnf | choice
    spec: str
    tokenizer: str = ""               # TokenizerInfo identity the caller expects ("" : the service's own)


class GrammarCompiled(Msg):
    key: str                          # canonical spec + tokenizer identity + xgrammar version, hashed
    compile_s: float = 0.0            # seconds this request spent compiling (0 on a cache hit)
    cache_hit: bool = False
    size: int = 0                     # bytes of the serialized compiled grammar


class GrammarFetch(Msg):
    key: str


class GrammarBlob(Msg):
    key: str
    data: bytes                       # zlib-compressed CompiledGrammar.serialize_json()


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
    input_ids: list[int] | None = None   # token ids to append instead of text
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
    stream: bool = False              # also send each node's text deltas as it generates
    timeout_s: float = 0.0            # the program's one deadline (0: the scheduler's request timeout)


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


ALL: tuple[type[Msg], ...] = tuple(
    v for v in list(globals().values()) if isinstance(v, type) and issubclass(v, Msg) and v is not Msg
)

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def decode(data: bytes, typ: Any) -> Any:
    """Decode `data` as `typ` (a Msg class or a Union of them); decoders are cached per type."""
    dec = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.msgpack.Decoder(typ)
    return dec.decode(data)
