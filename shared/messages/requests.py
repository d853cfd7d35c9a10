"""A request's path: gateway -> scheduler -> tokenizer, grammar -> executor, and its output stream."""
from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .base import Msg

# A token id, checked (>= 0, an int, not a bool) by msgspec in C as a message is decoded: the services
# need not scan a long prompt again in Python, several times per request
TokenId = Annotated[int, msgspec.Meta(ge=0)]


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
    # penalties and biases, applied to the logits in the batched sampler (before temperature)
    presence_penalty: float = 0.0     # OpenAI: minus this for every token already in the output
    frequency_penalty: float = 0.0    # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0   # CTRL/HF: logits of tokens in prompt or output divided (>0) or multiplied (<0) by it
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    # returned logprobs: log_softmax of the model's raw logits (before penalties, temperature, masks)
    logprobs: bool = False            # the sampled tokens' logprobs
    top_logprobs: int = 0             # and the k most likely tokens at each position (prompt ones too)


class TopLogprobs(Msg):
    """The k most likely tokens at one position, most likely first."""
    ids: list[int]
    logprobs: list[float]


class TenantLimits(Msg):
    """What one tenant may hold at a time (0: no limit). Set by the gateway from its key file."""
    max_concurrent: int = 0           # requests accepted and unfinished
    max_queued_tokens: int = 0        # prompt plus max_new_tokens of those requests
    max_cached_pages: int = 0         # KV pages its cache namespaces may keep in each pool


class ChatMessage(Msg):
    role: str
    content: str
    tool_call_id: str | None = None   # a tool message: the call it answers (the chat template renders it)
    name: str | None = None
    # an assistant turn's calls, as chat templates read them: {"id", "type": "function", "function":
    # {"name", "arguments": an object}} (OpenAI sends arguments as a JSON string; the gateway parses it)
    tool_calls: list[dict[str, Any]] | None = None


class ChatOptions(Msg):
    """What a chat request's messages are rendered with: the checkpoint's chat template is given the
    tools, the generation prompt or an open last turn, and the caller's chat_template_kwargs."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False      # the last (assistant) message is left open for the model
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions ({"type": "function", "function": ...})
    template_kwargs: dict[str, Any] = {}


# ---------------------------------------------------------------- gateway -> scheduler


class GenerateRequest(Msg):
    """A request submitted to the scheduler. Exactly one of text / messages / input_ids is set.
    Output arrives on `stream_subject` as StreamChunk / StreamError with sequence numbers."""
    rid: str
    stream_subject: str
    text: str | None = None
    messages: list[ChatMessage] | None = None
    chat: ChatOptions | None = None   # with messages: how they are rendered (None: the defaults)
    input_ids: list[TokenId] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    tenant: str = "default"           # who is accounted (limits, metrics)
    cache_salt: str | None = None
    cache_scope: str = ""             # whose cache namespaces it shares ("": the tenant's own; a group's name)
    limits: TenantLimits | None = None
    stream: bool = True               # False: one chunk at the end (no per-step detokenization)
    constraint: Constraint | None = None
    logprob_start: int = -1           # >= 0: the last chunk carries the prompt tokens' logprobs from here on
    n: int = 1                        # > 1: n completions of one prompt (prefilled once), chunks carry `index`
    json_stream: bool = False         # stream items in JSON (set when the request itself came as JSON)
    origin: str = ""                  # the gateway instance that waits for it: its beats stop, the request ends
    # where its stream items may come coalesced with other streams' (StreamBatch): one message per
    # scheduler step for every stream the caller reads there ("": one message per item)
    stream_batch: str = ""


class Accepted(Msg):
    rid: str
    prompt_tokens: int
    executor: str
    scheduler: str                    # the scheduler instance that owns the request's lifecycle
    grammar_backend: str = ""         # structured output: the engine that compiled its grammar
    enforcement: str = ""             # ... full, or checked (validated after, resampled; the stream is held)
    grammar_compile_s: float = 0.0    # ... seconds the grammar service spent compiling it (0: a cache hit)


class AbortRequest(Msg):
    rids: list[str]
    tenant: str = "default"           # to the scheduler: the caller's ids, scoped by it (shared/ids.py);
                                      # to an executor: unused, the ids are scoped already
    discard: bool = False             # programs: a cancelled branch; its pages become the first to evict


class Usage(Msg):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    resamples: int = 0                # structured output: outputs discarded for failing the check


class StreamChunk(Msg):
    """One step of one request's output. The last chunk of a request has finished=True."""
    rid: str
    seq: int
    text: str = ""
    token_ids: list[int] = []
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort
    matched_stop: int | str | None = None
    usage: Usage | None = None        # set on the last chunk (of each index)
    input_logprobs: list[float] = []  # last chunk: logprobs of the prompt tokens from max(1, logprob_start) on
    input_ids: list[int] = []         # last chunk, when logprob_start >= 0: the prompt tokens from logprob_start on
    input_top_logprobs: list[TopLogprobs] = []   # ... and their top alternatives (sampling.top_logprobs > 0)
    logprobs: list[float] = []        # sampling.logprobs: one per token in token_ids
    top_logprobs: list[TopLogprobs] = []   # sampling.top_logprobs > 0: one per token in token_ids
    index: int = 0                    # n > 1: which completion; each index's end has finish_reason set,
                                      # and only the stream's last item has finished=True


