"""KVTiers: host-memory and disk tiers under an executor's device pool, so that KV pages (and hybrid
models' state checkpoints) the radix cache evicts are kept a level down instead of dropped, and a
request whose prefix went there loads it back instead of computing it again.

Where the data lives decides where the index lives. The radix service decides what is cached on the
device and evicts by LRU; the executor holds the tensors. A page the tree evicts keeps its contents
until the page is granted to someone else, and every grant passes through the executor first
(exchange.py), so the executor saves a page's contents to the host tier exactly when they are about to
be overwritten (`reused`), with no message of its own. Likewise a state slot.

What a page holds is named by a key: a chain hash over the cache namespace and the tokens of the
page and of every page before it (and the model's identity, which disk files outlive), so a key means
the same KV in any request, and never crosses a namespace: tenants and cache_salt are kept apart in
every tier as in the device pool. A state checkpoint at a page boundary is named by that page's key.

    device pool ──(granted again: save)──> host tier (LRU, `host_pages`) ──(full)──> disk tier (LRU, files)
    a request's fresh pages <──(admitted: load the longest run of keys after its device match)──┘

With a disk tier, a request's pages on disk are read into the host tier ahead of its admission by a
thread of its own (prefetch.py), so the load at admission is a copy from host memory; what the
prefetch did not bring in time is read there. A lock keeps the two threads' tier bookkeeping apart.

Loading is all or nothing per page, in order, and stops at the first page no tier has (or whose disk
file is missing, truncated or fails its checksum: the file is dropped and the tokens are computed).
A hybrid request loads up to the deepest page boundary that has its state in a tier; a checkpoint
radix planned on the way gets its state from the tier, or, where the tier has none, is reported
unfilled (Progress.unfilled) and radix frees its slot instead of attaching it.
Loaded pages are the request's own fresh pages: its progress puts them in the radix tree as computed.
"""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixflow.shared.page_keys import PageKeys, root_key

from .prefetch import Prefetcher
from .tier_stores import Disk, Host, changes

if TYPE_CHECKING:
    from .memory import KVPool, StatePool
    from .sequence import Sequence

def model_identity(model: str, kv: "KVPool", page_size: int) -> str:
    """What a page's bytes depend on besides its tokens, for keys that outlive the process (disk files)
    and cross it (pages moved to another executor): the checkpoint by content, not by where it lies
    (its config.json and its weight files' names and sizes), the pool's dtype and page size."""
    root = Path(model)
    config = hashlib.blake2b((root / "config.json").read_bytes(), digest_size=16).hexdigest() \
        if (root / "config.json").exists() else ""
    files = sorted((p.name, p.stat().st_size) for p in root.glob("*") if p.suffix in (".safetensors", ".bin"))
    dtype = kv.k[0].dtype if kv.k else None
    return f"{config}|{files}|{dtype}|{page_size}"


