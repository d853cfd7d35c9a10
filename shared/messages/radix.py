"""Executor <-> radix: page and state-slot grants, progress, releases, placement, program cache hints."""
from __future__ import annotations

from .base import Msg


# ---------------------------------------------------------------- radix


class HeldPages(Msg):
    """What one running request holds, as its executor knows it (re-announced to a restarted radix)."""
    rid: str
    namespace: str
    tokens: list[int]                 # its prompt
    pages: list[int]                  # its page table
    computed: int                     # tokens with KV (prompt and output)
    quota_pages: int = 0
    state_slot: int = -1              # hybrid: working and tail slots, planned checkpoints
    tail_slot: int = -1
    checkpoints: list[int] = []
    checkpoint_slots: list[int] = []


class RadixRegister(Msg):
    """An executor announces its pool; the radix service becomes the authority over its KV pages
    and (hybrid models) its state slots. After a radix restart the executor registers again with
    what its running requests hold (`held`): those pages and slots are taken, their computed
    prefixes cached anew, everything else is free."""
    pool: str
    num_pages: int
    page_size: int
    cache: bool = True                # False: --disable-radix-cache (pages are never shared)
    num_state_slots: int = 0          # > 0: a hybrid model; prefixes resume only from checkpoints
    checkpoint_interval: int = 0      # also checkpoint long prefills every this many tokens (0: off)
    held: list[HeldPages] = []
    tier_root: bytes = b""            # the executor has KV tiers: the root of its page keys (shared/page_keys.py)
    tier_load_pages: int = 0          # ... and loads at most this many pages of a prompt from them


class RadixRegistered(Msg):
    pool: str
    known_candidates: bool = False    # understands Candidate.known (a radix from before it does not:
                                      # the executor then sends every prompt in full)


class RadixAdopt(Msg):
    """More of what an executor's running requests hold, after its RadixRegister: a register with
    many long requests would pass NATS's max_payload in one message, so `held` comes in parts."""
    pool: str
    held: list[HeldPages]


class Candidate(Msg):
    """A waiting request the executor would like to start. A candidate the pool deferred in the
    previous step comes back without its prompt (`known`): the pool kept it. An agent's burst
    waits some steps for its preamble, and re-sending its long prompts at every step would be most
    of the bytes of the exchange, encoded on the compute thread."""
    rid: str
    namespace: str
    token_ids: list[int]
    reserve: int                      # tokens beyond the prompt to reserve pages for (max_new_tokens)
    checkpoint_at: list[int] = []     # hybrid: extra checkpoints asked for (the programs' fork points)
    priority: int = 0                 # higher first; among equals, longest cached prefix first
    max_cached: int = -1              # >= 0: reuse at most this many tokens (prompt logprobs need the rest)
    quota_pages: int = 0              # > 0: the namespace's owner may keep at most this many cached pages
    known: bool = False               # token_ids left out: the pool has them from the step before


class Progress(Msg):
    """The first `computed` tokens of a running request now have KV: cache them (prefill chunk done).
    Hybrid: the planned checkpoints up to `computed` now hold their states."""
    rid: str
    computed: int
    # planned checkpoints (positions) a load from the KV tiers went past without their states: their
    # slots are freed, not attached (tiers.py)
    unfilled: list[int] = []


class Release(Msg):
    """A request ended: cache its computed tokens, unlock, free every page the tree does not keep."""
    rid: str
    output_ids: list[int] = []
    computed: int = 0
    tail: int = 0                     # hybrid: position whose state the tail slot holds (0: none)
    pin: str = ""                     # keep the inserted prefix locked under this key (RadixUnpin frees it)
    pin_ttl_s: float = 0.0            # ... for at most this long
    discard: bool = False             # cancelled: cache nothing more; what it inserted is evicted first
    unfilled: list[int] = []          # as Progress.unfilled, when no progress carried them


class Demote(Msg):
    """Programs: a lost select choice. The cached pages of `token_ids` past its first `keep`
    tokens (and not shared with another path) become the first to evict."""
    namespace: str
    token_ids: list[int]
    keep: int = 0


class Grow(Msg):
    """A running request needs more pages (it reserved only part of its output at admission)."""
    rid: str
    pages: int


class RadixStep(Msg):
    """Everything one executor step needs from the radix service, in one message, applied in this
    order: releases, progress, unpins, demotes, growth of running requests, then admission."""
    pool: str
    budget: int                       # prefill tokens the step can still take
    max_admit: int                    # free request slots
    candidates: list[Candidate] = []
    progress: list[Progress] = []
    releases: list[Release] = []
    unpins: list[str] = []            # programs: pins (Release.pin keys) no longer needed
    demotes: list[Demote] = []
    grows: list[Grow] = []
    # what the executor's KV tiers gained and lost since its last message, by page key (a state key
    # names the state after that page): radix counts what a prompt would load from them (place)
    tier_pages_added: list[bytes] = []
    tier_pages_dropped: list[bytes] = []
    tier_states_added: list[bytes] = []
    tier_states_dropped: list[bytes] = []


class Grant(Msg):
    rid: str
    cached_tokens: int                # prompt tokens whose KV is reused (a multiple of page_size)
    pages: list[int]                  # the request's page table: cached pages, then fresh ones
    # hybrid models only
    state_slot: int = -1              # the request's working state
    restore_slot: int = -1            # copy this checkpoint into state_slot first (-1: start from zero)
    tail_slot: int = -1               # decode copies the state here at every page boundary
    checkpoints: list[int] = []       # prefill stops at these positions and copies the state ...
    checkpoint_slots: list[int] = []  # ... into these slots


class Deferred(Msg):
    rid: str
    cached_tokens: int
    reason: str                       # memory | budget | slots | shared-prefix | unknown (its prompt, again)


class RadixStepReply(Msg):
    grants: list[Grant] = []
    deferred: list[Deferred] = []
    grown: dict[str, list[int]] = {}  # rid -> the pages added to its page table
    short: list[str] = []             # growth refused: no page free or evictable (the executor preempts)
    free_pages: int = 0
    evictable_pages: int = 0


class RadixFlush(Msg):
    pool: str | None = None           # None: every pool
    scopes: list[str] = []            # only these owners' namespaces ("alpha" and "alpha/<salt>"); empty: all
    namespaces: list[str] = []        # or only these namespaces (exact, or a prefix ending in "*")


class RadixFlushed(Msg):
    freed_pages: int


class RadixPlace(Msg):
    """Which executor pool holds the longest prefix of `token_ids` in `namespace`."""
    namespace: str
    token_ids: list[int]
    pools: list[str]


class RadixPlaceReply(Msg):
    cached_tokens: dict[str, int]     # pool -> tokens it would reuse (from its device cache or its tiers)
    tier_tokens: dict[str, int] = {}  # pool -> how many of those its KV tiers hold


class CacheHints(Msg):
    """Scheduler -> executor (programs): unpin fork points whose children are admitted, demote lost
    branches. They ride the executor's next RadixStep, after the releases that made the pins."""
    unpins: list[str] = []
    demotes: list[Demote] = []
