"""The two stores under KVTiers (tiers.py): Host, fixed-size entries of tensors in host memory by key
(LRU), and Disk, checksummed files by key (LRU)."""
from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from pathlib import Path

import torch

_MAGIC = b"RFKV1\n"
_SUM = 32          # blake2b digest of the payload, after the magic


def raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes as they lie (numpy has no bfloat16: such a tensor is read as bytes)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class Disk:
    """Files named by key under `root`, at most `capacity` of them (LRU; files already there from an
    earlier run are indexed at start, oldest first). A file is magic, checksum, payload."""

    def __init__(self, root: str, capacity: int):
        self.root, self.capacity = Path(root), capacity
        self.root.mkdir(parents=True, exist_ok=True)
        self.index: OrderedDict[bytes, None] = OrderedDict()
        old = sorted(self.root.glob("*.kv*"), key=lambda p: p.stat().st_mtime)
        for p in old:
            try:
                self.index[bytes.fromhex(p.name.split(".")[0]) + p.suffix.encode()] = None
            except ValueError:
                continue
        self.corrupt = 0
        self.touched: set[bytes] = set()     # names put or dropped since KVTiers last reported them
        while len(self.index) > self.capacity:
            self._drop(next(iter(self.index)))
        self.touched |= set(self.index)      # files from an earlier run: reported like new ones

    def _path(self, name: bytes) -> Path:
        return self.root / (name[:16].hex() + name[16:].decode())

    def _drop(self, name: bytes) -> None:
        self.index.pop(name, None)
        self.touched.add(name)
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass

    def put(self, name: bytes, payload: bytes) -> None:
        if self.capacity <= 0:
            return
        while name not in self.index and len(self.index) >= self.capacity:
            self._drop(next(iter(self.index)))
        tmp = self._path(name).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(_MAGIC + hashlib.blake2b(payload, digest_size=_SUM).digest() + payload)
        os.replace(tmp, self._path(name))          # a reader never sees half a file under its name
        self.index[name] = None
        self.touched.add(name)

    def read(self, name: bytes, size: int) -> bytes | None:
        """The payload of an indexed file, or None (missing, short or failing its checksum). Touches
        nothing but the file: the prefetch thread reads with it outside the tiers' lock."""
        try:
            raw = self._path(name).read_bytes()
        except OSError:
            return None
        head = len(_MAGIC) + _SUM
        payload = raw[head:]
        if (len(raw) != head + size or raw[:len(_MAGIC)] != _MAGIC
                or hashlib.blake2b(payload, digest_size=_SUM).digest() != raw[len(_MAGIC):head]):
            return None
        return payload

    def bad(self, name: bytes) -> None:
        """A file that failed to read: counted and dropped (its tokens are computed again)."""
        if name in self.index:
            self.corrupt += 1
            self._drop(name)

    def touch(self, name: bytes) -> None:
        self.index.move_to_end(name)

    def get(self, name: bytes, size: int) -> bytes | None:
        """The payload, or None (absent; or missing, short or failing its checksum: then dropped)."""
        if name not in self.index:
            return None
        payload = self.read(name, size)
        if payload is None:
            self.bad(name)
            return None
        self.touch(name)
        return payload

    def __contains__(self, name: bytes) -> bool:
        return name in self.index


class Host:
    """`capacity` entries of tensors shaped like `shapes`, by key, LRU. Evicting one hands it to
    `spill` (the disk tier) first."""

    def __init__(self, capacity: int, shapes: list[tuple[tuple[int, ...], torch.dtype]], pin: bool):
        self.capacity = capacity
        self.store = [torch.empty((capacity, *s), dtype=d, pin_memory=pin) for s, d in shapes]
        self.index: OrderedDict[bytes, int] = OrderedDict()
        self.free = list(range(capacity - 1, -1, -1))
        self.touched: set[bytes] = set()     # keys stored or evicted since KVTiers last reported them

    def slot_for(self, key: bytes, spill) -> int | None:
        """A slot to write `key` into: a free one, or the least recent one's (spilled first)."""
        if self.capacity <= 0:
            return None
        if not self.free:
            old, slot = self.index.popitem(last=False)
            spill(old, slot)
            self.free.append(slot)
            self.touched.add(old)
        slot = self.free.pop()
        self.index[key] = slot
        self.touched.add(key)
        return slot

    def get(self, key: bytes) -> int | None:
        slot = self.index.get(key)
        if slot is not None:
            self.index.move_to_end(key)
        return slot

    @property
    def entry_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.store)

    def pack(self, slot: int) -> bytes:
        """An entry's tensors as bytes, in order (what a disk file holds)."""
        return b"".join(raw_bytes(t[slot]) for t in self.store)

    def unpack(self, slot: int, raw: bytes) -> None:
        off = 0
        for t in self.store:
            n = t[0].numel() * t.element_size()
            t[slot].copy_(torch.frombuffer(bytearray(raw[off:off + n]), dtype=t.dtype).view(t.shape[1:]))
            off += n


def changes(host: Host, states: Host, disk: Disk | None,
            limit: int) -> tuple[list[bytes], list[bytes], list[bytes], list[bytes]] | None:
    """What the stores gained and lost since they were last asked, by key: (pages added, pages
    dropped, states added, states dropped), at most `limit` keys (the rest stay for the next call);
    None when nothing changed. A key touched is added if any store still holds it (host or disk),
    else dropped, so that telling a change twice changes nothing."""
    if disk is not None:
        for name in disk.touched:                  # ".kv" a page, ".kvs" a state
            (host.touched if name.endswith(b".kv") else states.touched).add(name[:16])
        disk.touched = set()
    out: tuple[list[bytes], ...] = ([], [], [], [])
    for store, suffix, added, dropped in ((host, b".kv", out[0], out[1]), (states, b".kvs", out[2], out[3])):
        while store.touched and limit:
            key = store.touched.pop()
            limit -= 1
            held = key in store.index or (disk is not None and key + suffix in disk)
            (added if held else dropped).append(key)
    return out if any(out) else None
