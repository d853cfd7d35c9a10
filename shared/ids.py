"""Request and program ids scoped by tenant.

Callers choose their own ids (SGLang's `rid`, a program's `id`), so two tenants may pick the same
one. Inside the engine (the scheduler's tables, executors, radix pins, stream bookkeeping) an id is
always `tenant/id`: beta reusing alpha's in-flight id is served as its own request, and beta's abort,
status or cancel of that id reaches only beta's. A tenant's name never contains '/' (auth.py refuses
it), so the first '/' splits the two. What leaves the engine for a caller carries the caller's id.
"""
from __future__ import annotations


def scoped(tenant: str, id: str) -> str:
    return f"{tenant}/{id}"


def unscoped(key: str) -> str:
    """The caller's id of a scoped key (a key without a tenant is returned as it is)."""
    return key.split("/", 1)[1] if "/" in key else key
