"""compose.yaml is checked, not just shipped (issue 13): against the Compose specification (the
compose-spec JSON Schema that check-jsonschema vendors), for the invariants the services need, and
by running each of its services' commands, with their environment, as local processes against a
local nats-server configured from the file's own NATS config. Docker is not available here."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from radixflow.services.cluster import ClusterConfig
from radixflow.shared import creds
from radixflow.services.stack import ORDER
from radixflow.shared.natsd import find_binary, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPOSE = os.path.join(ROOT, "compose.yaml")
BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def compose() -> dict:
    with open(COMPOSE) as f:
        return yaml.safe_load(f)      # merge keys (<<: *service) resolved


def spec_check(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(BIN, "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", path],
                          capture_output=True, text=True, timeout=120)


def test_compose_file_follows_the_compose_specification(tmp_path):
    ok = spec_check(COMPOSE)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # the check can fail: a misspelt key is caught
    bad = tmp_path / "compose.yaml"
    bad.write_text(open(COMPOSE).read().replace("    healthcheck:", "    helthcheck:", 1))
    res = spec_check(str(bad))
    assert res.returncode != 0 and "helthcheck" in res.stdout + res.stderr


def nats_conf(compose: dict) -> dict[str, str]:
    conf = compose["configs"]["nats_conf"]["content"]
    return dict(re.findall(r"^\s*(\w+):\s*(\S+)\s*$", conf, re.M))


def test_compose_layout_matches_the_cluster(compose):
    svcs = compose["services"]
    assert set(ORDER) <= set(svcs), set(ORDER) - set(svcs)
    # NATS: the max_payload `radixflow up` and `up --processes` give it, and a health check
    assert int(nats_conf(compose)["max_payload"]) == ClusterConfig(model="").max_payload == 8 * 1024 * 1024
    assert "healthcheck" in svcs["nats"]
    for name in ORDER:
        s = svcs[name]
        assert s["depends_on"]["nats"]["condition"] == "service_healthy", name
        assert s["depends_on"]["model-init"]["condition"] == "service_completed_successfully", name
        assert s["command"][:2] == ["service", name], name
        assert s["restart"] == "unless-stopped", name
    # executors scale (--scale executor=N): nothing that two containers could not share
    assert "container_name" not in svcs["executor"] and "ports" not in svcs["executor"]
    assert "healthcheck" in svcs["gateway"]
    assert re.search(r'ENTRYPOINT \["radixflow"\]', open(os.path.join(ROOT, "Dockerfile")).read())


def test_compose_and_image_are_hardened(compose):
    """Closed by default: only the gateway publishes a port, and it serves with keys; every service
    has a health check and resource limits; the image runs unprivileged, without a compiler."""
    svcs = compose["services"]
    assert [n for n, s in svcs.items() if s.get("ports")] == ["gateway"]
    assert svcs["gateway"]["environment"]["RADIXFLOW_GATEWAY_AUTH_FILE"].startswith("/run/secrets/")
    assert svcs["gateway"]["secrets"] == ["radixflow_keys", "nats_gateway"]
    for name in ORDER:        # each service holds its own NATS key, and only that one
        assert [x for x in svcs[name]["secrets"] if x.startswith("nats_")] == [f"nats_{name}"], name
        assert svcs[name]["environment"]["RADIXFLOW_BUS_NKEY_SEED_FILE"] == f"/run/secrets/nats_{name}"
    for name, s in svcs.items():
        assert s.get("deploy", {}).get("resources", {}).get("limits", {}).get("memory"), name
        if name != "model-init":
            assert "healthcheck" in s, name
    docker = open(os.path.join(ROOT, "Dockerfile")).read()
    runtime = docker.rsplit("\nFROM ", 1)[1]                   # the last stage: what runs
    assert re.search(r"^USER (?!root)\S+", runtime, re.M) and "g++" not in runtime and "apt-get" not in runtime
    ignored = open(os.path.join(ROOT, ".dockerignore")).read().split()
    assert {".git", ".venv", "deploy/secrets"} <= set(ignored)


def test_the_alive_health_check(tmp_path):
    f = tmp_path / "alive"
    cli = os.path.join(BIN, "radixflow")
    assert subprocess.run([cli, "alive", str(f)], capture_output=True).returncode == 1     # no beat yet
    f.touch()
    assert subprocess.run([cli, "alive", str(f)], capture_output=True).returncode == 0
    os.utime(f, (time.time() - 60, time.time() - 60))
    assert subprocess.run([cli, "alive", str(f), "--max-age", "15"], capture_output=True).returncode == 1


def test_compose_commands_serve_as_local_processes(compose, models, tmp_path):
    """Each compose service's own command and environment, as a local process: NATS and the
    model path mapped to local ones, the executor twice (--scale executor=2). A request goes through."""
    svcs = compose["services"]
    keydir = tmp_path / "secrets"
    creds.generate(keydir)                               # what `radixflow creds deploy/secrets` writes
    conf = keydir / "nats.conf"                          # beside auth.conf, which it includes
    assert "include auth.conf" in compose["configs"]["nats_conf"]["content"]
    conf.write_text(f"max_payload: {nats_conf(compose)['max_payload']}\ninclude auth.conf\n")
    nport, hport = free_port(), free_port()
    url = f"nats://127.0.0.1:{nport}"

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"compose-key": {"tenant": "t"}}}))
    auth = {"Authorization": "Bearer compose-key"}

    def local(x: str) -> str:
        for role in ORDER:
            x = x.replace(f"/run/secrets/nats_{role}", str(keydir / f"{role}.nk"))
        return (x.replace("nats://nats:4222", url).replace("/models/tiny-hybrid", models["tiny-hybrid"])
                .replace("0.0.0.0", "127.0.0.1").replace("/run/secrets/radixflow_keys", str(keys))
                .replace("/tmp/radixflow.alive", str(tmp_path / "alive")))
    procs = [subprocess.Popen([find_binary(), "-a", "127.0.0.1", "-p", str(nport), "-c", str(conf)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)]
    logs = []
    try:
        for name in ORDER:
            s = svcs[name]
            argv = [os.path.join(BIN, "radixflow")] + [local(str(a)) for a in s["command"]]
            if name == "gateway":
                argv[argv.index("--port") + 1] = str(hport)
            env = dict(os.environ) | {k: local(str(v)) for k, v in s.get("environment", {}).items()}
            for i in range(2 if name == "executor" else 1):
                log = open(tmp_path / f"{name}-{i}.log", "wb")
                logs.append(log.name)
                procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        base = f"http://127.0.0.1:{hport}"
        deadline = time.monotonic() + 300
        executors, healthy = [], False
        while time.monotonic() < deadline and not (healthy and len(executors) == 2):
            assert all(p.poll() is None for p in procs), [open(f).read()[-1500:] for f in logs]
            try:
                with urllib.request.urlopen(urllib.request.Request(base + "/v1/memory", headers=auth), timeout=5) as r:
                    executors = [e for e in json.loads(r.read())["executors"] if e.get("occupancy")]
                with urllib.request.urlopen(base + "/health", timeout=5) as r:   # 503 (an HTTPError) until ready
                    healthy = r.status == 200
            except OSError:
                pass
            time.sleep(1)
        assert healthy and len(executors) == 2, f"the compose layout never served with two executors: {executors}"
        import asyncio
        import nats

        async def anonymous():
            with pytest.raises(Exception, match="Authorization Violation"):
                await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0)
        asyncio.run(anonymous())                          # the compose layout's bus: keys only
        body = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).encode()
        req = urllib.request.Request(base + "/generate", data=body, headers={"Content-Type": "application/json"} | auth)
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        assert len(out["output_ids"]) == 4
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
