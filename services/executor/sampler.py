"""Sampling, batched: one step's rows go through the same tensor ops, in this order:

    raw logits [N, V] --> log_softmax of the raw rows that asked for logprobs (taken first: the rest
       |                   works in place)
       | logit_bias, repetition / frequency / presence penalties   (skipped when no row uses them)
       | grammar mask                                              (the runner's, in place)
       | temperature, top-k, top-p, min-p: per-row tensors         (filters skipped when no row filters)
       v
    greedy rows: argmax;  others: argmax(probs / Exp(1) noise)     (the exponential race)

The race samples from `probs` exactly and lets each row bring its own noise: a seeded row draws
its noise from its own generator, so its tokens do not depend on what else shares the batch;
unseeded rows draw theirs together from the global generator.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from radixflow.shared.messages import SamplingParams, TopLogprobs

from .sequence import Sequence


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), the same index (the first of equal maxima; NaN counts as the largest), by
    max(dim), which is faster on a CPU than argmax."""
    return x.max(dim=-1).indices


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature <= 0.0 or p.top_k == 1


def wants_logprobs(p: SamplingParams) -> bool:
    return p.logprobs or p.top_logprobs > 0


def has_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


class Sampled(NamedTuple):
    tokens: list[int]                  # one per row
    logprobs: list[float | None]       # the token's raw logprob, for rows that want logprobs
    top: list[TopLogprobs | None]      # the row's top_logprobs most likely tokens, when > 0


@torch.inference_mode()     # the model's logits are inference tensors; they are changed in place here
def sample(logits: torch.Tensor, seqs: list[Sequence],
           mask: Callable[[torch.Tensor], None] | None = None) -> Sampled:
    """logits [N, V] fp32, one row per sequence (modified in place) -> one token per row.
    `mask` applies the grammar masks in place, after the penalties and before temperature."""
    params = [s.sampling for s in seqs]
    greedy = [is_greedy(p) for p in params]
    lp_rows = [j for j, p in enumerate(params) if wants_logprobs(p)]
    lp = None
    if lp_rows:
        # a new tensor: what follows may change `logits` in place
        lp = torch.log_softmax(logits[_index(lp_rows, logits)] if len(lp_rows) < len(seqs) else logits, dim=-1)
    if any(p.logit_bias for p in params):
        _bias(logits, params)
    pen_rows = [j for j, p in enumerate(params) if has_penalties(p)]
    if pen_rows:
        _penalize(logits, [seqs[j] for j in pen_rows], pen_rows)
    if mask is not None:
        mask(logits)
    drawn = [j for j, g in enumerate(greedy) if not g]
    if len(drawn) == len(seqs):
        toks = _draw(logits, seqs, drawn)
    else:
        toks = argmax(logits)
        if drawn:
            toks[_index(drawn, logits)] = _draw(logits, [seqs[j] for j in drawn], drawn)
    if lp is None:
        return Sampled(toks.tolist(), [None] * len(seqs), [None] * len(seqs))
    vals, tops = pick(lp, toks[_index(lp_rows, logits)], [params[j].top_logprobs for j in lp_rows])
    out_lp, out_top = [None] * len(seqs), [None] * len(seqs)
    for j, v, t in zip(lp_rows, vals, tops):
        out_lp[j], out_top[j] = v, t
    return Sampled(toks.tolist(), out_lp, out_top)


def pick(lp: torch.Tensor, targets: torch.Tensor, ks: list[int]) -> tuple[list[float], list[TopLogprobs | None]]:
    """lp [R, V] logprobs -> the logprob of each row's target, and each row's ks[r] most likely
    tokens (one topk with the largest k; None where ks[r] is 0)."""
    vals = lp.gather(1, targets[:, None])[:, 0].tolist()
    k = min(max(ks, default=0), lp.shape[-1])
    if k == 0:
        return vals, [None] * len(vals)
    tv, ti = lp.topk(k, dim=-1)
    tv, ti = tv.tolist(), ti.tolist()
    return vals, [TopLogprobs(ids=i[:kr], logprobs=v[:kr]) if kr > 0 else None for i, v, kr in zip(ti, tv, ks)]


