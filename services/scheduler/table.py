"""RequestTable: every accepted, unfinished request, and the rule that each gets exactly one
terminal event: `finish` removes the entry, so whatever arrives for it later is ignored. It is also
the one place a request leaves, so a tracked request's tenant ticket (tenants.py) is held from
`add` to `finish`."""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from radixflow.shared.messages import ExecRequest, SamplingParams, StreamChunk, StreamError, TopLogprobs

from .stops import StopMatcher
from .structured import OutputCheck
from .tenants import Ticket


def namespace_of(scope: str, cache_salt: str | None) -> str:
    """The cache namespace: pages are shared only within one. `scope` is the request's
    cache_scope, or its tenant when it has none; radix's page quotas count per scope."""
    return scope + (f"/{cache_salt}" if cache_salt else "")


def incremental(stream: bool, sampling: SamplingParams) -> bool:
    """Whether a request's text is made every step (streaming, or stop strings to watch) or once, at
    the end; only then must the executor report every step (else ExecRequest.quiet)."""
    return stream or bool(sampling.stop)


@dataclass(eq=False)
class Tracked:
    rid: str
    stream_subject: str
    executor: str
    prompt_tokens: int
    sampling: SamplingParams
    deadline: float
    output_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0        # incremental detokenization state (see tokenizer.detokenize_incremental)
    read_offset: int = 0
    next_seq: int = 0             # sequence number of the next stream item
    cached_tokens: int = 0
    stopping: bool = False        # a stop string matched; the terminal chunk has been sent
    stream: bool = True
    sent: int = 0                 # output ids already sent in chunks
    check: "OutputCheck | None" = None   # structured output: validated once the text is complete
    text: str = ""                # the released text so far (kept only when `check` needs it)
    input_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    json: bool = False            # the client asked for JSON stream items (public NATS API)
    hold: bool = False            # structured output only checked at the end: no text before the check passes
    held: str = ""                # ... the text held back so far
    resamples: int = 0            # outputs discarded for failing the check
    exec_req: ExecRequest | None = None   # what was sent to the executor (resampling sends it again)
    prompt_ids: list[int] = field(default_factory=list)            # from logprob_start: returned with their logprobs
    logprobs: list[float] = field(default_factory=list)            # aligned with output_ids (when asked)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # where the stream items go instead of `stream_subject`: a program's node (programs.py)
    sink: Callable[[StreamChunk | StreamError], Awaitable[None]] | None = None
    ticket: Ticket | None = None  # its tenant's accounting, released when it leaves the table
    accepted_at: float = field(default_factory=time.monotonic)   # for the latency histograms
    last_token_at: float = 0.0    # when its latest output arrived (0: none yet)
    heard_at: float = field(default_factory=time.monotonic)   # its latest output of any kind, or its dispatch
    probed_at: float = 0.0        # when its executor was last asked whether it still runs it
    origin: str = ""              # the gateway waiting for it ("": a NATS client; recovery.py)
    batch: str = ""               # its reader's StreamBatch subject ("": its items one by one)

    def __post_init__(self) -> None:
        self.stops = StopMatcher(self.sampling.stop)
        # what the grammar does not enforce is checked at the end: the text waits for the check
        self.hold = self.hold or (self.check is not None and self.check.enforcement == "checked")

    @property
    def incremental(self) -> bool:
        """Detokenize every step (streaming, or stop strings to watch); else once at the end."""
        return incremental(self.stream, self.sampling)

    def take(self, text: str, **kw) -> StreamChunk:
        """The next chunk: `text` and the output ids (and their logprobs) not sent yet."""
        a = self.sent
        self.sent = len(self.output_ids)
        return StreamChunk(rid=self.rid, seq=self.take_seq(), text=text, token_ids=self.output_ids[a:],
                           logprobs=self.logprobs[a:], top_logprobs=self.top_logprobs[a:], **kw)

    def take_seq(self) -> int:
        self.next_seq += 1
        return self.next_seq - 1


class RequestTable:
    def __init__(self) -> None:
        self._live: dict[str, Tracked] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, rid: str) -> bool:
        return rid in self._live

    def add(self, t: Tracked) -> None:
        if t.rid in self._live:
            raise KeyError(f"request id {t.rid!r} is already in flight")
        self._live[t.rid] = t
        if t.ticket is not None:
            t.ticket.hold()

    def get(self, rid: str) -> Tracked | None:
        return self._live.get(rid)

    def finish(self, rid: str) -> Tracked | None:
        """Remove and return the request; None if it already ended (its terminal event was sent)."""
        t = self._live.pop(rid, None)
        if t is not None and t.ticket is not None:
            t.ticket.release()
        return t

    def on_executor(self, executor: str) -> list[Tracked]:
        return [t for t in self._live.values() if t.executor == executor]

    def silent(self, now: float, after_s: float) -> list[Tracked]:
        """Requests without output for `after_s`, not asked about in that time either."""
        return [t for t in self._live.values() if now - t.heard_at > after_s and now - t.probed_at > after_s]

    def orphaned(self, now: float, gateways: dict[str, float], after_s: float) -> list[Tracked]:
        """Requests whose gateway has not beaten for `after_s` (since their acceptance at least)."""
        return [t for t in self._live.values()
                if t.origin and now - max(gateways.get(t.origin, 0.0), t.accepted_at) > after_s]

    def expired(self, now: float) -> list[Tracked]:
        return [t for t in self._live.values() if now > t.deadline]
