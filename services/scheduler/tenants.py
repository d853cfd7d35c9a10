"""TenantLedger: what each tenant has in flight, checked against its limits at submission.

A request (or a whole program, or all n completions of an n > 1 request) is one Ticket. The
ticket is held by everything that keeps the request alive: the submission while it is under way,
and every Tracked entry of the request table (RequestTable.add holds, RequestTable.finish lets
go). The tenant's slot and tokens come back when the last holder lets go, so n > 1 and programs
need no bookkeeping of their own, and a child that ends before its siblings are tracked cannot
release the request early.

    admit --> Ticket(refs=1) --hold/release...--> refs == 0: inflight -= 1, queued_tokens -= tokens
"""
from __future__ import annotations

from dataclasses import dataclass

from radixflow.shared.errors import BadRequest, Overloaded
from radixflow.shared.messages import Sample, TenantLimits

# A tenant at its limit waits for one of its own requests to end; we cannot know when that is, so
# the hint is a short, fixed back-off (what well-behaved clients then stretch exponentially).
RETRY_AFTER_S = 1.0


@dataclass
class TenantCounts:
    requests_total: int = 0      # admitted
    rejected_total: int = 0      # refused with 429
    inflight: int = 0
    queued_tokens: int = 0       # prompt plus the most it may generate, of what is in flight


class Ticket:
    """One admitted request's claim on its tenant's limits."""

    def __init__(self, ledger: "TenantLedger", tenant: str, tokens: int):
        self.ledger, self.tenant, self.tokens = ledger, tenant, tokens
        self.refs = 1                # the submission's own hold

    def hold(self) -> None:
        self.refs += 1

    def release(self) -> None:
        self.ledger.release(self)


class TenantLedger:
    """`share` (0 < share <= 1): the part of `capacity` (requests, tokens: this instance's queue
    bounds, times the scheduler instances alive) one tenant may hold, counted over every instance:
    its own counts plus what its peers' heartbeats last said (`peer`)."""

    def __init__(self, retry_after_s: float = RETRY_AFTER_S, share: float = 1.0, capacity: tuple[int, int] = (0, 0)):
        self.retry_after_s = retry_after_s
        self.tenants: dict[str, TenantCounts] = {}
        self.share, self.capacity = share, capacity
        self.peers: dict[str, tuple[float, dict[str, list[int]]]] = {}   # instance -> (seen at, tenant -> counts)

    def peer(self, instance: str, seen_at: float, counts: dict[str, list[int]]) -> None:
        self.peers[instance] = (seen_at, counts)

    def heartbeat(self) -> dict[str, list[int]]:
        """What this instance's beats tell its peers: each tenant's [in flight, queued tokens]."""
        return {t: [c.inflight, c.queued_tokens] for t, c in self.tenants.items() if c.inflight}

    def _share(self, now: float, alive_s: float) -> tuple[int, int]:
        """One tenant's bounds (requests, tokens; 0: none): its share of every live instance's queue."""
        live = 1 + sum(now - at <= alive_s for at, _ in self.peers.values())
        return int(self.share * self.capacity[0] * live), int(self.share * self.capacity[1] * live)

    def _elsewhere(self, tenant: str, now: float, alive_s: float) -> tuple[int, int]:
        reqs = toks = 0
        for at, counts in self.peers.values():
            if now - at <= alive_s and tenant in counts:
                reqs, toks = reqs + counts[tenant][0], toks + counts[tenant][1]
        return reqs, toks

    def admit(self, tenant: str, limits: TenantLimits | None, tokens: int, param: str = "max_new_tokens",
              now: float = 0.0, alive_s: float = 3.5) -> Ticket:
        """Count a request of `tokens` (prompt + max_new_tokens, times n for the output of n > 1)
        against `tenant`; Overloaded (429, with retry_after) when its limits or its share are reached."""
        c = self.tenants.setdefault(tenant, TenantCounts())
        lim = limits or TenantLimits()
        if lim.max_queued_tokens and tokens > lim.max_queued_tokens:
            # never admissible: a 429 would only have clients retry it forever
            raise BadRequest(f"the request holds up to {tokens} tokens; tenant {tenant!r} may have at most "
                             f"{lim.max_queued_tokens} in flight", param=param)
        why = None
        share_reqs, share_toks = self._share(now, alive_s)
        other_reqs, other_toks = self._elsewhere(tenant, now, alive_s)
        if lim.max_concurrent and c.inflight >= lim.max_concurrent:
            why = f"tenant {tenant!r} has {c.inflight} requests in flight (its limit is {lim.max_concurrent})"
        elif lim.max_queued_tokens and c.queued_tokens + tokens > lim.max_queued_tokens:
            why = (f"tenant {tenant!r} has {c.queued_tokens} tokens in flight; {tokens} more would exceed its "
                   f"limit of {lim.max_queued_tokens}")
        elif share_reqs and c.inflight + other_reqs >= share_reqs:
            why = (f"tenant {tenant!r} has {c.inflight + other_reqs} requests in flight, its share of the "
                   f"server's queue")
        elif share_toks and c.queued_tokens + other_toks and c.queued_tokens + other_toks + tokens > share_toks:
            # (holding nothing, any one request is admitted here: one too large to run at all is
            # then a 400 from the context-length check, not a 429 to retry forever)
            why = (f"tenant {tenant!r} has {c.queued_tokens + other_toks} tokens in flight; {tokens} more would "
                   f"pass its share of the server's queue ({share_toks})")
        if why is not None:
            c.rejected_total += 1
            raise Overloaded(why + "; try again later", retry_after=self.retry_after_s)
        c.requests_total += 1
        c.inflight += 1
        c.queued_tokens += tokens
        return Ticket(self, tenant, tokens)

    def release(self, ticket: Ticket) -> None:
        """Let go of one hold; the last one gives the tenant its slot and tokens back (once)."""
        if ticket.refs <= 0:
            return
        ticket.refs -= 1
        if ticket.refs == 0:
            c = self.tenants[ticket.tenant]
            c.inflight -= 1
            c.queued_tokens -= ticket.tokens

    def samples(self) -> list[Sample]:
        out = []
        for tenant, c in sorted(self.tenants.items()):
            labels = {"tenant": tenant}
            out += [Sample(name="tenant_requests_total", value=c.requests_total, labels=labels),
                    Sample(name="tenant_rejected_total", value=c.rejected_total, labels=labels),
                    Sample(name="tenant_requests_inflight", value=c.inflight, labels=labels),
                    Sample(name="tenant_queued_tokens", value=c.queued_tokens, labels=labels)]
        return out
