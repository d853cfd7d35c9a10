"""Prefill/decode disaggregation, the moving part: a prefill executor's finished prompt (its whole
pages, and a hybrid model's state after them; Engine.exports) as KVPages messages of at most
`max_bytes` each (NATS's payload limit is 1 MiB by default), in page order, the state on the last.
The decode executor stores them in its host tier (Engine.import_pages), where the request, sent
there next, finds them as it finds any evicted prefix (tiers.py)."""
from __future__ import annotations

import torch

from radixflow.shared.messages import KVPages

from .tiers import raw_bytes

MAX_BYTES = 768 * 1024


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