# ---------------------------------------------------------------- biases and penalties


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=like.device)


def _bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    rows, ids, vals = [], [], []
    for j, p in enumerate(params):
        for t, b in p.logit_bias.items():
            rows.append(j)
            ids.append(t)
            vals.append(b)
    dev = logits.device
    logits.index_put_((_index(rows, logits), _index(ids, logits)), torch.tensor(vals, dtype=logits.dtype, device=dev),
                      accumulate=True)


class Penalties:
    """One sequence's penalty state on the device: how often each token occurs in its output, and
    (repetition penalty only) which tokens its prompt holds.

    The counts are kept incrementally, not rebuilt from the output ids each step: a rebuild reads
    and uploads the whole output (and prompt) of every penalized row every step, which grows with
    the output; an update adds only the tokens sampled since (one per step)."""

    def __init__(self, seq: Sequence, vocab: int, device: torch.device):
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)   # [V]
        self.counted = 0                 # output tokens already in `counts`
        self.prompt = None               # [V] bool
        if seq.sampling.repetition_penalty != 1.0:
            ids = torch.tensor(seq.tokens[: seq.prompt_len], dtype=torch.int64, device=device)
            self.prompt = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, True)


def _penalize(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """OpenAI / vLLM semantics on the rows `rows` of logits: repetition (CTRL) over prompt and
    output tokens, then minus frequency * count and presence * (count > 0) over output tokens."""
    dev, V = logits.device, logits.shape[-1]
    upd_rows, upd_ids = [], []
    for j, s in enumerate(seqs):
        if s.penalties is None:
            s.penalties = Penalties(s, V, dev)
        st = s.penalties
        for t in s.tokens[s.prompt_len + st.counted:]:
            upd_rows.append(j)
            upd_ids.append(t)
        st.counted = s.num_output
    counts = torch.stack([s.penalties.counts for s in seqs])                 # [P, V]
    if upd_ids:
        counts.index_put_((_index(upd_rows, logits), _index(upd_ids, logits)),
                          torch.ones(len(upd_ids), device=dev), accumulate=True)
    # each sequence's counts become a view of this step's stacked tensor: updating the stack updated
    # them all, with no copy back (the next step's stack copies them out again)
    for j, s in enumerate(seqs):
        s.penalties.counts = counts[j]
    params = [s.sampling for s in seqs]
    idx = None if len(rows) == logits.shape[0] else _index(rows, logits)
    x = logits if idx is None else logits[idx]                                 # [P, V]
    seen = counts > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        none = torch.zeros(V, dtype=torch.bool, device=dev)
        in_prompt = torch.stack([s.penalties.prompt if s.penalties.prompt is not None else none for s in seqs])
        r = _column([p.repetition_penalty for p in params], logits)
        x = torch.where(seen | in_prompt, torch.where(x > 0, x / r, x * r), x)
    if any(p.frequency_penalty for p in params):
        x.sub_(_column([p.frequency_penalty for p in params], logits) * counts)
    if any(p.presence_penalty for p in params):
        x.sub_(_column([p.presence_penalty for p in params], logits) * seen)
    if idx is not None:
        logits[idx] = x
    elif x is not logits:
        logits.copy_(x)


def _column(vals: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(vals, dtype=like.dtype, device=like.device)[:, None]


# ---------------------------------------------------------------- temperature, filters, the draw


def _draw(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
    """Sample the rows `rows` of logits (their sequences `seqs`): [len(rows)] token ids."""
    dev = logits.device
    params = [s.sampling for s in seqs]
    x = logits[_index(rows, logits)] if len(rows) < logits.shape[0] else logits
    x = x / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    x = filter_batch(x, [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params])
    probs = torch.softmax(x, dim=-1)
    # uniform noise U, then the race's Exp(1) noise as -log U: a U of 0 makes it inf (the token
    # loses, rightly), where an exponential_ of 0 would turn a filtered token's 0 / 0 into a NaN
    # that argmax takes for the largest
    noise = torch.empty_like(probs)
    if any(p.seed is None for p in params):
        noise.uniform_()
    for j, s in enumerate(seqs):
        if s.sampling.seed is not None:
            if s.generator is None:
                s.generator = torch.Generator(device=dev).manual_seed(s.sampling.seed)
            noise[j].uniform_(generator=s.generator)
    return argmax(probs.div_(noise.log_().neg_()))


NUCLEUS_CANDIDATES = 1024    # filter_batch: top-p tries the nucleus within this many most likely tokens


def filter_batch(x: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """x [N, V] temperature-scaled logits and each row's top_k (<= 0 or >= V: off), top_p, min_p ->
    logits with filtered-out tokens at -inf; row by row the same as `filter_logits`. Only the
    filters some row uses run: the common case (temperature alone) returns x untouched."""
    V = x.shape[-1]
    dev, ninf = x.device, float("-inf")
    top_k = [k if 0 < k < V else V for k in top_k]
    use_k, use_p, use_min = min(top_k) < V, min(top_p) < 1.0, max(min_p) > 0.0
    if not (use_k or use_p):
        if not use_min:
            return x
        probs = torch.softmax(x, dim=-1)                # min-p alone needs no sort
        mp = torch.tensor(min_p, device=dev)[:, None]
        return x.masked_fill(probs < mp * probs.amax(dim=-1, keepdim=True), ninf)
    # the candidates, most likely first. When every row has a top-k, all of them lie within the
    # largest k: a topk of that many replaces the sort of the whole vocabulary. So does a nucleus
    # (a top-p row's kept tokens are a prefix of its sorted order) that the top NUCLEUS_CANDIDATES
    # tokens cover: tried first, the full sort only where some row's nucleus is wider
    kmax = max(top_k)
    full = None             # rows without a top-k: softmax over the whole row, not the candidates
    if kmax == V and use_p and all(p < 1.0 or k <= NUCLEUS_CANDIDATES for p, k in zip(top_p, top_k)) \
            and V > NUCLEUS_CANDIDATES:
        sv, si = x.topk(NUCLEUS_CANDIDATES, dim=-1)
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        mass = torch.exp(sv - lse).sum(-1)
        tp = torch.tensor(top_p, device=dev)
        if bool(((mass >= tp) | (tp >= 1.0)).all()):
            full = lse
        else:
            sv, si = x.sort(dim=-1, descending=True)
    else:
        sv, si = x.topk(kmax, dim=-1) if kmax < V else x.sort(dim=-1, descending=True)     # [N, K]
    if use_k:
        kth = sv.gather(1, torch.tensor([min(k, sv.shape[1]) for k in top_k], device=dev)[:, None] - 1)
        sv = sv.masked_fill(sv < kth, ninf)            # ties with the k-th stay, as in filter_logits
    if use_p or use_min:
        sp = torch.softmax(sv, dim=-1)
        if full is not None:    # rows without a top-k: probabilities over the whole row
            no_k = torch.tensor([k >= V for k in top_k], device=dev)[:, None]
            sp = torch.where(no_k, torch.exp(sv - full), sp)
        drop = torch.zeros_like(sv, dtype=torch.bool)
        if use_min:
            drop |= sp < torch.tensor(min_p, device=dev)[:, None] * sp[:, :1]
        if use_p:
            # the mass strictly before a token already reaches top_p; rows at 1.0 are spared: their
            # cumsum can round past 1.0 and drop tail tokens a batch without top-p rows would keep
            tp = torch.tensor(top_p, device=dev)[:, None]
            drop |= ((sp.cumsum(-1) - sp) >= tp) & (tp < 1.0)
        sv = sv.masked_fill(drop, ninf)
    return torch.full_like(x, ninf).scatter_(1, si, sv)


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row [V] -> temperature-scaled logits with filtered-out tokens at -inf. The per-row
    reference for `filter_batch` (the tests compare the two)."""
    x = logits / p.temperature
    if p.top_k > 0 and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0 or p.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0.0:
            x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_p < 1.0:
            sp, idx = probs.sort(descending=True)
            # drop a token once the mass strictly before it already reaches top_p (the first always stays)
            drop = (sp.cumsum(-1) - sp) >= p.top_p
            x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return x
