"""Every service in its own OS process against one NATS server: `radixflow up --processes`.

    Cluster.start():  nats-server (embedded, unless a URL is given)
                      -> `radixflow service NAME` x count, in stack.ORDER (gateway last)
    supervisor:       a child that exits is started again (backoff 1 s doubling to 10 s; a child
                      that lived 30 s starts over at 1 s), as an operator's init system would
    Cluster.stop():   SIGTERM in reverse order (each drains), SIGKILL after the drain timeout

Several executors each load the model and own their KV pool; radix places requests between them.
Several tokenizers, grammars and schedulers share their subjects' queue groups; several gateways
share one HTTP port (SO_REUSEPORT). The same layout runs in compose.yaml. Tests drive the cluster
through this class, so what they kill is what a user runs.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from radixflow.shared import log
from radixflow.shared import creds
from radixflow.shared.natsd import NatsServer, dying_with_parent

from .stack import ORDER

_log = log.get("cluster")
# a 2-core machine and several executors: torch's default thread count per process oversubscribes
_CORES = os.cpu_count() or 1


@dataclass(frozen=True)
class ClusterConfig:
    model: str
    nats_url: str = ""                 # empty: start an embedded nats-server for the cluster
    # where each process connects, by "service" or "service-i" label (default: nats_url): the
    # nodes of a NATS cluster, as on several hosts
    placement: dict[str, str] = field(default_factory=dict)
    max_payload: int = 8 * 1024 * 1024
    host: str = "127.0.0.1"
    port: int = 8000
    counts: dict[str, int] = field(default_factory=dict)   # service -> processes (default 1 each)
    args: tuple[str, ...] = ()         # serving flags given to every `radixflow service`
    env: dict[str, str] = field(default_factory=dict)
    # more variables for one process, by "service-i" label (e.g. {"executor-0": {"RADIXFLOW_EXECUTOR_ROLE":
    # "prefill"}}: a prefill and a decode executor)
    label_env: dict[str, dict[str, str]] = field(default_factory=dict)
    restart: bool = True
    log_dir: str = ""                  # empty: children write to this process's stdout/stderr
    stop_timeout_s: float = 40.0

    def count(self, name: str) -> int:
        return self.counts.get(name, 1)


@dataclass(eq=False)
class Child:
    name: str                          # service
    index: int
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    backoff_s: float = 1.0
    due: float = 0.0                   # restart not before this (monotonic)

    @property
    def label(self) -> str:
        return f"{self.name}-{self.index}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else -1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Cluster:
    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.nats = None
        self.creds: creds.Ephemeral | None = None
        self.url = cfg.nats_url
        self.children: dict[str, list[Child]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()     # no more restarts
        # PR_SET_PDEATHSIG fires when the thread that started a child ends, not its process)
        self._exit = threading.Event()
        self._supervisor: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "Cluster":
        if not self.url:
            # secured: every service with its own nkey and permissions; the keys live for this run
            self.creds = creds.Ephemeral()
            self.nats = NatsServer(max_payload=self.cfg.max_payload, own_group=True,
                                   auth_conf=self.creds.server_conf).start()
            self.url = self.nats.url
        if self.cfg.log_dir:
            os.makedirs(self.cfg.log_dir, exist_ok=True)
        for name in ORDER:
            self.children[name] = [self._child(name, i) for i in range(self.cfg.count(name))]
            for c in self.children[name]:
                self._spawn(c)
        if self.cfg.restart:
            self._supervisor = threading.Thread(target=self._supervise, name="cluster-supervisor", daemon=True)
            self._supervisor.start()
        return self

    def _child(self, name: str, i: int) -> Child:
        cfg = self.cfg
        url = cfg.placement.get(f"{name}-{i}") or cfg.placement.get(name) or self.url
        argv = [sys.executable, "-m", "radixflow.services.cli.main", "service", name, "--nats-url", url]
        if name in ("executor", "tokenizer", "grammar"):
            argv += ["--model", cfg.model]
        argv += list(cfg.args)
        if name == "gateway":
            argv += ["--host", cfg.host, "--port", str(cfg.port)]
        env = dict(os.environ) | cfg.env | cfg.label_env.get(f"{name}-{i}", {}) | (self.creds.env if self.creds else {})
        if name == "gateway" and cfg.count("gateway") > 1:
            env["RADIXFLOW_GATEWAY_REUSE_PORT"] = "1"
        if name == "executor" and cfg.count("executor") > 1:
            env.setdefault("RADIXFLOW_EXECUTOR_NUM_THREADS", str(max(1, _CORES // cfg.count("executor"))))
        return Child(name, i, argv, env)

    def _spawn(self, c: Child) -> None:
        out = open(os.path.join(self.cfg.log_dir, c.label + ".log"), "ab") if self.cfg.log_dir else None
        c.proc = subprocess.Popen(c.argv, env=c.env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                  start_new_session=True, preexec_fn=dying_with_parent())
        if out:
            out.close()
        c.started = time.monotonic()
        _log.info("started", service=c.label, pid=c.pid)

    def _supervise(self) -> None:
        while not self._exit.wait(0.25):
            with self._lock:
                for c in self.all():
                    if c.alive() or self._stopping.is_set():
                        continue
                    now = time.monotonic()
                    if not c.due:
                        lived = now - c.started
                        c.backoff_s = 1.0 if lived > 30 else min(c.backoff_s * 2, 10.0) if c.restarts else 1.0
                        c.due = now + c.backoff_s
                        _log.warning("exited; restarting", service=c.label, code=c.proc.returncode,
                                     in_s=c.backoff_s)
                    elif now >= c.due:
                        c.due, c.restarts = 0.0, c.restarts + 1
                        self._spawn(c)

    def stop(self) -> None:
        """Drain and stop: the gateway first (no new requests), the executors before radix."""
        self._stopping.set()
        with self._lock:
            for name in reversed(ORDER):
                group = [c for c in self.children.get(name, []) if c.alive()]
                for c in group:
                    c.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + self.cfg.stop_timeout_s
                for c in group:
                    try:
                        c.proc.wait(max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        _log.warning("did not drain in time; killing", service=c.label)
                        c.proc.kill()
                        c.proc.wait()
        self._exit.set()
        if self._supervisor is not None:
            self._supervisor.join(2)
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self.creds is not None:
            self.creds.close()
            self.creds = None

    def __enter__(self) -> "Cluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ operator's view

    def all(self) -> list[Child]:
        return [c for name in ORDER for c in self.children.get(name, [])]

    def signal(self, name: str, sig: int = signal.SIGKILL, index: int = 0) -> Child:
        """Send `sig` to one service process (kill -9 by default); the supervisor restarts it."""
        c = self.children[name][index]
        os.killpg(c.pid, sig)
        return c

    @property
    def base(self) -> str:
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "") else self.cfg.host
        return f"http://{host}:{self.cfg.port}"

    def executors_ready(self) -> list[dict]:
        """The executors that report a pool, from the gateway's /v1/memory ([] while not serving)."""
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                if r.status != 200:
                    return []
            with urllib.request.urlopen(self.base + "/v1/memory", timeout=5) as r:
                return [e for e in json.loads(r.read())["executors"] if e.get("occupancy")]
        except OSError:
            return []

    def wait_ready(self, timeout_s: float = 300.0, executors: int | None = None) -> None:
        """Until /health is green and `executors` (default: all) report their pools."""
        want = self.cfg.count("executor") if executors is None else executors
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.executors_ready()) >= want:
                return
            dead = [c.label for c in self.all() if not c.alive() and not self.cfg.restart]
            if dead:
                raise RuntimeError(f"exited while starting: {', '.join(dead)}")
            time.sleep(0.5)
        raise TimeoutError(f"the cluster was not serving with {want} executor(s) within {timeout_s:g}s")

    def run_until_signal(self) -> None:
        done = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        self.start()
        _log.info("cluster starting", nats=self.url, processes={n: len(cs) for n, cs in self.children.items()},
                  http=self.base)
        done.wait()
        _log.info("shutting down: draining every service")
        self.stop()
