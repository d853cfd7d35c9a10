"""TierIndex: what an executor's KV tiers (host memory, disk) hold, as the radix service knows it, so
that placement counts what a prompt would load from them beside what it would reuse on the device.

The tiers live with their data, in the executor (services/executor/tiers.py), and name each page by its
key (shared/page_keys.py); with every RadixStep the executor reports the keys its tiers gained and lost.
Radix holds those keys, not the pages, and reads a prompt's keys against them from where its device
match ends: the run of pages a tier has (dense), or, for a hybrid model, that run up to the deepest
page whose state a tier has too (what the executor's load would take). The executor reports after the
fact and its tiers evict on their own, so this is a placement hint: a page gone meanwhile is computed.
No torch, no I/O.
"""
from __future__ import annotations

from radixflow.shared.messages import RadixStep
from radixflow.shared.page_keys import PageKeys


class TierIndex:
    def __init__(self, root: bytes, page_size: int, hybrid: bool, max_pages: int = 0):
        self.root, self.ps, self.hybrid = root, page_size, hybrid
        self.max_pages = max_pages        # the most pages one load takes there (0: no bound known)
        self.pages: set[bytes] = set()
        self.states: set[bytes] = set()

    @property
    def on(self) -> bool:
        return bool(self.root)

    def apply(self, msg: RadixStep) -> None:
        self.pages.difference_update(msg.tier_pages_dropped)
        self.pages.update(msg.tier_pages_added)
        self.states.difference_update(msg.tier_states_dropped)
        self.states.update(msg.tier_states_added)

    def loadable(self, namespace: str, tokens: list[int], start: int,
                 chains: dict[bytes, PageKeys] | None = None) -> int:
        """Tokens of the prompt after `start` (a page boundary: its device match) that the tiers would
        load; the last prompt token is always computed. Keys are computed only as far as the run goes,
        and shared through `chains` (root -> PageKeys) by the pools of one placement."""
        if not self.root or not self.pages or start % self.ps:
            return 0
        last = (len(tokens) - 1) // self.ps
        first = start // self.ps
        if self.max_pages:
            last = min(last, first + self.max_pages)
        if last <= first:
            return 0
        chains = {} if chains is None else chains
        keys = chains.get(self.root)
        if keys is None:
            keys = chains[self.root] = PageKeys(self.root, namespace, tokens, self.ps)
        n = best = 0
        for i in range(first, last):
            key = keys.at(i)
            if key not in self.pages:
                break
            n += 1
            if key in self.states:
                best = n
        return (best if self.hybrid else n) * self.ps

    def stats(self) -> dict[str, int]:
        return {"tier_pages_known": len(self.pages), "tier_states_known": len(self.states)}