class KVTiers:
    def __init__(self, kv: "KVPool", state: "StatePool | None", *, host_pages: int, disk_dir: str = "",
                 disk_pages: int = 0, identity: str = "", host_states: int = 0):
        self.kv, self.state, self.ps = kv, state, kv.page_size
        self.root = root_key(identity)
        dev = kv.k[0].device if kv.k else torch.device("cpu")
        pin = dev.type == "cuda"
        page = [((len(kv.k), self.ps, *kv.k[0].shape[1:]), kv.k[0].dtype)] * 2 if kv.k else []
        self.host = Host(host_pages, page, pin)
        states = []
        if state is not None:
            states = [(t.shape[1:], t.dtype) for t in state.recurrent + state.conv]
        self.host_states = Host(host_states or (max(host_pages // 4, 8) if state is not None else 0), states, pin)
        self.disk = Disk(disk_dir, disk_pages) if disk_dir else None
        self.page_key: dict[int, bytes] = {}      # device page -> key of the KV it holds (whole pages only)
        self.slot_key: dict[int, bytes] = {}      # state slot -> key of the checkpoint it holds
        # host entries the prefetch brought up from disk and no load has used yet: a load that finds
        # one counts a disk hit, as if it had read the file itself
        self._prefetched: set[bytes] = set()
        self._lock = threading.RLock()            # the compute thread's saves and loads vs the prefetch thread
        self.prefetcher = Prefetcher(self.fetch) if self.disk is not None else None
        self.counters = {"tier_saved_pages_total": 0, "tier_saved_states_total": 0, "tier_host_hit_pages_total": 0,
                         "tier_disk_hit_pages_total": 0, "tier_looked_up_pages_total": 0,
                         "tier_loaded_tokens_total": 0, "tier_spilled_pages_total": 0,
                         "tier_prefetched_pages_total": 0, "tier_prefetched_states_total": 0,
                         "tier_disk_read_at_admission_pages_total": 0}

    @property
    def max_load_pages(self) -> int:
        """The most pages one load takes (radix caps its placement count at it)."""
        return max(self.host.capacity - 1, 0)

    # ------------------------------------------------------------ keys

    def keys(self, seq: "Sequence", pages: int) -> list[bytes]:
        """The keys of seq's first `pages` pages (kept on the sequence, extended as its tokens grow)."""
        if seq.tier_keys is None:
            seq.tier_keys = PageKeys(self.root, seq.namespace, seq.tokens, self.ps)
        return seq.tier_keys.upto(pages)

    # ------------------------------------------------------------ what the device holds

    def computed(self, seq: "Sequence", before: int) -> None:
        """seq's KV now covers computed_len tokens (it covered `before`): its pages filled since
        hold their keys' KV."""
        # only tokens the sequence has (a decode step's draft rows are computed before they are kept)
        lo, hi = before // self.ps, min(seq.computed_len, len(seq.tokens), len(seq.pages) * self.ps) // self.ps
        if hi <= lo:
            return
        ks = self.keys(seq, hi)
        for i in range(lo, hi):
            self.page_key[seq.pages[i]] = ks[i]

    def checkpointed(self, seq: "Sequence", slot: int, pos: int) -> None:
        """`slot` now holds seq's state after `pos` tokens (a page boundary)."""
        if pos > 0 and pos % self.ps == 0:
            self.slot_key[slot] = self.keys(seq, pos // self.ps)[-1]

    # ------------------------------------------------------------ the compute thread's entry points (locked)

    def reused(self, pages: list[int], slots: list[int] = (), admitted: list["Sequence"] = ()) -> None:
        """These pages and slots were just granted (to `admitted`, whose loads come next): what they
        held is saved to the host tier first."""
        with self._lock:
            kept = sum(self._keep_run(s) for s in admitted)
            self._reused(pages, slots, kept)

    def load(self, seq: "Sequence") -> int:
        """Just admitted: the pages after its device match that a tier has go into its fresh pages;
        returns the tokens loaded (computed_len moves past them)."""
        if self.prefetcher is not None:
            self.prefetcher.settle(seq.rid)          # outside the lock: the prefetch commits under it
        with self._lock:
            return self._load(seq)

    def known_boundary(self, seq: "Sequence") -> int:
        with self._lock:
            return self._known_boundary(seq)

    def put(self, namespace: str, tokens: list[int], first: int, k: torch.Tensor, v: torch.Tensor,
            state: list[torch.Tensor] = ()) -> int:
        with self._lock:
            return self._put(namespace, tokens, first, k, v, state)

    def prefetch(self, seq: "Sequence") -> None:
        """seq just arrived: its prompt's pages on disk are read into the host tier meanwhile."""
        if self.prefetcher is not None and self.host.capacity > 1:
            self.prefetcher.submit(seq.rid, seq.namespace, seq.tokens[:seq.prompt_len])

    # ------------------------------------------------------------ saving (before a grant overwrites)

    def _keep_run(self, seq: "Sequence") -> int:
        """The host tier's run of seq's pages after its device match, made recent (the saves before its
        load must not push out what it is about to load); returns how many."""
        first = seq.computed_len // self.ps
        last = min((seq.prefill_len - 1) // self.ps, first + self.max_load_pages)
        if seq.computed_len % self.ps or last <= first:
            return 0
        ks, n = self.keys(seq, last), 0
        for i in range(first, last):
            if self.host.get(ks[i]) is None:
                break
            n += 1
        return n

    def _reused(self, pages: list[int], slots: list[int] = (), kept: int = 0) -> None:
        save, seen = [], set()
        for p in pages:
            k = self.page_key.pop(p, None)
            # two device pages may hold one key (two requests computed one prefix): saved once
            if k is None or k in seen or self.host.get(k) is not None or self.disk and k + b".kv" in self.disk:
                continue
            seen.add(k)
            save.append((p, k))
        if self.disk is None:
            # without a disk below, what does not fit is lost: the admitted requests' runs (`kept`)
            # are worth more than the oldest of what is saved now
            save = save[max(len(save) - max(self.host.capacity - kept, 0), 0):]
        # a part's slots are all taken before its pages are written, so a part is at most the tier's
        # size: a bigger save would push out slots of its own part; earlier parts spill to disk
        step = max(self.host.capacity, 1)
        for at in range(0, len(save) if self.host.capacity else 0, step):
            part = save[at:at + step]
            dst = [self.host.slot_for(k, self._spill_page) for _, k in part]
            src = torch.tensor([p for p, _ in part], dtype=torch.int64, device=self.kv.k[0].device)
            idx = torch.tensor(dst, dtype=torch.int64)
            for l, (k, v) in enumerate(zip(self.kv.k, self.kv.v)):
                pk, pv = (t.view(-1, self.ps, *t.shape[1:]) for t in (k, v))
                self.host.store[0][idx, l] = pk.index_select(0, src).to(self.host.store[0].device)
                self.host.store[1][idx, l] = pv.index_select(0, src).to(self.host.store[1].device)
            self.counters["tier_saved_pages_total"] += len(part)
        for s in slots:
            k = self.slot_key.pop(s, None) if s >= 0 else None
            if k is None or self.state is None or self.host_states.get(k) is not None:
                continue
            dst = self.host_states.slot_for(k, self._spill_state)
            if dst is None:
                continue
            for store, t in zip(self.host_states.store, self.state.recurrent + self.state.conv):
                store[dst].copy_(t[s])
            self.counters["tier_saved_states_total"] += 1

    def _spill_page(self, key: bytes, slot: int) -> None:
        self._prefetched.discard(key)
        if self.disk is not None and key + b".kv" in self.disk:
            self.disk.touch(key + b".kv")          # same key, same bytes: no need to write it again
        elif self.disk is not None:
            self.disk.put(key + b".kv", self.host.pack(slot))
            self.counters["tier_spilled_pages_total"] += 1

    def _spill_state(self, key: bytes, slot: int) -> None:
        if self.disk is not None:
            self.disk.put(key + b".kvs", self.host_states.pack(slot))

    # ------------------------------------------------------------ loading (at admission)

    def _from_disk(self, store: Host, key: bytes, suffix: bytes, spill) -> int | None:
        """A disk entry brought up into a host store (its slot), or None."""
        if self.disk is None or store.capacity <= 0:
            return None
        raw = self.disk.get(key + suffix, store.entry_bytes)
        if raw is None:
            return None
        slot = store.slot_for(key, spill)
        store.unpack(slot, raw)
        return slot

    def _page_from_disk(self, key: bytes) -> int | None:
        return self._from_disk(self.host, key, b".kv", self._spill_page)

    def _state(self, key: bytes) -> int | None:
        slot = self.host_states.get(key)
        return slot if slot is not None else self._from_disk(self.host_states, key, b".kvs", self._spill_state)

    def _load(self, seq: "Sequence") -> int:
        start = seq.computed_len
        if start % self.ps or self.host.capacity <= 0:
            return 0
        last = (seq.prefill_len - 1) // self.ps          # the last prompt token is always computed
        if seq.logprob_start >= 0:                       # prompt logprobs from there on: their logits are computed
            last = min(last, max(seq.logprob_start - 1, 0) // self.ps)
        if last <= start // self.ps:
            return 0
        ks = self.keys(seq, last)
        found: list[int] = []            # host slots of the pages start/ps .. in order
        # at most all but one host slot: a page brought up from disk must not push out one found here
        for i in range(start // self.ps, min(last, start // self.ps + self.max_load_pages)):
            self.counters["tier_looked_up_pages_total"] += 1
            slot = self.host.get(ks[i])
            if slot is not None:
                prefetched = ks[i] in self._prefetched
                self._prefetched.discard(ks[i])
                self.counters["tier_disk_hit_pages_total" if prefetched else "tier_host_hit_pages_total"] += 1
            else:
                slot = self._page_from_disk(ks[i])
                if slot is None:
                    break
                self.counters["tier_disk_hit_pages_total"] += 1
                self.counters["tier_disk_read_at_admission_pages_total"] += 1
            found.append(slot)
        n = len(found)
        state_slot = None
        if self.state is not None:
            # the deepest boundary with its state in a tier, every planned checkpoint before it too
            n, state_slot = self._resumable(seq, start, n, ks)
        if n <= 0:
            return 0
        first = start // self.ps
        dst = torch.tensor(seq.pages[first:first + n], dtype=torch.int64, device=self.kv.k[0].device)
        src = torch.tensor(found[:n], dtype=torch.int64)
        for l, (k, v) in enumerate(zip(self.kv.k, self.kv.v)):
            pk, pv = (t.view(-1, self.ps, *t.shape[1:]) for t in (k, v))
            pk.index_copy_(0, dst, self.host.store[0][src, l].to(pk.device))
            pv.index_copy_(0, dst, self.host.store[1][src, l].to(pv.device))
        if state_slot is not None:
            for store, t in zip(self.host_states.store, self.state.recurrent + self.state.conv):
                t[seq.state_slot].copy_(store[state_slot])
            seq.state_ready, seq.restore_slot = True, -1
        seq.computed_len = start + n * self.ps
        self.computed(seq, start)
        self.counters["tier_loaded_tokens_total"] += n * self.ps
        return n * self.ps

    def _resumable(self, seq: "Sequence", start: int, n: int, ks: list[bytes]) -> tuple[int, int | None]:
        """Hybrid: of the n pages found from `start` on, how many to load (up to the deepest page
        boundary whose state a tier has), and the tier slot of that state. The checkpoints radix
        planned on the way are filled from the tier where it has their states; the others are
        `seq.unfilled`, whose slots radix frees instead of attaching (Progress.unfilled)."""
        first = start // self.ps
        planned: list[tuple[int, int | None, int]] = []        # (pages in, tier slot or None, planned slot)
        best, best_slot = 0, None
        for j in range(1, n + 1):
            slot = self._state(ks[first + j - 1])
            dst = seq.checkpoints.get((first + j) * self.ps)
            if dst is not None:
                planned.append((j, slot, dst))
            if slot is not None:
                best, best_slot = j, slot
        for j, src, dst in planned:
            if j > best:
                continue
            if src is None:
                seq.unfilled.append((first + j) * self.ps)
                continue
            for store, t in zip(self.host_states.store, self.state.recurrent + self.state.conv):
                t[dst].copy_(store[src])
            self.slot_key[dst] = ks[first + j - 1]
        return best, best_slot

    def fetch(self, namespace: str, tokens: list[int]) -> int:
        """The prefetch thread: the run of the prompt's pages (and hybrid states) that the disk tier
        has, read into the host tier, at most half of it (one request does not flush the others'
        pages). Pages before the run are taken to be on the device; the run ends at the first page no
        tier has. The files are read and checked outside the lock; returns the pages brought up."""
        last = (len(tokens) - 1) // self.ps
        ks = PageKeys(self.root, namespace, tokens, self.ps).upto(last)
        budget, brought, seen = self.host.capacity // 2, 0, False
        for key in ks:
            with self._lock:
                have = self.host.index.get(key) is not None
                on_disk = not have and key + b".kv" in self.disk
            if not have and not on_disk:
                if seen:
                    break
                continue
            seen = True
            if on_disk:
                if brought >= budget or not self._fetch_one(self.host, key, b".kv", self._spill_page):
                    break
                brought += 1
                self.counters["tier_prefetched_pages_total"] += 1
            if self.state is not None and self.host_states.capacity:
                with self._lock:
                    want = self.host_states.index.get(key) is None and key + b".kvs" in self.disk
                if want and self._fetch_one(self.host_states, key, b".kvs", self._spill_state):
                    self.counters["tier_prefetched_states_total"] += 1
        return brought

    def _fetch_one(self, store: Host, key: bytes, suffix: bytes, spill) -> bool:
        raw = self.disk.read(key + suffix, store.entry_bytes)
        with self._lock:
            if raw is None:
                self.disk.bad(key + suffix)     # unless a spill's LRU dropped it meanwhile
                return False
            if store.index.get(key) is None and key + suffix in self.disk:
                store.unpack(store.slot_for(key, spill), raw)
                self.disk.touch(key + suffix)
                if store is self.host:
                    self._prefetched.add(key)
        return True

    def _known_boundary(self, seq: "Sequence") -> int:
        """Hybrid: the end of the run of seq's prompt pages a tier holds, when no state there is held
        (0 otherwise). A checkpoint asked for there (Candidate.checkpoint_at) puts a state where the
        tier's pages end, so that the next request over them loads them with it, as radix plans a
        checkpoint where a device match ends."""
        if self.state is None or self.host.capacity <= 0:
            return 0
        last = (seq.prompt_len - 1) // self.ps
        ks = self.keys(seq, last)
        n = 0
        while n < last and (self.host.index.get(ks[n]) is not None or self.disk and ks[n] + b".kv" in self.disk):
            n += 1
        if n == 0 or self.host_states.index.get(ks[n - 1]) is not None \
                or self.disk and ks[n - 1] + b".kvs" in self.disk:
            return 0
        return n * self.ps

    # ------------------------------------------------------------ moving pages between executors

    def page_shape(self) -> tuple[int, ...]:
        """One page's K (or V): [attention layers, page_size, kv heads, head_dim]."""
        return tuple(self.host.store[0].shape[1:])

    def _put(self, namespace: str, tokens: list[int], first: int, k: torch.Tensor, v: torch.Tensor,
            state: list[torch.Tensor] = ()) -> int:
        """Pages first .. of the prompt `tokens` in `namespace` (K and V as export gives them) into the
        host tier, and a hybrid state after the last of them; returns the pages stored."""
        n = k.shape[0]
        ks = PageKeys(self.root, namespace, tokens, self.ps).upto(first + n)
        # pages before `first` were not sent because radix counted them here (on the device or in a
        # tier): those in the host tier are made recent first, so that these do not push them out
        for key in ks[:first]:
            self.host.get(key)
        stored = 0
        for i in range(n):
            key = ks[first + i]
            if self.host.get(key) is not None:
                continue
            slot = self.host.slot_for(key, self._spill_page)
            if slot is None:
                break
            self.host.store[0][slot].copy_(k[i])
            self.host.store[1][slot].copy_(v[i])
            stored += 1
        if state and self.state is not None and self.host_states.capacity:
            key = ks[first + n - 1]
            slot = self.host_states.get(key)
            slot = slot if slot is not None else self.host_states.slot_for(key, self._spill_state)
            for store, t in zip(self.host_states.store, state):
                store[slot].copy_(t)
        return stored

    def state_tensors(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The shapes and dtypes of one state (hybrid), in the order export and put take them."""
        return [(tuple(t.shape[1:]), t.dtype) for t in self.host_states.store]

    # ------------------------------------------------------------ what radix learns of the tiers

    MAX_REPORT = 4096     # keys in one RadixStep at most (16 bytes each: far below the payload limit)

    def report(self) -> tuple[list[bytes], list[bytes], list[bytes], list[bytes]] | None:
        """The page and state keys the tiers gained and lost since the last report, for the next
        RadixStep (radix's TierIndex), at most MAX_REPORT of them (tier_stores.changes)."""
        with self._lock:
            return changes(self.host, self.host_states, self.disk, self.MAX_REPORT)

    def pending(self) -> bool:
        """Changes radix has not been told of."""
        with self._lock:
            return bool(self.host.touched or self.host_states.touched or self.disk is not None and self.disk.touched)

    def unreported(self, pages: list[bytes], states: list[bytes]) -> None:
        """A report that radix may not have taken (its step failed): told again with the next."""
        with self._lock:
            self.host.touched.update(pages)
            self.host_states.touched.update(states)

    def report_all(self) -> None:
        """Radix registered us anew (a restart forgot what we told it): everything again."""
        with self._lock:
            self.host.touched.update(self.host.index)
            self.host_states.touched.update(self.host_states.index)
            if self.disk is not None:
                self.disk.touched.update(self.disk.index)

    # ------------------------------------------------------------ reporting

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict[str, int]:
        looked = self.counters["tier_looked_up_pages_total"]
        hits = self.counters["tier_host_hit_pages_total"] + self.counters["tier_disk_hit_pages_total"]
        return dict(self.counters) | {
            "tier_host_pages_total": self.host.capacity, "tier_host_pages_used": len(self.host.index),
            "tier_host_states_total": self.host_states.capacity, "tier_host_states_used": len(self.host_states.index),
            "tier_disk_pages_total": self.disk.capacity if self.disk else 0,
            "tier_disk_pages_used": len(self.disk.index) if self.disk else 0,
            "tier_disk_corrupt_total": self.disk.corrupt if self.disk else 0,
            "tier_hit_rate_permille": 1000 * hits // looked if looked else 0}
