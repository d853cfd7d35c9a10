"""A thin typed bus over nats-py.

- messages are msgspec Structs encoded as msgpack (messages.encode / messages.decode);
- every request has an explicit timeout (BusConfig.request_timeout_s unless the caller names one);
- no responders -> ServiceUnavailable, timeout -> RequestTimeout, an ErrorReply -> the typed error;
- every payload is checked against the server's max_payload before sending: PayloadTooLarge, at once;
- the connection reconnects forever;
- streamed replies arrive on an inbox (`open_stream`) carrying sequence numbers and ending with a
  terminal item, so a lost message is detected (StreamGap) instead of waiting forever.
"""
from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
from nats.aio.msg import Msg as NatsMsg
from nats.aio.subscription import Subscription

from . import creds, log, messages
from .config import BusConfig
from .errors import (BadRequest, PayloadTooLarge, RadixflowError, RequestLost, RequestTimeout, ServiceUnavailable,
                     from_reply)
from .inbox import InboxStream
from .messages import ErrorReply, Msg, StreamBatch

T = TypeVar("T")
_log = log.get("bus")

# nats-py's protocol line and headers ride along with the payload; leave room for them.
_OVERHEAD = 512
_DRAIN_S = 2.0      # close(): the longest a drain, or the close after it, may take


async def _quietly(aw: Awaitable[Any]) -> None:
    """A nats-py drain or close whose server may be gone: its errors, a timeout and a cancellation of
    its own making are dropped. Its close can end in a cancelled internal future (the transport's
    close waiter; tests/test_bus.py's dead-server close failed so, once in a CI run): raised on, it
    ended the caller, a stack's stop, in a CancelledError as if the stop itself had been cancelled.
    A cancellation of the caller's own task still propagates. The close is bounded too: unbounded,
    one that never returned would hold the stop forever."""
    try:
        await asyncio.wait_for(aw, _DRAIN_S)
    except (nats.errors.Error, asyncio.TimeoutError, OSError):
        pass
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise


async def registered(nc: nats.NATS) -> None:
    """Returns once the server holds every subscription `nc` has made, so that another connection's
    publish finds them. One flush does not promise it: nats-py writes a flush's PING straight to the
    socket, ahead of a SUB still queued for its flusher task, and the PONG can come back before the
    SUB is read (a test's request then got "no responders" on a loaded CI machine). The first flush
    lets the flusher write what is queued; the second PING follows it on the wire."""
    await nc.flush()
    await nc.flush()


