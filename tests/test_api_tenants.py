"""Keys and tenants over HTTP against a live server: 401s in OpenAI's shape, isolated cache
namespaces, shared groups, server-side salts, per-tenant flush, admin flush, 429 with Retry-After
past a tenant's limit while other tenants are served, per-tenant counters in /metrics."""
from __future__ import annotations

import asyncio
import json

import pytest

from radixflow.services.gateway.auth import Keys

from .stacks import start, stop

PRE = "You are a meticulous assistant with these tools: search, calculator, calendar. " * 12
KEYS = {"keys": {
    "key-a": {"tenant": "alpha"},
    "key-b": {"tenant": "beta"},
    "key-c1": {"tenant": "gamma", "group": "team"},
    "key-c2": {"tenant": "delta", "group": "team"},
    "key-salted": {"tenant": "eps", "group": "team", "cache_salt": "eps-only"},
    "key-small": {"tenant": "small", "limits": {"max_concurrent": 1, "max_queued_tokens": 4000}},
    "key-admin": {"tenant": "ops", "role": "admin"},
    "key-team": {"tenant": "team"}}}


@pytest.fixture(scope="module")
async def server(models, tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "keys.json"
    path.write_text(json.dumps(KEYS))
    st = await start(models["tiny-dense"], gw_auth_file=str(path))
    yield st
    await stop(st)


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def complete(st, key: str | None, prompt: str = PRE + " Question one.", **extra) -> tuple[int, dict]:
    body = {"model": "tiny-dense", "prompt": prompt, "max_tokens": 2, "temperature": 0} | extra
    async with st.http.post(st.base + "/v1/completions", json=body, headers=auth(key) if key else {}) as r:
        return r.status, await r.json()


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_missing_or_wrong_key_is_401(server):
    for key in (None, "wrong", "key-", "key-aa"):
        st, body = await complete(server, key)
        assert st == 401 and body["error"]["type"] == "authentication_error" and body["error"]["code"] == 401
    async with server.http.get(server.base + "/v1/models") as r:
        assert r.status == 401
    async with server.http.get(server.base + "/health") as r:       # health stays open to probes
        assert r.status == 200


async def test_tenants_are_isolated_and_groups_share(server):
    prompt = PRE + " Isolation."
    await complete(server, "key-a", prompt)
    st, a2 = await complete(server, "key-a", prompt)
    st, b = await complete(server, "key-b", prompt)
    assert cached(a2) > 0 and cached(b) == 0
    await complete(server, "key-c1", prompt + " group")
    st, c2 = await complete(server, "key-c2", prompt + " group")
    assert cached(c2) > 0                                    # gamma and delta share the group "team"
    st, eps = await complete(server, "key-salted", prompt + " group")
    assert cached(eps) == 0                                  # same group, but a forced salt of its own
    st, eps_borrow = await complete(server, "key-c1", prompt + " group", cache_salt="eps-only")
    st, eps2 = await complete(server, "key-salted", prompt + " group")
    assert cached(eps2) > 0 and cached(eps_borrow) == 0      # naming eps's salt does not reach its namespace
    # a group member's flush empties what the group shares, not another member's salted namespace
    await complete(server, "key-admin", "unrelated")         # the releases above have landed
    async with server.http.post(server.base + "/flush_cache", headers=auth("key-c1")) as r:
        assert r.status == 200
    st, c1 = await complete(server, "key-c1", prompt + " group")
    st, eps3 = await complete(server, "key-salted", prompt + " group")
    assert cached(c1) == 0 and cached(eps3) > 0
    # a tenant named like a group does not share the group's cache
    st, team = await complete(server, "key-team", prompt + " group")
    assert cached(team) == 0


async def test_flush_is_per_tenant_and_all_needs_admin(server):
    prompt = PRE + " Flush."
    await complete(server, "key-a", prompt)
    await complete(server, "key-b", prompt)
    # an executor releases a finished request's pages in its next exchange with radix, and a flush
    # frees only unlocked pages: one more request makes sure those releases have landed
    await complete(server, "key-admin", "unrelated")
    async with server.http.post(server.base + "/flush_cache", json={}, headers=auth("key-b")) as r:
        assert r.status == 200
    st, a = await complete(server, "key-a", prompt)
    st, b = await complete(server, "key-b", prompt)
    assert cached(a) > 0 and cached(b) == 0
    async with server.http.post(server.base + "/flush_cache", json={"all": True}, headers=auth("key-a")) as r:
        assert r.status == 403 and (await r.json())["error"]["type"] == "permission_error"
    await complete(server, "key-admin", "unrelated again")
    async with server.http.post(server.base + "/flush_cache", json={"all": True}, headers=auth("key-admin")) as r:
        assert r.status == 200
    st, a = await complete(server, "key-a", prompt)
    assert cached(a) == 0


async def test_limits_are_429_while_others_are_served(server):
    body = {"model": "tiny-dense", "prompt": PRE, "max_tokens": 48, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with server.http.post(server.base + "/v1/completions", json=body, headers=auth("key-small")) as first:
        assert first.status == 200
        await first.content.readline()                      # accepted and streaming: it holds the one slot
        st, second = await complete(server, "key-small", PRE + " again")
        assert st == 429 and second["error"]["code"] == 429
        st, other = await complete(server, "key-a", PRE + " meanwhile")
        assert st == 200
        async for _ in first.content:
            pass
    st, after = await complete(server, "key-small", PRE + " after")
    assert st == 200
    async with server.http.post(server.base + "/v1/completions", headers=auth("key-small"), json={
            "model": "tiny-dense", "prompt": "x y z", "max_tokens": 4000}) as r:   # more than its queued-token limit
        assert r.status in (400, 429) and "token" in (await r.json())["error"]["message"]


async def test_retry_after_header(server):
    body = {"model": "tiny-dense", "prompt": PRE, "max_tokens": 48, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with server.http.post(server.base + "/v1/completions", json=body, headers=auth("key-small")) as first:
        await first.content.readline()
        async with server.http.post(server.base + "/v1/completions", headers=auth("key-small"), json={
                "model": "tiny-dense", "prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
        async for _ in first.content:
            pass


async def test_metrics_per_tenant(server):
    await complete(server, "key-a")
    await asyncio.sleep(0.1)
    async with server.http.get(server.base + "/metrics", headers=auth("key-admin")) as r:
        text = await r.text()
    assert 'radixflow_http_requests_total{' in text and 'tenant="alpha"' in text
    assert "key-a" not in text                                # keys are never exposed
    assert 'radixflow_tenant_requests_total{' in text


def test_keys_file_forms(tmp_path):
    toml = tmp_path / "keys.toml"
    toml.write_text('[keys.k1]\ntenant = "alpha"\nrole = "admin"\n[keys.k2]\ntenant = "beta"\ngroup = "g"\n'
                    '[keys.k2.limits]\nmax_concurrent = 2\n')
    keys = Keys.load(str(toml), ("k3:gamma",))
    assert keys.principal("Bearer k1").role == "admin" and keys.principal("Bearer k2").scope == "g:g"
    assert keys.principal("Bearer k2").limits.max_concurrent == 2 and keys.principal("bearer k3").tenant == "gamma"
    # an --api-key of a tenant the file limits takes the file's limits
    assert Keys.load(str(toml), ("k4:beta",)).principal("Bearer k4").limits.max_concurrent == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"keys": {"sk-secret": {"tenant": "a/b"}}}))
    with pytest.raises(ValueError) as e:
        Keys.load(str(bad))
    assert "sk-secret" not in str(e.value)                   # errors name the entry, never the key
    bad.write_text(json.dumps({"keys": {"sk-secret": {"tenant": "a", "role": "root"}}}))
    with pytest.raises(ValueError):
        Keys.load(str(bad))
    bad.write_text(json.dumps({"keys": {"k1": {"tenant": "a", "group": "g", "limits": {"max_cached_pages": 5}},
                                        "k2": {"tenant": "b", "group": "g"}}}))
    with pytest.raises(ValueError, match="max_cached_pages"):
        Keys.load(str(bad))                                  # a page quota limits the whole group
    assert not Keys.load()                                   # no keys: auth off
