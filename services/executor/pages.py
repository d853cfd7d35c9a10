"""PageAuthority: how an executor gets KV pages. The radix service is the single authority over
which pages are free; the executor asks once per step (all admissions, progress and releases of
that step in one RadixStep) and never frees a page on its own.

Two siblings with one contract: LocalPages runs the PagePool in-process (the bus-free Engine, and
tests); RemotePages asks the radix service over NATS, blocking the compute thread, never the loop.
"""
from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import msgspec

from radixflow.services.radix.pool import PagePool
from radixflow.shared import messages, subjects
from radixflow.shared.errors import NotFound, ServiceUnavailable
from radixflow.shared.messages import HeldPages, RadixAdopt, RadixRegister, RadixRegistered, RadixStep, RadixStepReply


HELD_BYTES = 256 * 1024    # per register/adopt message: well under NATS's default 1 MiB max_payload


def held_parts(held: list[HeldPages], budget: int | None = None) -> list[list[HeldPages]]:
    """`held` in consecutive parts of at most `budget` encoded bytes each (one request alone may be
    more); always at least one part, maybe empty."""
    budget = HELD_BYTES if budget is None else budget
    parts: list[list[HeldPages]] = [[]]
    size = 0
    for h in held:
        n = len(messages.encode(h))
        if parts[-1] and size + n > budget:
            parts.append([])
            size = 0
        parts[-1].append(h)
        size += n
    return parts


class PageAuthority(ABC):
    @abstractmethod
    def register(self, msg: RadixRegister) -> bool:
        """(Re)create this executor's pool: every page and state slot free but those `msg.held`
        names, nothing cached but their computed prefixes. True if the authority takes candidates
        without their prompts (Candidate.known)."""

    @abstractmethod
    def step(self, msg: RadixStep) -> RadixStepReply:
        """Apply releases, then progress, then admit candidates (all-or-nothing each). Raises a
        RadixflowError when the authority cannot be reached; NotFound when it lost this pool."""

    def send(self, msg: RadixStep) -> Callable[[], RadixStepReply]:
        """`step` without waiting: returns a call that gives its reply (or raises its error), so the
        executor can compute while the authority answers (overlap). Messages are answered in order;
        the executor keeps at most one in flight."""
        try:
            reply = self.step(msg)
        except Exception as e:
            def fail(e=e):
                raise e
            return fail
        return lambda: reply

    def stats(self) -> dict[str, int]:
        return {}


class LocalPages(PageAuthority):
    def __init__(self) -> None:
        self.pool: PagePool | None = None

    def register(self, msg: RadixRegister) -> bool:
        self.pool = PagePool(msg.num_pages, msg.page_size, msg.cache, msg.num_state_slots, msg.checkpoint_interval,
                             msg.tier_root, msg.tier_load_pages)
        self.pool.adopt(msg.held)
        return True

    def step(self, msg: RadixStep) -> RadixStepReply:
        if self.pool is None:     # forgotten, as a restarted radix service forgets (tests)
            raise NotFound(f"unknown pool {msg.pool!r}: register first")
        return self.pool.step(msg)

    def stats(self) -> dict[str, int]:
        return self.pool.stats() if self.pool else {}


class RemotePages(PageAuthority):
    """Called from the compute thread; the request runs on the service's event loop."""

    def __init__(self, bus, loop: asyncio.AbstractEventLoop, pool: str, timeout_s: float = 10.0):
        self.bus, self.loop, self.pool, self.timeout_s = bus, loop, pool, timeout_s

    def _call(self, subject: str, msg, reply):
        fut = asyncio.run_coroutine_threadsafe(self.bus.request(subject, msg, reply, timeout=self.timeout_s), self.loop)
        return fut.result(self.timeout_s + 1)

    def register(self, msg: RadixRegister, wait_s: float = 30.0) -> bool:
        """Register, waiting (bounded) for the radix service to come up: services start in any order.
        What running requests hold goes in parts of about HELD_BYTES (RadixAdopt after the first)."""
        deadline = time.monotonic() + wait_s
        first, *rest = held_parts(msg.held)
        msg = msgspec.structs.replace(msg, pool=self.pool, held=first)
        while True:
            try:
                reply = self._call(subjects.RADIX_REGISTER, msg, RadixRegistered)
                break
            except ServiceUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        for part in rest:
            self._call(subjects.RADIX_ADOPT, RadixAdopt(pool=self.pool, held=part), RadixRegistered)
        return reply.known_candidates

    def step(self, msg: RadixStep) -> RadixStepReply:
        return self.send(msg)()

    def send(self, msg: RadixStep):
        fut = asyncio.run_coroutine_threadsafe(
            self.bus.request(subjects.radix_step(self.pool), msg, RadixStepReply, timeout=self.timeout_s), self.loop)
        return lambda: fut.result(self.timeout_s + 1)
