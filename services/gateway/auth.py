"""API keys and tenants.

Keys come from a file (`--auth-file`, JSON or TOML) or from `--api-key KEY[:TENANT]`:

    {"keys": {"KEY": {"tenant": "alpha", "role": "user", "group": "team",
                      "cache_salt": "s3cret", "limits": {"max_concurrent": 8, ...}}}}

A tenant's cache namespaces are its own, unless `group` names a cache scope it shares with the
other tenants of that group. `cache_salt` is forced server-side: a client's own salt is appended
to it, so within a group one tenant cannot borrow another's salted namespace. Keys are compared in
constant time (every key, every time) and never logged; the tenant name is what logs and metrics see.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass

import msgspec

from radixflow.shared.errors import Forbidden, Unauthorized
from radixflow.shared.messages import TenantLimits

# no "/" (it separates a namespace's owner from its salt) and no ":" (a group's scope is "g:<group>",
# so that no tenant name can be a group's scope)
NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


@dataclass(frozen=True)
class Principal:
    tenant: str
    role: str = "user"                 # user | admin (admin: flush every tenant's cache)
    group: str = ""                    # shared cache scope ("": the tenant's own)
    cache_salt: str = ""               # forced server-side salt ("": none)
    limits: TenantLimits | None = None

    @property
    def scope(self) -> str:
        """The owner of its cache namespaces: the tenant, or "g:<group>" for a shared group."""
        return f"g:{self.group}" if self.group else self.tenant

    def flushable(self) -> list[str]:
        """The namespaces this principal's flush empties: those it can reach (RadixFlush.namespaces).
        In a group, those are the group's unsalted and client-salted ones, not another member's
        forced-salt namespace."""
        if self.cache_salt:
            return [f"{self.scope}/s:{self.cache_salt}", f"{self.scope}/s:{self.cache_salt}|*"]
        return [self.scope, f"{self.scope}/c:*"]

    def salt(self, client_salt: str | None) -> str | None:
        """The namespace salt: the forced one, then the client's. The two are marked apart ("s:" and
        "c:"), so that no salt a client sends can spell a namespace with another tenant's forced salt."""
        client = f"c:{client_salt}" if client_salt else ""
        if not self.cache_salt:
            return client or None
        return f"s:{self.cache_salt}" + (f"|{client}" if client else "")

    def require_admin(self, what: str) -> None:
        if self.role != "admin":
            raise Forbidden(f"{what} needs an admin key")


OPEN = Principal(tenant="default", role="admin")    # auth off: one tenant, who may do everything


class _KeySpec(msgspec.Struct, forbid_unknown_fields=True):
    tenant: str
    role: str = "user"
    group: str = ""
    cache_salt: str = ""
    limits: TenantLimits | None = None


class _KeyFile(msgspec.Struct, forbid_unknown_fields=True):
    keys: dict[str, _KeySpec]


class Keys:
    def __init__(self, by_key: dict[str, Principal]):
        # only digests are kept: equal length, so comparing them leaks nothing of a key's prefix
        self._entries = [(hashlib.sha256(k.encode()).digest(), p) for k, p in by_key.items()]

    def __bool__(self) -> bool:
        return bool(self._entries)

    @classmethod
    def load(cls, auth_file: str = "", api_keys: tuple[str, ...] = ()) -> "Keys":
        by_key: dict[str, Principal] = {}
        if auth_file:
            by_key.update(_read(auth_file))
        for spec in api_keys:
            key, _, tenant = spec.partition(":")
            if not key:
                raise ValueError("an --api-key is empty")
            tenant = _name(tenant or "default", "tenant")
            # a tenant the file knows keeps its limits with a key given here too
            limits = next((p.limits for p in by_key.values() if p.tenant == tenant), None)
            by_key[key] = Principal(tenant=tenant, limits=limits)
        _check_limits(by_key.values())
        return cls(by_key)

    def principal(self, authorization: str) -> Principal:
        """The caller behind an `Authorization: Bearer KEY` header; 401 without a valid key."""
        if not self._entries:
            return OPEN
        token = authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for d, p in self._entries:       # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(d, digest):
                found = p
        if found is None or not token:
            raise Unauthorized("a valid API key is required (Authorization: Bearer <key>)")
        return found


def secret(value: str, path: str) -> str:
    """A secret given in the environment (value) or in a file (its first line)."""
    if path:
        with open(path) as f:
            value = f.readline().strip()
        if not value:
            raise ValueError(f"{path} is empty")
    return value


def _name(v: str, what: str) -> str:
    if not NAME.fullmatch(v):
        raise ValueError(f"{what} {v!r} must be 1-64 letters, digits or _.:@- (no '/')")
    return v


def _read(path: str) -> dict[str, Principal]:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        if os.path.splitext(path)[1].lower() == ".toml":
            import tomllib
            data = msgspec.convert(tomllib.loads(raw.decode()), _KeyFile)
        else:
            data = msgspec.json.decode(raw, type=_KeyFile)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    out = {}
    for i, (key, s) in enumerate(data.keys.items()):
        where = f"{path}: key #{i + 1}"     # never the key itself
        if not key:
            raise ValueError(f"{where} is empty")
        if s.role not in ("user", "admin"):
            raise ValueError(f"{where}: role must be user or admin, got {s.role!r}")
        out[key] = Principal(tenant=_name(s.tenant, f"{where}: tenant"), role=s.role,
                             group=_name(s.group, f"{where}: group") if s.group else "",
                             cache_salt=s.cache_salt, limits=s.limits)
    return out


def _check_limits(principals) -> None:
    """Limits belong to a tenant: its keys must not disagree. A page quota counts a cache scope's
    pages, so the members of a group must agree on it."""
    seen: dict[str, TenantLimits | None] = {}
    quota: dict[str, int] = {}
    for p in principals:
        if p.tenant in seen and seen[p.tenant] != p.limits:
            raise ValueError(f"tenant {p.tenant!r} has keys with different limits")
        seen[p.tenant] = p.limits
        q = p.limits.max_cached_pages if p.limits else 0
        if p.group and quota.setdefault(p.group, q) != q:
            raise ValueError(f"the tenants of group {p.group!r} have different max_cached_pages (it limits the group)")
