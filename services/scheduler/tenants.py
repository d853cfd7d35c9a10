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
    def __init__(self, retry_after_s: float = RETRY_AFTER_S):
        self.retry_after_s = retry_after_s
        self.tenants: dict[str, TenantCounts] = {}

    def admit(self, tenant: str, limits: TenantLimits | None, tokens: int, param: str = "max_new_tokens") -> Ticket:
        """Count a request of `tokens` (prompt + max_new_tokens, times n for the output of n > 1)
        against `tenant`; Overloaded (429, with retry_after) when its limits are reached."""
        c = self.tenants.setdefault(tenant, TenantCounts())
        lim = limits or TenantLimits()
        if lim.max_queued_tokens and tokens > lim.max_queued_tokens:
            # never admissible: a 429 would only have clients retry it forever
            raise BadRequest(f"the request holds up to {tokens} tokens; tenant {tenant!r} may have at most "
                             f"{lim.max_queued_tokens} in flight", param=param)
        why = None
        if lim.max_concurrent and c.inflight >= lim.max_concurrent:
            why = f"tenant {tenant!r} has {c.inflight} requests in flight (its limit is {lim.max_concurrent})"
        elif lim.max_queued_tokens and c.queued_tokens + tokens > lim.max_queued_tokens:
            why = (f"tenant {tenant!r} has {c.queued_tokens} tokens in flight; {tokens} more would exceed its "
                   f"limit of {lim.max_queued_tokens}")
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
