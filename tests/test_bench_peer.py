"""bench's local peer pausing (services/bench/peer.py): the processes serving a local URL, the
listener and its descendants, are stopped for the block and running again after it."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixflow.services.bench.peer import local_processes, paused

SERVER = """
import http.server, socketserver, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
socketserver.TCPServer.allow_reuse_address = True
with socketserver.TCPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler) as s:
    print(child.pid, flush=True)
    s.serve_forever()
"""


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def peer():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(proc.stdout.readline())
        yield f"http://localhost:{port}", proc.pid, child
    finally:
        for pid in (child, proc.pid):
            if pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc")
def test_a_local_peer_and_its_children_are_paused_for_the_block_only(peer):
    url, server, child = peer
    assert sorted(local_processes(url)) == sorted([server, child])
    with paused(url) as stopped:
        assert sorted(stopped) == sorted([server, child])
        time.sleep(0.05)
        assert _state(server) == "T" and _state(child) == "T"
    time.sleep(0.05)
    assert _state(server) != "T" and _state(child) != "T"
    with paused(url, enabled=False) as stopped:       # --no-pause-peer
        assert stopped == [] and _state(server) != "T"


def test_a_remote_or_absent_peer_is_left_alone():
    assert local_processes("http://example.com:8000") == []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with paused(f"http://127.0.0.1:{free}") as stopped:
        assert stopped == []


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc")
def test_a_bench_killed_outright_leaves_no_peer_stopped(peer):
    """SIGKILL skips every finally: the watchdog process resumes the peer when the bench's end of
    its pipe closes."""
    url, server, child = peer
    bench = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom radixflow.services.bench.peer import paused\n"
        f"with paused({url!r}) as s:\n    print(len(s), flush=True)\n    time.sleep(600)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert bench.stdout.readline().strip() == "2"
        deadline = time.monotonic() + 5          # a stop is delivered asynchronously
        while time.monotonic() < deadline and (_state(server), _state(child)) != ("T", "T"):
            time.sleep(0.02)
        assert _state(server) == "T" and _state(child) == "T"
        bench.kill()
        bench.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "T" in (_state(server), _state(child)):
            time.sleep(0.05)
        assert _state(server) != "T" and _state(child) != "T"
    finally:
        bench.kill()
