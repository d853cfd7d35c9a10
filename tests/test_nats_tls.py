"""TLS for NATS (shared/certs.py): the nodes of a cluster route to each other over verified TLS, a
node without the deployment's certificate cannot join, and clients must speak TLS. Real
nats-servers on loopback; the whole stack over such a cluster is tests/test_nats_cluster.py."""
from __future__ import annotations

import asyncio
import os
import ssl
import stat

import nats
import pytest

from radixflow.shared import certs, creds, subjects
from radixflow.shared.bus import Bus, registered
from radixflow.shared.config import BusConfig
from radixflow.shared.natsd import NatsCluster, NatsServer, free_port


@pytest.fixture(scope="module")
def keys():
    k = creds.Ephemeral()
    yield k
    k.close()


@pytest.fixture(scope="module")
def tls(keys):
    return certs.generate(keys.dir)


@pytest.fixture(scope="module")
def nodes(keys, tls):
    with NatsCluster(2, auth_conf=keys.server_conf, tls=tls) as nc:
        yield nc


def test_the_files(keys, tls):
    assert stat.S_IMODE(os.stat(tls.key).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(tls.key)).st_mode) == 0o700
    conf = open(os.path.join(keys.dir, "tls.conf")).read()
    assert tls.cert in conf and "verify" not in conf
    assert "verify: true" in open(os.path.join(keys.dir, "route_tls.conf")).read()
    # the node certificate is the CA's, and names loopback
    ctx = ssl.create_default_context(cafile=tls.ca)
    ctx.load_cert_chain(tls.cert, tls.key)


async def connect(url, keydir, role, tls_ca=None, **kw):
    ctx = ssl.create_default_context(cafile=tls_ca) if tls_ca else None
    return await nats.connect(url, nkeys_seed=creds.seed_file(keydir, role), inbox_prefix=creds.inbox_prefix(role),
                              tls=ctx, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3, **kw)


async def crosses(sub_url, pub_url, keys, tls_ca, timeout_s=10.0) -> bool:
    """A scheduler's subscription on one node hears a gateway's submit published on the other."""
    sched = await connect(sub_url, keys.dir, "scheduler", tls_ca)
    gw = await connect(pub_url, keys.dir, "gateway", tls_ca)
    try:
        heard = asyncio.Event()

        async def on(msg):
            heard.set()
        await sched.subscribe(subjects.SCHEDULER_SUBMIT, cb=on)
        await registered(sched)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            await gw.publish(subjects.SCHEDULER_SUBMIT, b"{}")
            await gw.flush()
            try:
                await asyncio.wait_for(heard.wait(), 0.2)
                return True
            except asyncio.TimeoutError:
                pass
        return False
    finally:
        await sched.close()
        await gw.close()


async def test_routes_carry_messages_over_tls(nodes, keys, tls):
    a, b = (n.url for n in nodes.nodes)
    assert await crosses(a, b, keys, tls.ca)
    assert await crosses(b, a, keys, tls.ca)


async def test_a_plain_client_is_refused(nodes, keys, tls):
    """The right key without TLS: the server requires TLS before it reads a CONNECT."""
    with pytest.raises(Exception):
        await connect(nodes.nodes[0].url, keys.dir, "gateway")
    # and TLS to a server whose certificate is not the CA's fails the client's check
    other = certs.generate(os.path.join(keys.dir, "other"))
    with pytest.raises(Exception):
        await connect(nodes.nodes[0].url, keys.dir, "gateway", other.ca)


@pytest.mark.parametrize("rogue_tls", ["none", "another CA"])
async def test_a_node_without_the_deployments_certificate_cannot_join(nodes, keys, tls, rogue_tls):
    """A nats-server that routes into the cluster without a certificate of the deployment's CA
    (plain TCP, or TLS with another CA's) hears nothing of it: what a client publishes on the
    cluster does not reach the rogue's subscribers."""
    other = certs.generate(os.path.join(keys.dir, "rogue")) if rogue_tls != "none" else None
    port = nodes.nodes[0].cluster_port
    rogue = NatsServer(cluster_port=free_port(), routes=[f"nats://127.0.0.1:{port}"], name="rogue", tls=other)
    with rogue:
        ctx = ssl.create_default_context(cafile=other.ca) if other else None
        spy = await nats.connect(rogue.url, tls=ctx, allow_reconnect=False, connect_timeout=3)
        try:
            heard = []

            async def on(msg):
                heard.append(msg.subject)
            await spy.subscribe(">", cb=on)
            await registered(spy)
            gw = await connect(nodes.nodes[0].url, keys.dir, "gateway", tls.ca)
            try:
                for _ in range(10):           # over 2 s: time for a route to form, if it could
                    await gw.publish(subjects.SCHEDULER_SUBMIT, b"prompt")
                    await gw.flush()
                    await asyncio.sleep(0.2)
            finally:
                await gw.close()
            assert heard == []
        finally:
            await spy.close()
    # the cluster itself still routes
    assert await crosses(nodes.nodes[1].url, nodes.nodes[0].url, keys, tls.ca)


async def test_a_service_connects_with_the_ca(nodes, keys, tls):
    """BusConfig's TLS options (RADIXFLOW_BUS_TLS_CA_FILE in a deployment): a Bus connects."""
    bus = Bus("t", BusConfig(nats_url=nodes.url(0), nkey_dir=keys.dir, tls_ca_file=tls.ca), role="gateway")
    await bus.connect()
    try:
        assert bus._nc.is_connected and bus._nc.connected_url.port == nodes.nodes[0].port
    finally:
        await bus.close()


async def test_radixflow_creds_tls_makes_a_deployments_node(tmp_path):
    """The steps of docs/security.md: `radixflow creds DIR --tls`, a nats-server configuration that includes
    auth.conf, tls.conf and (in its cluster block) route_tls.conf, and a service with its key and the CA."""
    import subprocess
    import sys
    import time
    from radixflow.shared.natsd import find_binary
    d = tmp_path / "secrets"
    cli = [sys.executable, "-m", "radixflow.services.cli.main", "creds", str(d), "--tls"]
    out = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
    assert "RADIXFLOW_BUS_TLS_CA_FILE=" in out and (d / "tls" / "ca.pem").exists()
    port, cport = free_port(), free_port()
    (d / "node.conf").write_text(f"port: {port}\nhost: 127.0.0.1\ninclude auth.conf\ninclude tls.conf\n"
                                 f"cluster {{\n  name: rf\n  listen: 127.0.0.1:{cport}\n  include route_tls.conf\n}}\n")
    proc = subprocess.Popen([find_binary(), "-c", str(d / "node.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        import socket
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        bus = Bus("t", BusConfig(nats_url=f"nats://127.0.0.1:{port}", nkey_dir=str(d),
                                 tls_ca_file=str(d / "tls" / "ca.pem")), role="scheduler")
        await bus.connect()
        await bus.close()
        with pytest.raises(Exception):
            await connect(f"nats://127.0.0.1:{port}", str(d), "scheduler")      # no TLS: refused
    finally:
        proc.terminate()
        proc.wait(5)
    # a container's paths in the server's files; the files themselves where they were written
    subprocess.run(cli + ["--tls-server-dir", "/etc/nats/tls"], capture_output=True, check=True)
    assert '"/etc/nats/tls/node.pem"' in (d / "route_tls.conf").read_text()
    assert (d / "tls" / "node.pem").exists()
