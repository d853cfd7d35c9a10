"""structlog, configured once per process.

Console output for humans by default; one JSON object per line with RADIXFLOW_LOG_JSON=1. The
request id travels in a contextvar (`bind_request`), so every line logged while handling a request
carries it without being passed around.
"""
from __future__ import annotations

import logging
import os
import sys
from contextvars import ContextVar

import structlog

_configured = False
_request_id: ContextVar[str | None] = ContextVar("radixflow_request_id", default=None)


def _add_request_id(_logger, _method: str, event: dict) -> dict:
    rid = _request_id.get()
    if rid is not None:
        event.setdefault("request_id", rid)
    return event


def configure(level: str | None = None, json: bool | None = None) -> None:
    global _configured
    if _configured:
        return
    _configured = True
    level = (level or os.environ.get("RADIXFLOW_LOG_LEVEL", "info")).upper()
    json = os.environ.get("RADIXFLOW_LOG_JSON", "0") in ("1", "true") if json is None else json
    render = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_request_id,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            render,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get(name: str) -> structlog.stdlib.BoundLogger:
    configure()
    return structlog.get_logger(name)


class bind_request:
    """Every log line inside the block carries request_id. One contextvar, set and reset: every
    message a service handles passes through here, and structlog's own bound_contextvars copies
    the whole context each time."""
    __slots__ = ("rid", "token")

    def __init__(self, request_id: str):
        self.rid = request_id

    def __enter__(self) -> None:
        self.token = _request_id.set(self.rid)

    def __exit__(self, *exc) -> None:
        _request_id.reset(self.token)
