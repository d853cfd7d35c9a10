"""Where programs run: a radixflow server over HTTP (`Runtime`) or over NATS (`NatsRuntime`).
Both take the program format of POST /v1/programs and return its response body."""
from __future__ import annotations

import asyncio
import json
import secrets
import threading
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from typing import Any


class ProgramError(Exception):
    """A program (or one node of it) failed; `code` follows HTTP."""

    def __init__(self, message: str, code: int = 500):
        super().__init__(message)
        self.code = code


class Backend(ABC):
    @abstractmethod
    def run_program(self, nodes: list[dict[str, Any]], timeout: float | None = None) -> dict[str, Any]:
        """Run one program; returns {"id", "state", "nodes": {id: {"state", "text", "output", "meta_info", ...}}}."""

    # the step-by-step interpreter's three operations, each a one-node program

    def generate(self, text: str, params: dict[str, Any]) -> dict[str, Any]:
        return self._one({"id": "gen", "text": text, "gen": params})

    def select(self, text: str, choices: list[str]) -> dict[str, Any]:
        return self._one({"id": "select", "text": text, "select": {"choices": choices}})

    def prefill(self, text: str) -> None:
        """Tell the server where a program forks: the prefix is computed (and cached) once."""
        if text:
            self._one({"id": "fork", "text": text})

    def _one(self, node: dict[str, Any]) -> dict[str, Any]:
        out = self.run_program([node])["nodes"][node["id"]]
        if out["state"] != "done":
            err = out.get("error") or {}
            raise ProgramError(err.get("message", out["state"]), err.get("code", 500))
        return out


class Runtime(Backend):
    """A radixflow server's HTTP API (standard library only)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 900.0):
        self.base_url, self.api_key, self.timeout = base_url.rstrip("/"), api_key, timeout

    def run_program(self, nodes: list[dict[str, Any]], timeout: float | None = None) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        body = {"nodes": nodes} | ({"timeout": timeout} if timeout else {})
        req = urllib.request.Request(self.base_url + "/v1/programs", data=json.dumps(body).encode(), headers=headers,
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                err = json.loads(raw)["error"]
                raise ProgramError(err["message"], err["code"]) from None
            except (ValueError, KeyError, TypeError):
                raise ProgramError(raw.decode(errors="replace")[:500], e.code) from None


class NatsRuntime(Backend):
    """The scheduler's NATS subjects directly (rf.scheduler.program), no HTTP: for clients inside
    the deployment. Runs its own event loop in a background thread."""

    def __init__(self, nats_url: str, tenant: str = "default", timeout: float = 900.0):
        from radixflow.shared.bus import Bus
        from radixflow.shared.config import BusConfig
        self.tenant, self.timeout = tenant, timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="radixflow-lang-nats", daemon=True)
        self._thread.start()
        self._bus = Bus("radixflow-lang", BusConfig(nats_url=nats_url))
        self._call(self._bus.connect())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self.timeout + 5)

    def run_program(self, nodes: list[dict[str, Any]], timeout: float | None = None) -> dict[str, Any]:
        return self._call(self._run(nodes, timeout or 0.0))

    async def _run(self, nodes: list[dict[str, Any]], timeout: float) -> dict[str, Any]:
        import msgspec

        from radixflow.services.gateway.programs import node_json
        from radixflow.shared import subjects
        from radixflow.shared.errors import RadixflowError
        from radixflow.shared.messages import ProgramAccepted, ProgramNode, ProgramRequest, StreamError
        try:
            specs = [msgspec.convert(n, ProgramNode) for n in nodes]
        except msgspec.ValidationError as e:
            raise ProgramError(f"invalid program: {e}", 400) from None
        results, state = {}, "running"
        try:
            async with self._bus.open_stream(idle_timeout_s=self.timeout) as stream:
                req = ProgramRequest(id=secrets.token_hex(16), stream_subject=stream.subject, nodes=specs,
                                     tenant=self.tenant, timeout_s=timeout)
                acc = await self._bus.request(subjects.SCHEDULER_PROGRAM, req, ProgramAccepted, timeout=120)
                async for ev in stream:
                    if isinstance(ev, StreamError):
                        raise ProgramError(ev.message, ev.code)
                    if ev.result is not None and ev.kind in ("finished", "discarded"):
                        results[ev.node] = node_json(ev.result)
                    if ev.finished:
                        state = ev.status
        except RadixflowError as e:
            raise ProgramError(e.message, e.code) from None
        return {"id": acc.id, "state": state, "nodes": results}

    def close(self) -> None:
        self._call(self._bus.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


_default: Backend | None = None


def set_default_backend(backend: Backend) -> None:
    global _default
    _default = backend


def default_backend() -> Backend:
    if _default is None:
        raise ProgramError("no backend: pass backend= or call set_default_backend(Runtime(url))", 400)
    return _default
