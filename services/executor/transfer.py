"""Prefill/decode disaggregation, the moving part: a prefill executor's finished prompt (its whole
pages, and a hybrid model's state after them; Engine.exports) as KVPages messages of at most
`max_bytes` each (NATS's payload limit is 1 MiB by default), in page order, the state on the last.
The decode executor stores them in its host tier (Engine.import_pages), where the request, sent
there next, finds them as it finds any evicted prefix (tiers.py)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from radixflow.shared.errors import BadRequest
from radixflow.shared.messages import KVPages

from .memory import dtype_bytes
from .tier_stores import raw_bytes

if TYPE_CHECKING:
    from .memory import KVPool, StatePool
    from .sequence import Sequence

MAX_BYTES = 768 * 1024


def export_pages(kv: "KVPool", state: "StatePool | None", seq: "Sequence", pages: int,
                 first: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """seq's pages first .. pages - 1 as host copies (K and V, [pages - first, attention layers,
    page_size, kv heads, head_dim]) and, on a hybrid model, its state after them (from the checkpoint
    slot planned there; empty if none): what a prefill executor moves to a decode executor (KVPages)."""
    ps = kv.page_size
    idx = torch.tensor(seq.pages[first:pages], dtype=torch.int64, device=kv.k[0].device)
    k = torch.stack([t.view(-1, ps, *t.shape[1:]).index_select(0, idx) for t in kv.k], 1).cpu()
    v = torch.stack([t.view(-1, ps, *t.shape[1:]).index_select(0, idx) for t in kv.v], 1).cpu()
    out = []
    slot = seq.checkpoints.get(pages * ps) if state is not None else None
    if slot is not None:
        out = [t[slot].cpu().clone() for t in state.recurrent + state.conv]
    return k, v, out


def parts(export: tuple, max_bytes: int = MAX_BYTES) -> list[KVPages]:
    """export: (target, namespace, tokens, first page, K, V, state) as Engine._finish keeps it."""
    _, namespace, tokens, start, k, v, state = export
    n = k.shape[0]
    if n == 0:
        return []
    per = 2 * k[0].numel() * k.element_size()
    ps = len(tokens) // (start + n)
    step = max(1, max_bytes // per)
    dtype = str(k.dtype).replace("torch.", "")
    state_bytes = b"".join(raw_bytes(t) for t in state)
    out = []
    for first in range(0, n, step):
        count = min(step, n - first)
        kv = torch.stack([k[first:first + count], v[first:first + count]], 1)     # [count, 2, ...]
        out.append(KVPages(namespace=namespace, tokens=tokens[:(start + first + count) * ps], first=start + first,
                           count=count, dtype=dtype, data=raw_bytes(kv),
                           state=state_bytes if first + count == n else b""))
    return out



def unpack(msg: KVPages, tiers, dtype: torch.dtype, page_size: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """A KVPages message as the receiver's host tier takes it (K and V [count, *page shape], the
    state's tensors), checked against that tier: a clear error for a sender that disagrees on the
    model or the layout."""
    shape = tiers.page_shape()
    if msg.dtype != str(dtype).replace("torch.", ""):
        raise BadRequest(f"pages in {msg.dtype}, this pool holds {dtype}")
    per = 2 * math.prod(shape) * dtype_bytes(dtype)
    if msg.count <= 0 or len(msg.data) != msg.count * per or len(msg.tokens) < (msg.first + msg.count) * page_size:
        raise BadRequest(f"{len(msg.data)} bytes and {len(msg.tokens)} tokens do not make {msg.count} pages "
                         f"of {per} bytes from page {msg.first}")
    states = tiers.state_tensors()
    if msg.state and len(msg.state) != sum(math.prod(sh) * dtype_bytes(dt) for sh, dt in states):
        raise BadRequest("the state does not match this model's")
    raw = torch.frombuffer(bytearray(msg.data), dtype=dtype).view(msg.count, 2, *shape)
    state, off = [], 0
    for sh, dt in states if msg.state else ():
        n = math.prod(sh) * dtype_bytes(dt)
        state.append(torch.frombuffer(bytearray(msg.state[off:off + n]), dtype=dt).view(sh))
        off += n
    return raw[:, 0], raw[:, 1], state
