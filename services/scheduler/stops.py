"""Stop strings, checked on detokenized text as it streams.

A stop string may straddle two steps' deltas, so the check looks at the tail of what was already
released plus the new delta; text that could still be the start of a stop string is held back
(never streamed and then retracted)."""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.held = ""            # text not yet released because it may begin a stop string

    def feed(self, delta: str, final: bool = False) -> tuple[str, str | None]:
        """New text in -> (text safe to release, the stop string matched or None).
        After a match the caller ends the request; nothing after the stop string is released."""
        if not self.stops:
            return delta, None
        buf = self.held + delta
        hit, at = None, len(buf)
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and i < at:
                hit, at = s, i
        if hit is not None:
            self.held = ""
            return buf[:at], hit
        if final:
            self.held = ""
            return buf, None
        # hold back the longest suffix of buf that is a proper prefix of some stop string
        keep = 0
        for k in range(min(self.longest - 1, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], None
