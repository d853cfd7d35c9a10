"""Batcher: which sequences run in the next step (continuous batching). No torch here.

    waiting --(RadixStep: granted pages)--> running: prefilling (chunked) -> decoding -> finished
                                                        \\ progress            \\ release

Admission is decided by the page authority (radix): longest cached prefix first, all-or-nothing,
pages for the prompt plus every token the request may generate reserved up front, so a running
request never needs a page mid-flight. Each step is either a prefill (chunks of prefilling
sequences under the token budget) or a decode of every
sequence past its prompt. While some sequences decode and others prefill, a prefill step is a
mixed one: a smaller chunk budget (mixed_chunk_tokens) and one row for each decoding sequence.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from radixflow.shared.messages import Candidate, Deferred, Demote, Grant, Grow, Progress, RadixStep, Release

from .sequence import Sequence, Status


MAX_CANDIDATE_BYTES = 600_000    # the prompts of one RadixStep's candidates: well under NATS's 1 MiB default


def candidate_tokens(vocab_size: int) -> int:
    """Prompt tokens one RadixStep may carry: msgpack writes an id below 2**16 in 3 bytes, else 5.
    (A burst cut by this cap is admitted over two steps.)"""
    return MAX_CANDIDATE_BYTES // (3 if vocab_size <= 1 << 16 else 5)


@dataclass
class Plan:
    is_decode: bool
    seqs: list[Sequence]
    extend_lens: list[int]
    mixed: bool = False      # a prefill step that also carries decode rows (one token each, at the end)


class Batcher:
    def __init__(self, *, pool: str, max_running: int, max_prefill_tokens: int, mixed_chunk_tokens: int = 0,
                 max_candidates: int = 128,
                 max_candidate_tokens: int = candidate_tokens(1 << 17), decode_reserve: int = 0):
        self.pool = pool
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.mixed_chunk_tokens = mixed_chunk_tokens
        self.max_candidates = max_candidates
        self.max_candidate_tokens = max_candidate_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.progress: list[Progress] = []
        self.releases: list[Release] = []
        self.unpins: list[str] = []          # programs' cache hints, sent after the releases that pinned
        self.demotes: list[Demote] = []
        self.grows: list[Grow] = []          # running requests that need more pages (decode_reserve)
        self.decode_reserve = decode_reserve
        self._retry = False      # something changed since the last deferral: worth asking again
        self._unasked = False    # the last message left waiting requests out (its size cap): ask again
        self.known_candidates = False   # the authority takes deferred candidates without prompts (Candidate.known)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._retry = True

    def has_work(self) -> bool:
        return bool(self.running or self.progress or self.releases or self.unpins or self.demotes or self.grows
                    or (self.waiting and self._retry))

    # ------------------------------------------------------------ the radix exchange

    def radix_message(self) -> RadixStep | None:
        """This step's one message to the page authority, or None when there is nothing to say."""
        cands = []
        slots = self.max_running - len(self.running)
        held = 0
        if self._retry and slots > 0:
            # a program's child waits while its parent runs here; the parent's release, earlier in
            # the same message as the child's candidacy, caches the prefix the child continues from
            live = {s.rid for s in self.running} | {s.rid for s in self.waiting}
            # the message carries the prompts the pool does not have: cap it well under NATS's max_payload
            tokens = 0
            for s in self.waiting:
                if s.after and s.after in live:
                    held += 1
                    continue
                sent = 0 if s.known else len(s.tokens)
                if len(cands) >= self.max_candidates or (cands and tokens + sent > self.max_candidate_tokens):
                    break
                tokens += sent
                cands.append(Candidate(rid=s.rid, namespace=s.namespace, token_ids=[] if s.known else s.tokens,
                                       reserve=self.reserve(s), checkpoint_at=s.checkpoint_at,
                                       priority=s.priority, quota_pages=s.quota_pages, known=s.known,
                                       max_cached=max(s.logprob_start - 1, 0) if s.logprob_start >= 0 else -1))
        # the pool keeps the prompts of this message's candidates only: any other must bring its own
        asked = {c.rid for c in cands}
        for s in self.waiting:
            s.known = s.known and s.rid in asked
        self._unasked = bool(cands) and len(cands) < min(len(self.waiting) - held, slots)
        if not (cands or self.progress or self.releases or self.unpins or self.demotes or self.grows):
            return None
        busy = sum(s.prefill_len - s.computed_len for s in self.running if s.computed_len < s.prefill_len)
        msg = RadixStep(pool=self.pool, budget=max(self.max_prefill_tokens - busy, 0), max_admit=slots,
                        candidates=cands, progress=self.progress, releases=self.releases, unpins=self.unpins,
                        demotes=self.demotes, grows=self.grows)
        self.progress, self.releases, self.unpins, self.demotes, self.grows = [], [], [], [], []
        return msg

    def waiting_follow(self, page_size: int) -> bool:
        """Every waiting request continues the prompt of a running one that was just granted and has
        computed nothing yet, a page or more past where it starts: the authority defers each of them
        until that page is computed ("shared-prefix"), so asking for them now only costs a round trip.
        (Dense models: the tree cannot hold that page, or the running one would have matched it. A
        hybrid request resumes at a state checkpoint, the tree may hold KV past it, and a newcomer
        that parts from it past its checkpoint may find a later state of its own: rare, and it then
        only joins a step later.) Neither side asks for prompt logprobs (a capped match parts them)."""
        if not self.waiting:
            return False
        # (running, where its first uncached page starts): the page is compared before the prefix
        # (a slice of 16 tokens, not of thousands, for the siblings that part from it)
        fronts = [(s, s.computed_len) for s in self.running
                  if s.computed_len == s.cached_len and s.computed_len + page_size < s.prefill_len
                  and s.logprob_start < 0]

        def follows(w: Sequence, s: Sequence, at: int) -> bool:
            end = at + page_size
            return (w.namespace == s.namespace and len(w.tokens) > end and w.tokens[at:end] == s.tokens[at:end]
                    and w.tokens[:at] == s.tokens[:at])
        return bool(fronts) and all(w.logprob_start < 0 and any(follows(w, s, at) for s, at in fronts)
                                    for w in self.waiting)

    def reserve(self, s: Sequence) -> int:
        """Output tokens to reserve pages for at admission: all it may still generate, or with
        decode_reserve > 0 at most that many (it grows page by page, and is preempted if it cannot)."""
        left = s.sampling.max_new_tokens - s.num_output
        return left if self.decode_reserve <= 0 else min(left, self.decode_reserve)

    def ask_growth(self, page_size: int, ahead: int) -> None:
        """Decoding sequences within `ahead` tokens of the end of their pages ask for more, in time."""
        for s in self.running:
            if s.growing or s.computed_len < s.prefill_len:
                continue
            have = len(s.pages) * page_size
            want = min(len(s.tokens) + ahead, s.max_len)
            if want > have:
                s.growing = True
                self.grows.append(Grow(rid=s.rid, pages=-(-(want - have) // page_size)))

    def preempt(self, seq: Sequence) -> None:
        """Out of the pool mid-generation: back to waiting, first in line, with every token it has.
        Its release caches what it computed, so its next admission mostly reuses that."""
        self.running.remove(seq)
        self.releases.append(Release(rid=seq.rid, output_ids=seq.tokens[seq.prefill_len:], computed=seq.computed_len,
                                     tail=seq.tail_pos, unfilled=seq.unfilled))
        seq.unfilled = []
        seq.resume_len = len(seq.tokens)
        seq.logprob_start = -1       # its prompt logprobs were collected by its first prefill
        seq.status = Status.WAITING
        seq.pages, seq.slots, seq.cached_len, seq.computed_len, seq.loaded_len = [], None, 0, 0, 0
        seq.state_slot, seq.restore_slot, seq.tail_slot, seq.tail_pos = -1, -1, -1, 0
        seq.state_ready, seq.checkpoints, seq.draft, seq.certain, seq.growing = False, {}, [], 0, False
        self.waiting.appendleft(seq)
        self._retry = True

    def apply(self, grants: list[Grant], retry: bool, deferred: list[Deferred] = ()) -> list[Sequence]:
        by_rid = {s.rid: s for s in self.waiting}
        for d in deferred:          # kept by the pool, but for those it no longer knew
            if (s := by_rid.get(d.rid)) is not None:
                s.known = self.known_candidates and d.reason != "unknown"
        started = []
        for g in grants:
            seq = by_rid[g.rid]
            self.waiting.remove(seq)
            seq.known = False
            seq.pages, seq.cached_len, seq.computed_len = list(g.pages), g.cached_tokens, g.cached_tokens
            seq.loaded_len = 0
            seq.state_slot, seq.restore_slot, seq.tail_slot = g.state_slot, g.restore_slot, g.tail_slot
            seq.checkpoints = dict(zip(g.checkpoints, g.checkpoint_slots))
            seq.status = Status.RUNNING
            self.running.append(seq)
            started.append(seq)
        # releases not yet sent free pages and slots once they are: ask again then (with overlap, a
        # sequence can finish after the message this reply answers was sent, so finish()'s own
        # retry flag would be lost here and the waiting requests never asked for again)
        self._retry = retry or self._unasked or bool(self.releases)
        return started

    # ------------------------------------------------------------ planning

    def schedule(self) -> Plan | None:
        prefill, budget = [], self.max_prefill_tokens
        decoding = [s for s in self.running if s.computed_len >= s.prefill_len]
        mixed = bool(self.mixed_chunk_tokens and decoding and len(decoding) < len(self.running))
        if mixed:
            # chunked prefill beside decode rows: the step's tokens stay within the mixed budget (its
            # decode rows included, at least one prefill token), so a decoding request waits one
            # bounded step per token, not a whole prompt's prefill
            budget = max(min(self.mixed_chunk_tokens, budget) - len(decoding), 1)
            # the last chunk takes up to an eighth more rather than leave a remainder of a few
            # tokens to a step of its own, which would pay a whole step's fixed costs
            pending = sum(s.prefill_len - s.computed_len for s in self.running if s.computed_len < s.prefill_len)
            if pending <= budget + budget // 8:
                budget = pending
        for s in self.running:
            if s.computed_len < s.prefill_len and budget > 0:
                # planned checkpoints inside the chunk do not cut it: the model copies the state out
                # where they fall (ForwardBatch.taps)
                n = min(s.prefill_len - s.computed_len, budget)
                prefill.append((s, n))
                budget -= n
        if prefill and mixed:
            for s in decoding:
                s.draft, s.certain = [], 0      # a jump-forward draft is verified by decode steps only
            return Plan(False, [s for s, _ in prefill] + decoding, [n for _, n in prefill] + [1] * len(decoding),
                        mixed=True)
        if prefill:
            return Plan(False, [s for s, _ in prefill], [n for _, n in prefill])
        if self.running:
            return Plan(True, list(self.running), [1] * len(self.running))
        return None

    # ------------------------------------------------------------ ends

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out; its pages go back through the next release."""
        if seq in self.running:
            self.running.remove(seq)
            pin = seq.pin if seq.finish_reason in ("stop", "length") else ""
            self.releases.append(Release(rid=seq.rid, output_ids=seq.tokens[seq.prefill_len:], computed=seq.computed_len,
                                         tail=seq.tail_pos, pin=pin, pin_ttl_s=seq.pin_ttl_s, discard=seq.discard,
                                         unfilled=seq.unfilled))
            seq.unfilled = []
            self._retry = True
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.pages, seq.slots = [], None

    def resend(self, msg: RadixStep) -> None:
        """A message that did not get through: its releases, progress and hints go out again, first,
        with the next one (radix takes a repeat as a no-op); its candidates are still waiting."""
        self.releases = msg.releases + self.releases
        self.progress = msg.progress + self.progress
        self.unpins = msg.unpins + self.unpins
        self.demotes = msg.demotes + self.demotes
        for g in msg.grows:        # asked again at the next step
            seq = next((s for s in self.running if s.rid == g.rid), None)
            if seq is not None:
                seq.growing = False
        for s in self.waiting:     # whatever the pool kept may be gone with it: prompts in full again
            s.known = False
        self._retry = self._retry or bool(msg.candidates)

    def rejoined(self, again: list[Sequence]) -> None:
        """After registering again with a restarted authority: nothing owed to the old one is sent,
        and `again` (running, but nothing computed of their own) wait for new grants, first."""
        self.progress, self.releases, self.unpins, self.demotes, self.grows = [], [], [], [], []
        for s in self.running:
            s.growing = False
        for seq in reversed(again):
            self.running.remove(seq)
            seq.status = Status.WAITING
            seq.pages, seq.slots, seq.cached_len, seq.computed_len, seq.loaded_len = [], None, 0, 0, 0
            seq.state_slot, seq.restore_slot, seq.tail_slot, seq.tail_pos = -1, -1, -1, 0
            seq.state_ready, seq.checkpoints = False, {}
            self.waiting.appendleft(seq)
        for s in self.waiting:     # a new authority knows no prompt
            s.known = False
        self._retry = True

    def fail_all(self) -> list[Sequence]:
        """The authority lost our pages: everything in flight is lost with them."""
        lost = list(self.running) + list(self.waiting)
        self.running.clear()
        self.waiting.clear()
        self.progress.clear()
        self.releases.clear()
        self.unpins.clear()
        self.demotes.clear()
        self.grows.clear()
        return lost
