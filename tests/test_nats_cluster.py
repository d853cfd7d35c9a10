"""Multi-node on an existing engine (issue 13): NATS clustering is the distribution layer. Three
nats-server nodes routed to each other on loopback stand for three hosts; the services run as
separate processes spread over them (docs/deployment.md's several hosts: executors per GPU host, stateless
services anywhere); requests cross the cluster; a node dies with 32 streams in flight."""
from __future__ import annotations

import os
import signal

import pytest

from radixflow.services.cluster import ClusterConfig
from radixflow.shared import certs, creds
from radixflow.shared.natsd import NatsCluster, free_port

from .faults import FAST_FAILURE_ENV, serving, assert_every_stream_ended_once, assert_idle_and_serving, burst

pytestmark = pytest.mark.distributed


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
    # every node with the services' keys and permissions (shared/creds.py): no anonymous client; the
    # routes between nodes and every client over verified TLS (shared/certs.py)
    with NatsCluster(3, max_payload=8 * 1024 * 1024, auth_conf=keys.server_conf, tls=tls) as nc:
        yield nc


@pytest.fixture(scope="module")
def cluster(models, nodes, keys, tls, tmp_path_factory):
    logs = tmp_path_factory.mktemp("nats-cluster-logs")
    # host 0: the gateway, tokenizer and one executor; host 1: scheduler, grammar, radix; host 2:
    # the other executor. Each prefers its own node and fails over to the others.
    placement = {"gateway": nodes.url(0), "tokenizer": nodes.url(0), "executor-0": nodes.url(0),
                 "scheduler": nodes.url(1), "grammar": nodes.url(1), "radix": nodes.url(1),
                 "executor-1": nodes.url(2)}
    cfg = ClusterConfig(model=models["tiny-hybrid"], nats_url=nodes.url(0), placement=placement, port=free_port(),
                        counts={"executor": 2}, log_dir=str(logs), env=FAST_FAILURE_ENV | keys.env | {"RADIXFLOW_BUS_TLS_CA_FILE": tls.ca},
                        args=("--max-total-tokens", "65536"))
    with serving(cfg) as c:
        yield c


def test_requests_cross_a_three_node_nats_cluster(cluster, nodes, tls):
    # the routes are up: every node knows the other two
    assert all(n.proc.poll() is None for n in nodes.nodes)
    outs, _ = burst(cluster, n=8, max_tokens=16)
    assert [o["end"] for o in outs] == ["done"] * 8
    import asyncio
    import nats

    async def anonymous(url):
        import ssl
        with pytest.raises(Exception, match="Authorization Violation"):     # TLS, but no key
            await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0,
                               tls=ssl.create_default_context(cafile=tls.ca))
    for i in range(3):
        asyncio.run(anonymous(nodes.url(i).split(",")[0]))
    assert_idle_and_serving(cluster)


def test_kill_a_nats_node_mid_stream(cluster, nodes):
    # node 2 carries one executor; its clients fail over to nodes 0 and 1
    victim = nodes.nodes[2]
    outs, struck = burst(cluster, lambda: os.kill(victim.proc.pid, signal.SIGKILL))
    assert_every_stream_ended_once(outs, struck)
    assert_idle_and_serving(cluster)
    victim.start()          # the node comes back and rejoins the routes
    outs, _ = burst(cluster, n=4, max_tokens=8)
    assert [o["end"] for o in outs] == ["done"] * 4
