"""Page keys: what a page of KV holds, named by a chain hash over the cache namespace and the tokens of
the page and of every page before it, from a root that names the model (so a key means the same KV in
any request and on any executor of that model, and never crosses a namespace). The executor's KV tiers
store pages under these keys; the radix service reads the keys the tiers report against a prompt."""
from __future__ import annotations

import hashlib
from array import array


def chain(prev: bytes, tokens: list[int]) -> bytes:
    """The key after `prev` for these tokens (a page's, or the namespace's at the root)."""
    return hashlib.blake2b(prev + array("q", tokens).tobytes(), digest_size=16).digest()


def root_key(identity: str) -> bytes:
    """The root of every chain for a model whose KV depends on `identity` (tiers.model_identity)."""
    return hashlib.blake2b(identity.encode(), digest_size=16).digest()


class PageKeys:
    """The keys of a prompt's pages in a namespace, computed as far as asked and kept."""

    def __init__(self, root: bytes, namespace: str, tokens: list[int], page_size: int):
        self.tokens, self.ps = tokens, page_size
        self.ks = [chain(root, list(namespace.encode()))]      # the namespace's root: nothing shared across

    def at(self, i: int) -> bytes:
        """The key of page i (a whole page of the tokens)."""
        while len(self.ks) <= i + 1:
            j = len(self.ks) - 1
            self.ks.append(chain(self.ks[-1], self.tokens[j * self.ps:(j + 1) * self.ps]))
        return self.ks[i + 1]

    def upto(self, pages: int) -> list[bytes]:
        """The keys of the first `pages` pages (whole pages of the tokens only)."""
        pages = min(pages, len(self.tokens) // self.ps)
        while len(self.ks) <= pages:
            i = len(self.ks) - 1
            self.ks.append(chain(self.ks[-1], self.tokens[i * self.ps:(i + 1) * self.ps]))
        return self.ks[1:pages + 1]
