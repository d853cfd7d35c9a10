"""Helpers of the fault tests on real processes (test_distributed.py, test_nats_cluster.py): 32
streaming requests at once, a fault in the middle, and the checks every fault must pass."""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import time
import urllib.error
import urllib.request

from radixflow.services.cluster import Cluster, ClusterConfig

@contextlib.contextmanager
def serving(cfg: ClusterConfig):
    """A started cluster, ready with all its executors; its processes' log tails printed if not."""
    with Cluster(cfg) as c:
        try:
            c.wait_ready(300)
        except Exception:
            for f in sorted(os.listdir(cfg.log_dir)):
                print(f"== {f}\n" + open(os.path.join(cfg.log_dir, f)).read()[-3000:])
            raise
        yield c


TERMINAL_S = 10.0        # after a fault, every stream ends within this
N = 32
# dead executors and schedulers are found within a second or two (the defaults: 3.5 s)
FAST_FAILURE_ENV = {"RADIXFLOW_SCHEDULER_EXECUTOR_TIMEOUT_S": "1.5", "RADIXFLOW_EXECUTOR_ORPHAN_TIMEOUT_S": "2",
                    "RADIXFLOW_GATEWAY_SCHEDULER_TIMEOUT_S": "2", "RADIXFLOW_SERVICE_HEARTBEAT_S": "0.5",
                    "RADIXFLOW_BUS_CONNECT_TIMEOUT_S": "60"}


def stream(base: str, i: int, max_tokens: int, schema: dict | None = None, prompt: str = "") -> dict:
    """One streaming completion. Returns what ended it ('done' | 'error' | 'hang'), how many
    terminal events the stream carried, when it ended and the tokens it streamed."""
    body = {"model": "tiny-hybrid", "prompt": f"Request {i}: " + (prompt or "tell a long story about the sea."),
            "max_tokens": max_tokens,
            "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": True}
    if schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out = {"end": "hang", "terminal": 0, "tokens": 0, "t": 0.0, "http": 200}
    try:
        with urllib.request.urlopen(req, timeout=40) as r:
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out["end"] = "done" if out["end"] == "hang" else out["end"]
                    break
                item = json.loads(data)
                if "error" in item:
                    out["terminal"] += 1
                    out["end"] = "error"
                    continue
                ch = item["choices"][0]
                out["tokens"] += 1 if ch.get("text") else 0
                if ch.get("finish_reason"):
                    out["terminal"] += 1
        if out["end"] == "hang":
            out["end"] = "error"          # closed without [DONE]: an end, though not a clean one
    except urllib.error.HTTPError as e:    # refused before the stream began: its one terminal event
        out.update(end="error", terminal=1, http=e.code)
    except urllib.error.URLError as e:
        if not isinstance(e.reason, ConnectionError):
            raise
        # no gateway listening (one restarting): never accepted, so nothing was lost; a clear end
        out.update(end="error", terminal=1, http=0)
    except Exception:  # noqa: BLE001 (a read timeout: no terminal event)
        pass
    out["t"] = time.monotonic()
    return out


def burst(c: Cluster, fault=None, after_s: float = 2.0, n: int = N, max_tokens: int = 160,
          schema: dict | None = None, prompt: str = "") -> tuple[list[dict], float]:
    """n streams at once; `fault()` after `after_s`. Returns the outcomes and when the fault struck."""
    struck = time.monotonic()
    with cf.ThreadPoolExecutor(n) as ex:
        futs = [ex.submit(stream, c.base, i, max_tokens, schema, prompt) for i in range(n)]
        if fault is not None:
            time.sleep(after_s)
            struck = time.monotonic()
            fault()
        outs = [f.result() for f in futs]
    return outs, struck


def assert_every_stream_ended_once(outs: list[dict], struck: float) -> None:
    ends = [o["end"] for o in outs]
    print(f"\n{ends.count('done')} finished, {ends.count('error')} clean errors, {ends.count('hang')} hung; "
          f"last end {max(o['t'] for o in outs) - struck:.1f} s after the fault")
    hung = [o for o in outs if o["end"] == "hang"]
    assert not hung, f"{len(hung)} of {len(outs)} streams hung"
    assert all(o["terminal"] == 1 for o in outs), [o["terminal"] for o in outs]
    late = [round(o["t"] - struck, 1) for o in outs if o["end"] == "error" and o["t"] - struck > TERMINAL_S]
    assert not late, f"errors later than {TERMINAL_S}s after the fault: {late}"


def pools(c: Cluster) -> list[dict]:
    with urllib.request.urlopen(c.base + "/v1/memory", timeout=10) as r:
        return [e["occupancy"] for e in json.loads(r.read())["executors"]]


def idle(occ: dict) -> bool:
    return (occ.get("requests_held") == 0 and occ["kv_pages_used"] == occ["kv_pages_cached"]
            and occ.get("state_slots_used", 0) == occ.get("state_slots_cached", 0))


def assert_idle_and_serving(c: Cluster, executors: int = 2) -> None:
    """Both executors back (a killed one restarted), every pool at its idle counts, new requests served."""
    c.wait_ready(120, executors=executors)
    deadline = time.monotonic() + 20
    occ = pools(c)
    while not (len(occ) >= executors and all(idle(p) for p in occ)) and time.monotonic() < deadline:
        time.sleep(0.5)
        occ = pools(c)
    assert len(occ) >= executors and all(idle(p) for p in occ), occ
    outs, _ = burst(c, n=4, max_tokens=4)
    assert [o["end"] for o in outs] == ["done"] * 4, outs
