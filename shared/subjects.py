"""Every NATS subject, in one module. These are the public API for NATS clients.

    rf.scheduler.submit            request/reply  GenerateRequest -> Accepted | ErrorReply
    rf.scheduler.abort             publish        AbortRequest
    rf.scheduler.program           request/reply  ProgramRequest -> ProgramAccepted | ErrorReply
    <stream_subject>               stream         ProgramEvent* then a terminal ProgramEvent(finished) | StreamError
    rf.scheduler.program.get       request/reply  ProgramQuery -> ProgramInfo (every scheduler; the owner answers)
    rf.scheduler.program.cancel    request/reply  ProgramQuery -> ProgramInfo (a program, or a node and its dependents)
    rf.scheduler.<id>.program.get|cancel          the same, addressed to the owner (ProgramAccepted.scheduler)
    <stream_subject>               stream         StreamChunk* then a terminal StreamChunk(finished) | StreamError
    rf.tokenizer.encode            req/reply, queue group "tokenizer"   EncodeRequest -> EncodeReply
    rf.tokenizer.detokenize        req/reply, queue group "tokenizer"   DetokenizeRequest -> DetokenizeReply
    rf.tokenizer.info              req/reply, queue group "tokenizer"   StatusRequest -> TokenizerInfo
    rf.grammar.compile             req/reply, queue group "grammar"     GrammarCompile -> GrammarCompiled
    rf.grammar.fetch               req/reply, queue group "grammar"     GrammarFetch -> GrammarBlob
    rf.radix.register              req/reply      RadixRegister -> RadixRegistered (an executor's pool)
    rf.radix.pool.<id>.step        req/reply      RadixStep -> RadixStepReply (one per executor step)
    rf.radix.place                 req/reply      RadixPlace -> RadixPlaceReply (cache-aware placement)
    rf.radix.flush                 req/reply      RadixFlush -> RadixFlushed
    rf.metrics                     scatter/gather StatusRequest -> MetricsReply from every instance
    rf.memory                      scatter/gather StatusRequest -> MemoryReply from every executor
    rf.executor.<id>.submit        req/reply      ExecRequest -> ExecAccepted | ErrorReply
    rf.executor.<id>.abort         publish        AbortRequest
    rf.executor.<id>.hints         publish        CacheHints (programs: unpin fork points, demote lost branches)
    rf.scheduler.<id>.output       publish        StepOutput (executor -> the scheduler that submitted)
    rf.<service>.status            req/reply      StatusRequest -> StatusReply (any one instance answers)
    rf.<service>.<id>.ping         req/reply      StatusRequest -> StatusReply (that instance: is it alive?)
    rf.executor.<id>.live          req/reply      LiveQuery -> LiveReply (which of these requests it still runs)
    rf.executor.<id>.replay        req/reply      Replay -> Replayed (a request's outputs from an offset: a lost one)
    rf.scheduler.<id>.live         req/reply      LiveQuery -> LiveReply (which of these requests, programs it owns)
    rf.heartbeat.<service>         publish        Heartbeat
"""
from __future__ import annotations

SERVICES = ("gateway", "tokenizer", "grammar", "radix", "scheduler", "executor")

SCHEDULER_SUBMIT = "rf.scheduler.submit"
SCHEDULER_ABORT = "rf.scheduler.abort"
SCHEDULER_PROGRAM = "rf.scheduler.program"
PROGRAM_GET = "rf.scheduler.program.get"
PROGRAM_CANCEL = "rf.scheduler.program.cancel"
TOKENIZER_ENCODE = "rf.tokenizer.encode"
TOKENIZER_DETOKENIZE = "rf.tokenizer.detokenize"
TOKENIZER_INFO = "rf.tokenizer.info"
GRAMMAR_COMPILE = "rf.grammar.compile"
GRAMMAR_FETCH = "rf.grammar.fetch"
RADIX_REGISTER = "rf.radix.register"
RADIX_ADOPT = "rf.radix.adopt"
RADIX_PLACE = "rf.radix.place"
RADIX_FLUSH = "rf.radix.flush"
METRICS = "rf.metrics"
MEMORY = "rf.memory"


def radix_step(pool: str) -> str:
    return f"rf.radix.pool.{pool}.step"


def status(service: str) -> str:
    return f"rf.{service}.status"


def ping(service: str, instance: str) -> str:
    return f"rf.{service}.{instance}.ping"


def live(service: str, instance: str) -> str:
    return f"rf.{service}.{instance}.live"


def replay(instance: str) -> str:
    return f"rf.executor.{instance}.replay"


def resend(instance: str) -> str:
    return f"rf.scheduler.{instance}.resend"


def heartbeat(service: str) -> str:
    return f"rf.heartbeat.{service}"


def executor_submit(instance: str) -> str:
    return f"rf.executor.{instance}.submit"


def executor_abort(instance: str) -> str:
    return f"rf.executor.{instance}.abort"


def executor_kv(instance: str) -> str:
    """KV pages another executor moves into this one's host tier (disaggregation)."""
    return f"rf.executor.{instance}.kv"


def executor_hints(instance: str) -> str:
    return f"rf.executor.{instance}.hints"


def scheduler_output(instance: str) -> str:
    return f"rf.scheduler.{instance}.output"


def program_op(instance: str, op: str) -> str:
    """The owning scheduler's program subjects: op is get | cancel."""
    return f"rf.scheduler.{instance}.program.{op}"


# A stream's subject is under its reader's inbox prefix (inbox.InboxStream): `_INBOX.<service>.rf.<token>`
# for a service (shared/creds.py), `_INBOX.rf.<token>` for a client on nats-py's default prefix.