class StreamError(Msg):
    """Terminal: the request failed after it was accepted."""
    rid: str
    seq: int
    code: int
    kind: str
    message: str


class StreamBatch(Msg):
    """Stream items of one scheduler step for one reader, coalesced: items[i] belongs to the stream
    subjects[i] (a reader's InboxStream), in the order they were sent."""
    subjects: list[str]
    items: list[StreamChunk | StreamError]


# ---------------------------------------------------------------- tokenizer


class EncodeRequest(Msg):
    """Exactly one of text / messages / texts (a batch of plain texts, answered in `batch`)."""
    text: str | None = None
    messages: list[ChatMessage] | None = None
    chat: ChatOptions | None = None
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
    path: str = ""                    # the model directory it loaded (a scheduler on the same host may load it too)


# ---------------------------------------------------------------- scheduler -> executor


class ExecRequest(Msg):
    rid: str
    input_ids: list[TokenId]
    sampling: SamplingParams
    eos_token_ids: list[int] = []
    namespace: str = "default"        # cache namespace: tenant (or its group) plus optional "/" cache_salt
    quota_pages: int = 0              # > 0: the namespace's owner may keep at most this many cached pages
    output_subject: str = ""          # where the executor publishes StepOutput for this request
    checkpoint_at: list[int] = []     # hybrid: also keep the state at these prompt positions (fork points)
    grammar_key: str | None = None    # structured output: fetch the compiled grammar by this key ...
    grammar: "GrammarCompile | None" = None   # ... which any grammar instance can compile from this
    priority: int = 0                 # admission order among waiting requests (speculative branches: -1)
    pin: str = ""                     # programs: at release, keep the cached prefix locked under this key
    pin_ttl_s: float = 0.0            # ... at most this long (the program's deadline)
    logprob_start: int = -1           # >= 0: return the logprobs of prompt tokens from this position on
    after: str = ""                   # programs: wait (unadmitted) while this request runs here; its
                                      # release caches the prefix this one continues from
    quiet: bool = False               # the scheduler needs its first output and its last only (no stream,
                                      # no stop strings): nothing in between is published
    burst: int = 0                    # submissions the scheduler still held when it sent this one (its
                                      # only executor): an idle executor's admission waits for them too
                                      # (up to burst_wait_s)
    # prefill/decode disaggregation: a prefill-only request whose prompt KV (whole pages, and a hybrid
    # model's state at their end) goes to this executor's host tier before its end is reported
    transfer_to: str = ""
    transfer_from: int = 0            # ... all but the first this many tokens (whole pages), cached there already


