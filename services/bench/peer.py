"""A peer server on this machine, paused while radixflow's side of a comparison runs.

Side-by-side benchmarks run one side after the other on one machine. radixflow's stack is down while
the peer is measured, but the peer stays up while radixflow is: an idle vLLM-CPU wakes over a
thousand times a second (its engine's polling threads), and on a few cores each wakeup preempts one
of the compute threads, whose parallel regions then wait for it. So that each side has the machine
to itself, the peer's processes (the one listening on the URL's port and all its
descendants) get SIGSTOP for the duration and SIGCONT after. A peer elsewhere (or one whose
processes this user may not signal) is left alone, and the result says so.
"""
from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from urllib.parse import urlparse

LOCAL = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}


def _listening_inodes(port: int) -> set[str]:
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            # local_address is HEX_IP:HEX_PORT, st 0A is LISTEN
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                out.add(f[9])
    return out


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for pid in _pids():
        try:
            # the fields after the command name, which is in parentheses and may hold spaces
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(pid)
    return kids


def _ancestors() -> set[int]:
    out, pid = set(), os.getpid()
    while pid > 1:
        out.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return out | {1}


def local_processes(url: str) -> list[int]:
    """The processes serving `url` on this machine: those holding its listening socket, and their
    descendants (a vLLM server's engine core and workers). Empty for a remote URL, where /proc does
    not tell, and where the socket's holder is init or an ancestor of this process (a supervisor's
    socket activation, a shell's port forward): stopping those would stop more than the peer."""
    u = urlparse(url)
    if u.hostname not in LOCAL:
        return []
    port = u.port or (443 if u.scheme == "https" else 80)
    inodes = _listening_inodes(port)
    if not inodes:
        return []
    mine = _ancestors()
    owners = set()
    for pid in _pids():
        if pid in mine:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                owners.add(pid)
                break
    kids, out, stack = _children(), [], sorted(owners)
    while stack:
        pid = stack.pop()
        if pid not in out and pid not in mine:
            out.append(pid)
            stack.extend(kids.get(pid, []))
    return out


def describe(pids: list[int]) -> list[str]:
    """`pid name` of each, for the record of what was paused."""
    out = []
    for pid in pids:
        try:
            out.append(f"{pid} {Path(f'/proc/{pid}/comm').read_text().strip()}")
        except OSError:
            out.append(str(pid))
    return out


# resumes the pids given as arguments when its stdin closes: when the bench ends, however it ends
# (a SIGKILL included), the peer is not left stopped
_WATCHDOG = ("import os, signal, sys\nsys.stdin.read()\nfor p in sys.argv[1:]:\n"
             "    try:\n        os.kill(int(p), signal.SIGCONT)\n    except OSError:\n        pass\n")


@contextlib.contextmanager
def paused(url: str | None, enabled: bool = True):
    """SIGSTOP the local peer's processes for the block, SIGCONT after: at the block's end, on
    SIGTERM or SIGHUP (turned into SystemExit meanwhile), and by a watchdog process if this one
    dies outright. Yields the pids paused (empty: nothing was)."""
    import subprocess
    import sys
    pids = local_processes(url) if url and enabled else []
    stopped: list[int] = []
    if not pids:
        yield stopped
        return
    watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, *map(str, pids)], stdin=subprocess.PIPE)

    def leave(signum, _frame):
        raise SystemExit(128 + signum)
    import threading
    handlers = {s: signal.signal(s, leave) for s in (signal.SIGTERM, signal.SIGHUP)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            except OSError:
                pass
        yield stopped
    finally:
        for pid in stopped:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        for s, h in handlers.items():
            signal.signal(s, h)
        watchdog.stdin.close()
        watchdog.wait()
