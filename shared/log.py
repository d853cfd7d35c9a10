"""structlog, configured once per process.

Console output for humans by default; one JSON object per line with RADIXFLOW_LOG_JSON=1. The
request id travels in a contextvar (`bind_request`), so every line logged while handling a request
carries it without being passed around.
"""
from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager

import structlog

_configured = False


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


@contextmanager
def bind_request(request_id: str):
    """Every log line inside the block carries request_id."""
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        yield