class Bus:
    def __init__(self, name: str, config: BusConfig, role: str = ""):
        self.name = name
        self.config = config
        self.role = role          # its service (the credentials and inbox it takes: shared/creds.py)
        self.inbox_prefix = creds.inbox_prefix(role) if role else "_INBOX"
        self._nc: nats.NATS | None = None
        self._closing = False
        # NATS core delivers at most once: a message in flight when the connection drops is gone.
        # Requests waiting then learn it from this (re-sent if idempotent, else failed at once),
        # and watchdogs do not count beats missed while this process itself was cut off.
        self.reconnects = 0
        self._up_since = 0.0
        self._reconnected: asyncio.Event | None = None
        # coalesced stream items (StreamBatch) arrive on one subject per connection, and go to the
        # open InboxStream each names
        self._batches = ""
        self._batches_lock = asyncio.Lock()
        self.readers: dict[str, InboxStream] = {}

    # ------------------------------------------------------------ lifecycle

    async def connect(self, wait_s: float | None = None) -> None:
        """Connect, retrying until `wait_s` (default connect_timeout_s) passes; reconnect forever after."""
        wait_s = self.config.connect_timeout_s if wait_s is None else wait_s
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            try:
                # a comma-separated list: the nodes of a NATS cluster, tried in this order (the
                # first is this service's own); the client fails over between them
                servers = [u.strip() for u in self.config.nats_url.split(",") if u.strip()]
                self._nc = await nats.connect(
                    servers=servers, name=self.name, max_reconnect_attempts=-1, dont_randomize=True,
                    reconnect_time_wait=self.config.reconnect_wait_s, connect_timeout=2,
                    allow_reconnect=True, error_cb=self._on_error, inbox_prefix=self.inbox_prefix,
                    disconnected_cb=self._on_disconnect, reconnected_cb=self._on_reconnect, **self._auth())
                self._up_since = time.monotonic()
                self._reconnected = asyncio.Event()
                return
            except (OSError, nats.errors.Error, asyncio.TimeoutError) as e:
                if asyncio.get_running_loop().time() > deadline:
                    raise ServiceUnavailable(f"cannot reach NATS at {_redacted(self.config.nats_url)}: {e}") from e
                await asyncio.sleep(0.2)

    def _auth(self) -> dict:
        """nats-py's credential and TLS options from the config (files only)."""
        c, out = self.config, {}
        if c.nkey_dir and self.role:
            out["nkeys_seed"] = creds.seed_file(c.nkey_dir, self.role)
        elif c.nkey_seed_file:
            out["nkeys_seed"] = c.nkey_seed_file
        if c.creds_file:
            out["user_credentials"] = c.creds_file
        if c.tls_ca_file or c.tls_cert_file:
            import ssl
            ctx = ssl.create_default_context(cafile=c.tls_ca_file or None)
            if c.tls_cert_file:
                ctx.load_cert_chain(c.tls_cert_file, c.tls_key_file or None)
            out["tls"] = ctx
            out["tls_handshake_first"] = c.tls_handshake_first
        return out

    async def close(self) -> None:
        """Drain (what was published goes out first), then close. A server that is gone (one
        that died, or an embedded one that a signal to the whole process group stopped first) cannot be
        drained: nats-py's drain then waits out its flush or raises, and its close raises
        ConnectionResetError; `up` exited with a traceback. What was unsent is lost either way."""
        self._closing = True
        nc = self._nc
        if nc is not None and nc.is_connected:
            # handlers still running may answer while it drains: the connection stays ours until then;
            # a live server drains in milliseconds, one that died a moment ago never answers
            await _quietly(nc.drain())
        if nc is not None and not nc.is_closed:
            await _quietly(nc.close())
        self._nc = None

    async def _on_error(self, e: Exception) -> None:
        _log.warning("nats error", error=str(e), client=self.name)

    async def _on_disconnect(self) -> None:
        if not self._closing:
            _log.warning("nats disconnected", client=self.name)

    async def _on_reconnect(self) -> None:
        _log.info("nats reconnected", client=self.name)
        self.reconnects += 1
        self._up_since = time.monotonic()
        if self._reconnected is not None:
            self._reconnected.set()
            self._reconnected = asyncio.Event()

    def settled(self, grace_s: float) -> bool:
        """Connected, and for at least `grace_s`: silence from peers means something only then."""
        return self._nc is not None and self._nc.is_connected and time.monotonic() - self._up_since >= grace_s

    @property
    def nc(self) -> nats.NATS:
        if self._nc is None:
            raise ServiceUnavailable("bus is not connected")
        return self._nc

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    # ------------------------------------------------------------ sending

    def _encode(self, msg: Msg, subject: str, as_json: bool = False) -> bytes:
        try:
            data = messages.encode_json(msg) if as_json else messages.encode(msg)
        except OverflowError:
            raise BadRequest("a number in the request is out of range (integers must lie in [-2**63, 2**64 - 1])"
                             ) from None
        limit = self.max_payload - _OVERHEAD
        if len(data) > limit:
            raise PayloadTooLarge(
                f"{type(msg).__name__} of {len(data)} bytes exceeds the NATS max_payload "
                f"({self.max_payload} bytes) on {subject}")
        return data

    async def publish(self, subject: str, msg: Msg, as_json: bool = False) -> None:
        """`as_json`: for a public-API client that asked for JSON (see messages.JSON)."""
        await self.nc.publish(subject, self._encode(msg, subject, as_json))

    async def request(self, subject: str, msg: Msg, reply: Any, *, timeout: float | None = None,
                      idempotent: bool = False, attempt_s: float | None = None) -> Any:
        """Send `msg` and decode the answer as `reply`; an ErrorReply raises the typed error.
        If the connection drops and comes back while waiting, the request or its answer may be
        lost: an `idempotent` request is sent again, any other fails at once (RequestLost).
        `attempt_s` (idempotent only): also send it again after this long without an answer (its
        responder may have died with it; a queue group hands the repeat to another)."""
        data = self._encode(msg, subject)
        timeout = self.config.request_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            left = max(deadline - time.monotonic(), 0.001)
            if idempotent and attempt_s and left > attempt_s:
                try:
                    return await self.request(subject, msg, reply, timeout=attempt_s, idempotent=True)
                except RequestTimeout:
                    continue
            reconnected = self._reconnected
            ask = asyncio.ensure_future(self.nc.request(subject, data, timeout=left))
            if reconnected is None:
                await asyncio.wait([ask])
            else:
                gone = asyncio.ensure_future(reconnected.wait())
                await asyncio.wait([ask, gone], return_when=asyncio.FIRST_COMPLETED)
                gone.cancel()
            if not ask.done():
                ask.cancel()
                if idempotent and time.monotonic() < deadline:
                    continue
                raise RequestLost(f"the connection to NATS dropped while waiting on {subject}; the request "
                                  "or its answer may be lost")
            try:
                resp = ask.result()
            except nats.errors.NoRespondersError:
                raise ServiceUnavailable(f"no service answers on {subject}") from None
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                raise RequestTimeout(f"no answer on {subject} within {timeout:g}s") from None
            break
        out = messages.decode(resp.data, reply | ErrorReply)
        if isinstance(out, ErrorReply):
            raise from_reply(out)
        return out

    async def gather(self, subject: str, msg: Msg, reply: Any, *, window_s: float = 0.25,
                     expect: int = 0, min_s: float = 0.0) -> list[Any]:
        """Scatter `msg` to every subscriber of `subject`; collect the answers that arrive within
        `window_s`, or until `expect` of them have (a busy instance can answer late, and a caller
        that knows how many there are should not miss one for a fixed short window), but for at
        least `min_s` (a caller that knows only some of the instances still hears from the prompt
        others). Errors and undecodable answers are skipped."""
        inbox = self.nc.new_inbox()
        got: list[bytes] = []
        enough = asyncio.Event()

        async def on_reply(m: NatsMsg) -> None:
            got.append(m.data)
            if expect and len(got) >= expect:
                enough.set()
        sub = await self.nc.subscribe(inbox, cb=on_reply)
        try:
            t0 = time.monotonic()
            await self.nc.publish(subject, self._encode(msg, subject), reply=inbox)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(enough.wait(), window_s)
            # a loop, not one sleep: a timer may fire early (uvloop's, at millisecond resolution, did)
            while (left := min(min_s, window_s) - (time.monotonic() - t0)) > 0:
                await asyncio.sleep(max(left, 0.001))
        finally:
            await sub.unsubscribe()
        out = []
        for data in got:
            try:
                item = messages.decode(data, reply | ErrorReply)
            except Exception:
                continue
            if not isinstance(item, ErrorReply):
                out.append(item)
        return out

    async def respond(self, request: NatsMsg, msg: Msg) -> None:
        """Answer a request (in JSON if it came in JSON); an oversize answer becomes a 413
        ErrorReply instead of silence."""
        if not request.reply:
            return
        as_json = is_json(request)
        try:
            data = self._encode(msg, request.reply, as_json)
        except PayloadTooLarge as e:
            data = messages.encode_json(e.to_reply()) if as_json else messages.encode(e.to_reply())
        await self.nc.publish(request.reply, data)

    # ------------------------------------------------------------ receiving

    async def subscribe(self, subject: str, cb: Callable[[NatsMsg], Awaitable[None]], queue: str = "") -> Subscription:
        return await self.nc.subscribe(subject, queue=queue, cb=cb)

    def open_stream(self, idle_timeout_s: float | None = None, batched: bool = False) -> "InboxStream":
        """`batched`: the stream also takes its items coalesced with other streams' (its
        batch_subject goes in the request's stream_batch)."""
        return InboxStream(self, idle_timeout_s, batched)

    async def batch_subject(self) -> str:
        """This connection's subject for StreamBatch messages, subscribed on first use."""
        async with self._batches_lock:
            if not self._batches:
                subject = f"{self.inbox_prefix}.rf.b{secrets.token_hex(12)}"
                await self.nc.subscribe(subject, cb=self._on_batch)
                self._batches = subject
        return self._batches

    async def _on_batch(self, m: NatsMsg) -> None:
        try:
            batch = messages.decode(m.data, StreamBatch)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            _log.warning("malformed stream batch", error=str(e)[:200])
            return
        now = time.monotonic()
        for subject, item in zip(batch.subjects, batch.items):
            reader = self.readers.get(subject)
            if reader is not None:        # else: a stream already closed (its client left)
                reader.heard_at = now
                reader.put(item, heard=False)


def is_json(m: NatsMsg) -> bool:
    if not m.headers:
        return False
    ct = next((v for k, v in m.headers.items() if k.lower() == "content-type"), "")
    return ct.split(";")[0].strip().lower() == messages.JSON


__all__ = ["Bus", "InboxStream", "RadixflowError"]


def _redacted(url: str) -> str:
    """A NATS URL list without the user:password parts (logs and errors are read by others)."""
    import re
    return re.sub(r"//[^/@,]*@", "//***@", url)
