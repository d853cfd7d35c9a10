"""What every service instance answers or publishes: errors, status, heartbeats, metrics."""
from __future__ import annotations

from typing import Any

from .base import Msg


# ---------------------------------------------------------------- common


class ErrorReply(Msg):
    """A failed request. `code` follows HTTP (400 bad input, 404, 413, 429, 503, 504, 500)."""
    code: int
    kind: str
    message: str
    param: str | None = None
    retry_after: float | None = None  # 429: seconds to wait before trying again (HTTP Retry-After)


class StatusRequest(Msg):
    pass


class StatusReply(Msg):
    service: str
    instance: str
    ok: bool = True
    detail: dict[str, Any] = {}


class LiveQuery(Msg):
    """Which of these requests (or programs) does the instance still have? Asked about requests
    that went silent: NATS delivers at most once, so an output or a stream's end can be lost."""
    rids: list[str]


class LiveReply(Msg):
    rids: list[str]                   # those it has, or ended within the last few seconds


class Heartbeat(Msg):
    """Published by every service instance every heartbeat period."""
    service: str
    instance: str
    ts: float
    detail: dict[str, Any] = {}


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
