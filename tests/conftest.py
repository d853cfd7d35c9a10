"""Shared fixtures: a real nats-server per test session on a free port, and the tiny models."""
from __future__ import annotations

import os

import pytest

from radixflow.shared.natsd import NatsServer

os.environ.setdefault("RADIXFLOW_LOG_LEVEL", "warning")


@pytest.fixture(scope="session")
def nats_server():
    with NatsServer() as srv:
        yield srv


@pytest.fixture(scope="session")
def small_nats_server():
    """A server with a 64 KiB max_payload, to test oversize messages."""
    with NatsServer(max_payload=64 * 1024) as srv:
        yield srv


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Both tiny presets, generated once per test session with `make_model`."""
    from radixflow.services.modelgen.make import make_model
    root = tmp_path_factory.mktemp("models")
    return {p: str(make_model(p, root / p)) for p in ("tiny-dense", "tiny-hybrid")}
