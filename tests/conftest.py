"""Shared fixtures: a real nats-server per test session on a free port, and the tiny models."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from radixflow.shared.natsd import NatsServer

# The project's root holds the radixflow package's folders (kernels/, shared/, services/) and is on
# sys.path in a test run (`python -m pytest` puts the working directory there, pytest the tests
# package's rootdir, again before each test module). There `kernels/` shadowed Hugging Face's
# `kernels` package, which transformers 5.25 installs and imports with its models (CI: "cannot
# import name 'CUDAProperties' from 'kernels'"). So that one is imported first, from the installed
# packages, and later imports of the name find it in sys.modules.
def _import_installed(name: str) -> None:
    import importlib
    import importlib.util
    root = Path(__file__).resolve().parent.parent
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
    try:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    finally:
        sys.path[:] = saved


_import_installed("kernels")


@pytest.fixture(scope="session", autouse=True)
def _root_last_on_sys_path():
    # ... but processes the tests spawn (the grammar workers) start from this sys.path without that
    # module: a Llama config's module imports the `kernels` name there (Qwen's do not). So while
    # tests run the project's root comes after the installed packages: `kernels` is Hugging Face's,
    # and `tests` (which a spawned child imports to find its target) is still found.
    root = Path(__file__).resolve().parent.parent
    mine = [p for p in sys.path if Path(p or ".").resolve() == root]
    sys.path[:] = [p for p in sys.path if p not in mine] + mine
    yield

os.environ.setdefault("RADIXFLOW_LOG_LEVEL", "warning")
# without a GPU the Triton kernels run in Triton's interpreter (numpy), so their parity tests run
# on the CPU. Read when a kernel is decorated: set before any kernel module is imported
if os.environ.get("RADIXFLOW_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session):
    # the C++ CPU kernels (kernels/cpu_ext.py) are built (or loaded) before any test, so that every
    # engine of the session runs the same kernels: one would otherwise switch from the torch
    # references to them mid-test, when a background build lands
    from radixflow.kernels import cpu_ext
    cpu_ext.wait(900)


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
    """Every tiny preset, generated once per test session with `make_model` (about a second each)."""
    from radixflow.services.modelgen.make import make_model
    from radixflow.services.modelgen.presets import PRESETS
    root = tmp_path_factory.mktemp("models")
    return {p: str(make_model(p, root / p)) for p in PRESETS}
