"""bench/common.py's Timer: CPU seconds count work in any of the process's threads (cpu) or in the
entering one (thread_cpu), and never a wait; `bench shared-prefix` reads cores kept busy from them."""
from __future__ import annotations

import threading
import time

from radixflow.services.bench.common import Timer


def _work(cpu_s: float) -> None:
    t0 = time.thread_time()
    while time.thread_time() - t0 < cpu_s:     # CPU time, not wall: the same work on a loaded machine
        pass


def test_cpu_counts_other_threads_work_and_no_waits():
    with Timer() as t:
        worker = threading.Thread(target=_work, args=(0.2,))
        worker.start()
        worker.join()
        time.sleep(0.1)
    assert t.cpu >= 0.2
    assert t.thread_cpu < 0.1          # the entering thread only waited (join, sleep)
    assert t.s >= t.thread_cpu + 0.1


def test_thread_cpu_counts_the_entering_threads_work():
    with Timer() as t:
        _work(0.1)
    assert t.thread_cpu >= 0.1
    assert t.cpu >= t.thread_cpu - 1e-3     # two clocks, read one after the other
