"""ForwardBatch: everything one model step needs, as tensors, built by the runner.

Tokens of every sequence in the step are packed along one axis T. A sequence contributes its
`extend_len` new tokens; the `prefix_len` tokens before them already have K/V in the pool (and,
for hybrid models, their recurrent state in the sequence's state slot).

    seq i:   [ prefix_len_i (in pool) | extend_len_i (computed now) ]
    packed:  [ seq0 extend | seq1 extend | ... ]          T = sum(extend_len)

Invariant (hybrid): state slot `state_slots[i]` holds the DeltaNet state after exactly
`prefix_len_i` tokens when the step starts, and after `prefix_len_i + extend_len_i` when it ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixflow.kernels.attention import SharedPrefix
from radixflow.kernels.dispatch import Kernels, reference

REFERENCE = reference()


@dataclass
class ForwardBatch:
    is_decode: bool
    input_ids: torch.Tensor          # [T] int64
    positions: torch.Tensor          # [T] int64
    out_slots: torch.Tensor          # [T] int64: KV slot written by each new token
    prefix_lens: list[int]           # [N]
    extend_lens: list[int]           # [N]
    seq_slots: list[torch.Tensor]    # N x [prefix_len + extend_len] int64: every KV slot of the sequence
    state_slots: torch.Tensor        # [N] int64 (hybrid only; empty otherwise)
    logits_rows: torch.Tensor        # [M] int64: packed rows whose next-token logits are wanted
    slot_table: torch.Tensor | None = None   # decode: [N, Lmax] padded seq_slots
    seq_lens: torch.Tensor | None = None     # decode: [N]
    # cascade attention: prefixes whose pages several sequences share (read once per step)
    groups: list[SharedPrefix] = field(default_factory=list)
    own_table: torch.Tensor | None = None    # decode with groups: [N, Lmax] slots after the shared prefix
    own_lens: torch.Tensor | None = None     # decode with groups: [N]
    # decode with jump-forward drafts (runner._build_decode): a sequence has a row per position, so
    # rows of one sequence share a state slot and DeltaNet layers run them depth by depth. Depth d's
    # rows are the range depth_bounds[d]; their sequences are the first (end - start) of the order
    # of depth 0's rows (longest draft first)
    depth_bounds: list[tuple[int, int]] | None = None
    rows_of: list[list[int]] | None = None         # plan sequence -> its rows, by depth
    order_pos: dict[str, int] | None = None        # request id -> its sequence's place in that order
    saved: list = field(default_factory=list)      # per DeltaNet layer: ([conv state after depth d], [recurrent ...])
    # whether the states after each depth must be kept: some draft row may be undone, or a page
    # boundary falls inside a draft (its tail checkpoint is the state there)
    keep_states: bool = True
    # hybrid prefill: states wanted inside a sequence's chunk (planned checkpoints), so that a
    # checkpoint does not cut the step: seq index -> [(k, slot)], the state after its first k new
    # tokens (0 < k < extend_len) copied to `slot`, ascending k
    taps: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # a mixed step (prefill chunks, then decode rows): attention's view of each part (rows
    # [0, P) are the prefill part's, the rest the decode part's)
    prefill_part: "ForwardBatch | None" = None
    decode_part: "ForwardBatch | None" = None
    # which implementation of the paged-cache and DeltaNet decode ops the layers call (the runner's
    # pick: radixflow.kernels.dispatch)
    kernels: Kernels = REFERENCE
    _singles: tuple | None = None
    _pieces: tuple | None = None
    _windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.extend_lens)

    def single_rows(self) -> tuple[list[int], torch.Tensor, list[int]]:
        """Prefill: the sequences with one new token when there are several (a mixed step's decode
        rows, which DeltaNet layers run batched), their rows, and the other sequences."""
        if self._singles is None:
            ones = [i for i, e in enumerate(self.extend_lens) if e == 1]
            if len(ones) < 2:
                ones = []
            starts = [s for s, _ in self.bounds()]
            rows = torch.tensor([starts[i] for i in ones], dtype=torch.int64, device=self.input_ids.device)
            taken = set(ones)
            self._singles = (ones, rows, [i for i in range(len(self.extend_lens)) if i not in taken])
        return self._singles

    def prefill_pieces(self) -> tuple[list[tuple[int, int]], list[int], list[list[tuple[int, int]]]]:
        """Hybrid prefill: the rows, state slots and checkpoint taps of the sequences that
        single_rows leaves to the prefill kernels, as those take them. Once per batch (every
        DeltaNet layer asks, twice), so the slots leave the device once."""
        if self._pieces is None:
            rest, bounds = self.single_rows()[2], self.bounds()
            slots = self.state_slots[rest].tolist() if rest else []
            self._pieces = ([bounds[i] for i in rest], slots, [self.taps.get(i, []) for i in rest])
        return self._pieces

    def windowed(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode under a sliding window: slot_table clipped to each row's last `window` slots (left
        aligned, as the decode kernels read a row) and the clipped lengths. Once per step per window
        (every windowed layer asks)."""
        if window not in self._windowed:
            table, lens = self.slot_table, self.seq_lens
            width = min(window, table.shape[1])
            start = (lens - window).clamp(min=0)
            cols = (start[:, None] + torch.arange(width, device=table.device)[None, :]).clamp(max=table.shape[1] - 1)
            self._windowed[window] = (table.gather(1, cols), lens.clamp(max=window))
        return self._windowed[window]

    def bounds(self) -> list[tuple[int, int]]:
        """[start, end) of each sequence's rows in the packed axis."""
        out, s = [], 0
        for e in self.extend_lens:
            out.append((s, s + e))
            s += e
        return out