class KVPages(Msg):
    """Executor -> executor: pages of a prompt's KV, `first` .. first + count - 1, for the receiver's
    host tier (tiers.py), which names them by namespace and tokens as its own pages. `data`: per page
    its K then V, each [attention layers, page_size, kv heads, head_dim] in `dtype`, pages in order;
    `state` (hybrid, on the last part): the DeltaNet state after the last page, its tensors in order."""
    namespace: str
    tokens: list[TokenId]             # the prompt up to the end of the last page of this part
    first: int
    count: int
    dtype: str
    data: bytes
    state: bytes = b""


class KVPagesStored(Msg):
    pages: int
    bytes: int


class ExecAccepted(Msg):
    rid: str


class SeqOutput(Msg):
    rid: str
    token_ids: list[int]              # new tokens of this step (possibly empty)
    offset: int = 0                   # output tokens sent before these: a lost output shows as a gap
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    matched_stop: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_code: int = 500
    input_logprobs: list[float] = []  # on the finished output, when ExecRequest.logprob_start >= 0:
                                      # the logprob of every prompt token from max(1, logprob_start) on
    input_top_logprobs: list[TopLogprobs] = []   # ... their top alternatives (sampling.top_logprobs > 0)
    logprobs: list[float] = []        # sampling.logprobs: one per token in token_ids
    top_logprobs: list[TopLogprobs] = []   # sampling.top_logprobs > 0: one per token in token_ids


class Replay(Msg):
    """A scheduler saw a gap in a request's outputs (SeqOutput.offset): the tokens from `offset` on."""
    rid: str
    offset: int


class Replayed(Msg):
    found: bool                       # False: the executor no longer has the request's outputs
    token_ids: list[int] = []         # output tokens from the asked offset (up to what was sent)
    logprobs: list[float] = []
    top_logprobs: list[TopLogprobs] = []


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
    draining: bool = False            # shutting down: finishes what it has, takes nothing new
    # the model's own sampling defaults (generation_config.json: temperature, top_p, top_k, min_p,
    # repetition_penalty), for the request fields a client leaves unset; empty with --sampling-defaults openai
    sampling_defaults: dict[str, float] = msgspec.field(default_factory=dict)
    # disaggregation: "prefill" (sent long prompts' prefills only), "decode" or "both"; and whether its
    # host tier can receive pages from a prefill executor
    role: str = "both"
    takes_pages: bool = False


# ---------------------------------------------------------------- grammar


class Constraint(Msg):
    """Structured output: what the output must match."""
    kind: str                         # json_schema | json_object | regex | ebnf | choice
    spec: str = ""                    # the schema (JSON text), regex, EBNF grammar, or JSON list of choices


class GrammarCompile(Msg):
    kind: str                         # json_schema | json_object | regex | ebnf | choice
    spec: str
    tokenizer: str = ""               # TokenizerInfo identity the caller expects ("" : the service's own)
    backend: str = ""                 # xgrammar | llguidance | auto ("": the deployment's default)


class GrammarCompiled(Msg):
    key: str                          # canonical spec + tokenizer identity + engine and its version, hashed
    compile_s: float = 0.0            # seconds this request spent compiling (0 on a cache hit)
    cache_hit: bool = False
    size: int = 0                     # bytes of the serialized compiled grammar
    backend: str = "xgrammar"         # which grammar engine compiled it (the executor applies its masks)
    enforcement: str = "full"         # full: the grammar enforces the whole (normalized) schema;
                                      # checked: some constructs are only validated on the finished
                                      # output (resampled when it fails; streams are held until then)


class GrammarFetch(Msg):
    """A compiled grammar by key. With `source`, an instance that does not hold the key (restarted,
    or another instance compiled it) compiles it from there, if that gives the same key."""
    key: str
    source: GrammarCompile | None = None


class GrammarBlob(Msg):
    key: str
    data: bytes                       # zlib-compressed grammar, serialized by its engine
    backend: str = "xgrammar"         # that engine: xgrammar (CompiledGrammar.serialize_json()) | llguidance
