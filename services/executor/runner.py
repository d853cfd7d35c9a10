"""ModelRunner: owns the weights and device memory; turns a Plan into tensors, runs the model,
samples. It makes no scheduling decisions."""
from __future__ import annotations

import functools

import torch

from . import sampler
from .batcher import Plan
from radixflow.kernels import cpu_ext
from radixflow.kernels.attention import SharedPrefix
from radixflow.kernels.dispatch import pick as pick_kernels

from .constrain import Constrainer
from .verify import DraftVerify
from .forward_batch import ForwardBatch
from .memory import KVPool, MemoryPlan, StatePool
from .models import CausalLM, ModelSpec, load_model


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def takes_cpu_kernels(device: str, kernels: str) -> bool:
    """Whether a runner with these settings picks the CPU kernels, whose build a process waits for
    before it serves (executor.service._cpu_kernels, the benchmarks' Engine baseline). An impossible
    choice: False (the runner raises the clear error)."""
    try:
        return pick_kernels(pick_device(device), kernels).name == "cpu"
    except ValueError:
        return False


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pick_dtype(device: torch.device, name: str = "auto") -> torch.dtype:
    """The compute (and KV) dtype. auto: bf16 on GPUs, as every engine serves; fp32 on a CPU, the
    exact path: there bf16 is an explicit choice (`--dtype bfloat16`), because it changes greedy
    outputs wherever the top two logits lie within bf16 rounding, and the product promises the
    same tokens with the cache on and off. Where the CPU multiplies bf16 natively (AMX), the
    executor logs the measured gain (cpu_bf16_speedup)."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}; got {name!r}")
        return DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@functools.cache
def cpu_bf16_speedup(m: int = 1024, k: int = 512, n: int = 1536) -> float:
    """fp32 time over bf16 time of one prefill-shaped matmul on this CPU (best of a few; ~0.1 s)."""
    import time
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        a, b = torch.randn(m, k).to(dt), torch.randn(k, n).to(dt)
        best = float("inf")
        for _ in range(6):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        out[dt] = best
    return out[torch.float32] / out[torch.bfloat16]


MIN_SHARED_TOKENS = 64   # below this, reading a prefix per sequence costs less than splitting
MIN_VIEW_TOKENS = 512    # a lone sequence: below this, gathering its keys costs less than splitting


def shared_prefixes(tables: list[list[int]], limits: list[int], page_size: int,
                    device: torch.device, singles: bool = True) -> list[SharedPrefix]:
    """Groups of sequences whose page tables start with the same pages (what radix matches hand
    out), with the longest such prefix within every member's `limit` tokens. A lone sequence whose
    first pages are contiguous forms a group of one: its prefix is then read as a view, not gathered."""
    by_first: dict[int, list[int]] = {}
    for i, (t, lim) in enumerate(zip(tables, limits)):
        if t and lim >= page_size:
            by_first.setdefault(t[0], []).append(i)
    groups = []
    for members in by_first.values():
        n = min(limits[i] for i in members) // page_size
        first = tables[members[0]]
        head = first[:n]
        for i in members[1:]:
            # slices compare in C (this runs at every decode step): a whole shared prefix at once,
            # and a bisection where a table parts earlier
            t = tables[i]
            if t[:n] != head:
                lo, hi = 0, n             # t and first share their first lo pages, not their first hi
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if t[:mid] == first[:mid]:
                        lo = mid
                    else:
                        hi = mid
                n, head = lo, first[:lo]
        run = n if n and head == list(range(first[0], first[0] + n)) else 1
        while run < n and first[run] == first[run - 1] + 1:
            run += 1
        if len(members) == 1:
            if not singles:
                continue
            n = run
        if n * page_size < (MIN_SHARED_TOKENS if len(members) > 1 else MIN_VIEW_TOKENS):
            continue
        pages = torch.tensor(first[:n], dtype=torch.int64)
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten().to(device)
        groups.append(SharedPrefix(seqs=members, slots=slots, start=first[0] * page_size if run >= n else -1))
    return groups


class ModelRunner(DraftVerify):
    def __init__(self, model_path: str, *, device: str = "auto", page_size: int, num_pages: int,
                 num_state_slots: int, dtype: str = "float32", state_dtype: torch.dtype = torch.float32,
                 kernels: str = "auto"):
        self.device = pick_device(device)
        self.dtype = pick_dtype(self.device, dtype)
        self.kernels = pick_kernels(self.device, kernels)
        self.spec = ModelSpec.from_dir(model_path)
        self.model: CausalLM = load_model(model_path, self.device, self.dtype)
        self.plan = MemoryPlan(page_size=page_size, num_pages=num_pages,
                               num_state_slots=num_state_slots if self.spec.is_hybrid else 0,
                               kv_dtype=self.dtype, state_dtype=state_dtype)
        self.kv = KVPool(self.spec, self.plan, self.device)
        self.state = StatePool(self.spec, self.plan, self.device) if self.spec.is_hybrid else None
        self.constrainer = Constrainer(self.spec.vocab_size, max_rows=64, kernels=self.kernels)
        self.last: ForwardBatch | None = None   # the last step's batch (state_after reads its saved states)
        self.drafted = 0     # jump-forward draft tokens computed ...
        self.kept = 0        # ... and kept
        self.certain = 0     # ... of them, the only token allowed there (kept without sampling)
        self.unsure = [0, 0]  # draft tokens that were not certain: [drafted, kept]

    def warmup(self, tokens: int = 2048) -> None:
        """One prefill and a few decode steps on scratch pages before serving, so the first request
        does not pay first-call costs (allocator growth, kernel selection). The pages and the state
        slot are left dirty, which is harmless: a page is read only at positions a request wrote,
        and a state slot is reset when a sequence starts in it."""
        from .sequence import Sequence
        from radixflow.shared.messages import SamplingParams
        ps = self.kv.page_size
        n_pages = min(-(-(tokens + 8) // ps), self.plan.num_pages)
        tokens = min(tokens, n_pages * ps - 8)
        seqs = [Sequence(rid=f"warmup-{i}", tokens=[(7 * j + i) % self.spec.vocab_size for j in range(tokens)],
                         sampling=SamplingParams(max_new_tokens=4, temperature=0), eos_ids=frozenset(),
                         pages=list(range(n_pages)), state_slot=0) for i in range(2)]
        for s in seqs:
            s.prompt_len = tokens
        toks = self.run(Plan(False, seqs, [tokens, tokens]))
        for _ in range(3):
            for i, s in enumerate(seqs):
                s.computed_len = len(s.tokens)
                s.tokens += toks[i]
            toks = self.run(Plan(True, seqs, [1, 1]))

    def _slots(self, seq) -> torch.Tensor:
        """Every token slot of a sequence's page table, computed once (and again when it grows: the
        engine clears it)."""
        if seq.slots is None:
            seq.slots = self.kv.token_slots(seq.pages, len(seq.pages) * self.kv.page_size).to(self.device)
        return seq.slots

    def build(self, plan: Plan) -> tuple[ForwardBatch, list[int], list[tuple[int, int]]]:
        """Tensors for one step, the indices (into plan.seqs) of sequences that get a token, and the
        prompt-logprob rows: (index into plan.seqs, token whose logprob the row gives), in order;
        their logits rows follow the sampled ones in fb.logits_rows. In a decode step a sequence
        with a jump-forward draft has a row per position (its pending token, then the draft), each
        one token attending to everything before it: fb.rows_of says which row is which."""
        if plan.is_decode:
            fb, want, lp = self._build_decode(plan), list(range(len(plan.seqs))), []
        elif plan.mixed:
            fb, want, lp = self._build_mixed(plan)
        else:
            fb, want, lp = self._build_prefill(plan)
        for part in (fb, fb.prefill_part, fb.decode_part):
            if part is not None:
                part.kernels = self.kernels
        return fb, want, lp

    def _build_mixed(self, plan: Plan) -> tuple[ForwardBatch, list[int], list[tuple[int, int]]]:
        """A prefill step whose last sequences are decode rows, one token each: the rows run through
        the model together, but attention takes the two parts apart (fb.prefill_part, fb.decode_part)
        so that the decode rows keep the decode kernels (one batched read of each shared prefix)."""
        n = sum(1 for s in plan.seqs if s.computed_len < s.prefill_len)
        pre, want, lp = self._build_prefill(Plan(False, plan.seqs[:n], plan.extend_lens[:n]))
        dec = self._build_decode(Plan(True, plan.seqs[n:], [1] * (len(plan.seqs) - n)))
        rows = pre.logits_rows.tolist()
        P, D = pre.input_ids.shape[0], dec.input_ids.shape[0]
        sampled = rows[:len(want)] + list(range(P, P + D))
        fb = ForwardBatch(
            is_decode=False,
            input_ids=torch.cat([pre.input_ids, dec.input_ids]),
            positions=torch.cat([pre.positions, dec.positions]),
            out_slots=torch.cat([pre.out_slots, dec.out_slots]),
            prefix_lens=pre.prefix_lens + dec.prefix_lens,
            extend_lens=pre.extend_lens + dec.extend_lens,
            seq_slots=pre.seq_slots + dec.seq_slots,
            state_slots=torch.cat([pre.state_slots, dec.state_slots]),
            logits_rows=torch.tensor(sampled + rows[len(want):], dtype=torch.int64, device=self.device))
        fb.prefill_part, fb.decode_part = pre, dec
        fb.taps = pre.taps
        return fb, want + list(range(n, len(plan.seqs))), lp

    def _build_prefill(self, plan: Plan) -> tuple[ForwardBatch, list[int], list[tuple[int, int]]]:
        dev = self.device
        ids, pos, out_slots, seq_slots, rows, want = [], [], [], [], [], []
        lp_rows, lp = [], []
        row = 0
        for i, (seq, ext) in enumerate(zip(plan.seqs, plan.extend_lens)):
            start, end = seq.computed_len, seq.computed_len + ext
            if seq.logprob_start >= 0:
                # the logits at position p predict token p + 1
                for p in range(max(start, seq.logprob_start - 1, 0), min(end, seq.prompt_len - 1)):
                    lp_rows.append(row + p - start)
                    lp.append((i, seq.tokens[p + 1]))
            slots = self._slots(seq)[:end]
            ids.extend(seq.tokens[start:end])
            pos.extend(range(start, end))
            out_slots.append(slots[start:end])
            seq_slots.append(slots)
            row += ext
            if end == len(seq.tokens) and not seq.prefill_only:   # the prompt is complete: this step yields a token
                rows.append(row - 1)
                want.append(i)
        fb = ForwardBatch(
            is_decode=False,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            out_slots=torch.cat(out_slots),
            prefix_lens=[s.computed_len for s in plan.seqs],
            extend_lens=list(plan.extend_lens),
            seq_slots=seq_slots,
            state_slots=torch.tensor([s.state_slot for s in plan.seqs], dtype=torch.int64, device=dev),
            logits_rows=torch.tensor(rows + lp_rows, dtype=torch.int64, device=dev))
        if self.state is not None:
            fb.taps = {i: sorted((p - s.computed_len, slot) for p, slot in s.checkpoints.items()
                                 if s.computed_len < p < s.computed_len + ext)
                       for i, (s, ext) in enumerate(zip(plan.seqs, plan.extend_lens))}
            fb.taps = {i: t for i, t in fb.taps.items() if t}
        # a shared prefix lies within what every member computed before this step; in a prefill
        # the new tokens are many and are better read together with the rest of their sequence by
        # one masked kernel, so no groups of one
        fb.groups = [] if self.spec.layer_windows else shared_prefixes(
            [s.pages for s in plan.seqs], [s.computed_len for s in plan.seqs], self.kv.page_size, dev, singles=False)
        return fb, want, lp

    def _build_decode(self, plan: Plan) -> ForwardBatch:
        """Without drafts, one row per sequence. With drafts, rows are laid out depth by depth: every
        sequence's pending token first, then the first draft token of each sequence that has one,
        and so on, with the sequences ordered by draft length, longest first. So the rows of a depth
        are a contiguous range, and the sequences they belong to are a prefix of that order (what
        the DeltaNet layers' depth loop wants: slices, not gathers)."""
        dev, ps = self.device, self.kv.page_size
        seqs = plan.seqs
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i].draft))
        depths = 1 + len(seqs[order[0]].draft)
        ids, pos, out_slots, seq_slots, state_slots = [], [], [], [], []
        rows_of: list[list[int]] = [[] for _ in seqs]
        bounds = []
        for d in range(depths):
            start = len(ids)
            for i in order:
                seq = seqs[i]
                if d > len(seq.draft):
                    break
                p = seq.computed_len + d        # computed_len: the pending token's position
                rows_of[i].append(len(ids))
                ids.append(seq.draft[d - 1] if d else seq.tokens[p])
                pos.append(p)
                out_slots.append(seq.pages[p // ps] * ps + p % ps)
                seq_slots.append(self._slots(seq)[:p + 1])
                state_slots.append(seq.state_slot)
            bounds.append((start, len(ids)))
        n = len(ids)
        fb = ForwardBatch(
            is_decode=True,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            out_slots=torch.tensor(out_slots, dtype=torch.int64, device=dev),
            prefix_lens=list(pos),
            extend_lens=[1] * n,
            seq_slots=seq_slots,
            state_slots=torch.tensor(state_slots, dtype=torch.int64, device=dev),
            logits_rows=torch.arange(n, dtype=torch.int64, device=dev))
        if depths > 1:
            fb.depth_bounds = bounds
            fb.rows_of = rows_of
            fb.order_pos = {seqs[i].rid: j for j, i in enumerate(order)}
            fb.keep_states = any(len(s.draft) > s.certain or self._boundary_inside(s) for s in seqs if s.draft)
        # groups are found among sequences, as without drafts, then take in all rows of their members.
        # No groups of one where the CPU decode kernel reads every row's slots in place: a lone
        # sequence is then one call over its whole context, not two (own part, prefix) and a merge
        # (a cache-off batch of 39 lone rows would be 39 calls and merges a layer)
        singles = not (self.kernels.name == "cpu" and cpu_ext.get() is not None)
        # a sliding window cuts into a shared prefix differently for every row: no cascade groups
        groups = [] if self.spec.layer_windows else shared_prefixes(
            [s.pages for s in seqs], [s.computed_len for s in seqs], ps, dev, singles=singles)
        fb.groups = [SharedPrefix(seqs=[r for i in g.seqs for r in rows_of[i]], slots=g.slots, start=g.start)
                     for g in groups]
        lens = [len(s) for s in seq_slots]
        fb.seq_lens = torch.tensor(lens, dtype=torch.int64, device=dev)
        if fb.groups:
            start = [0] * n
            for g in fb.groups:
                for i in g.seqs:
                    start[i] = len(g.slots)
            own = [sl[st:] for sl, st in zip(seq_slots, start)]
            fb.own_lens = torch.tensor([m - st for m, st in zip(lens, start)], dtype=torch.int64, device=dev)
            fb.own_table = torch.nn.utils.rnn.pad_sequence(own, batch_first=True)
        else:
            fb.slot_table = torch.nn.utils.rnn.pad_sequence(seq_slots, batch_first=True)
        return fb

    def run(self, plan: Plan) -> dict[int, list[int]]:
        """Run one step; returns {index in plan.seqs: its new tokens} for sequences that produce
        some: one token, or in a decode step with a jump-forward draft the pending token's sample
        and then one more for each draft token kept (see jump.py). Logprobs asked for are appended
        to the sequences (prompt ones, and the kept tokens')."""
        if self.state is not None:
            restores, fresh = [], []
            for seq in plan.seqs:
                if not seq.state_ready:   # first step: resume from the checkpoint, or from zero
                    if seq.restore_slot >= 0:
                        restores.append((seq.restore_slot, seq.state_slot))
                    else:
                        fresh.append(seq.state_slot)
                    seq.state_ready = True
            self.state.copy_many(restores)
            self.state.reset_many(fresh)
        fb, want, lp = self.build(plan)
        self.last = fb
        if fb.depth_bounds is not None:       # drafts: _verify decides which rows get full logits
            return self._verify(fb, [plan.seqs[i] for i in want], self.model(fb, self.kv, self.state, head=False))
        logits = self.model(fb, self.kv, self.state)
        if lp:
            self._prompt_logprobs(plan, logits[len(want):], lp)
            logits = logits[:len(want)]
        if not want:
            return {}
        seqs = [plan.seqs[i] for i in want]
        matchers = [s.matcher for s in seqs]
        out = sampler.sample(logits, seqs, mask=lambda x: self.constrainer.mask(x, matchers, [s.tokens[-1] for s in seqs]))
        for s, v, top in zip(seqs, out.logprobs, out.top):
            self._keep_logprobs(s, v, top)
        return {i: [t] for i, t in zip(want, out.tokens)}

    @staticmethod
    def _keep_logprobs(s, v, top) -> None:
        if v is not None:
            s.logprobs.append(v)
        if top is not None:
            s.top_logprobs.append(top)

    def _prompt_logprobs(self, plan: Plan, logits: torch.Tensor, lp: list[tuple[int, int]]) -> None:
        """The prompt-logprob rows of this step (raw logits [len(lp), V]) -> each sequence's
        input_logprobs, and input_top_logprobs where it asked for top_logprobs."""
        targets = torch.tensor([t for _, t in lp], dtype=torch.int64, device=logits.device)
        ks = [plan.seqs[i].sampling.top_logprobs for i, _ in lp]
        vals, tops = sampler.pick(torch.log_softmax(logits, dim=-1), targets, ks)
        for (i, _), v, top in zip(lp, vals, tops):
            plan.seqs[i].input_logprobs.append(v)
            if top is not None:
                plan.seqs[i].input_top_logprobs.append(top)
