"""Recent: what ended moments ago still counts as known, and is forgotten after keep_s (bounded)."""
from radixflow.shared import recent
from radixflow.shared.recent import Recent


def test_keys_are_known_for_keep_s_then_forgotten(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(recent.time, "monotonic", lambda: now[0])
    r = Recent(2.0)
    r.add("a")
    now[0] += 1.5
    r.add("b")
    assert "a" in r and "b" in r and "c" not in r
    now[0] += 1.0                # a is 2.5 s old, b 1.0 s
    assert "a" not in r and "b" in r
    r.add("b")                   # seen again: its clock starts over, and it moves behind newer keys
    r.add("c")
    now[0] += 1.9
    assert "b" in r and "c" in r and len(r) == 2
    now[0] += 0.2
    assert len(r) == 0


def test_memory_stays_bounded_under_a_stream_of_keys(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(recent.time, "monotonic", lambda: now[0])
    r = Recent(1.0)
    for i in range(10_000):
        now[0] += 0.01
        r.add(str(i))
    assert len(r._at) <= 101      # only the last second's keys are held
