"""Sequence: one request's state inside an executor.

Lengths, in the order they must keep (asserted in `check`):

    0 <= cached_len <= computed_len <= len(tokens) <= max_model_len
    cached_len    prompt tokens whose KV came from the cache (never computed here)
    computed_len  tokens whose KV (and recurrent state) are in memory
    tokens        prompt + generated so far; the last one is computed by the next decode step
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from radixflow.shared.messages import SamplingParams, TopLogprobs
from radixflow.shared.page_keys import PageKeys


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    rid: str
    tokens: list[int]
    sampling: SamplingParams
    eos_ids: frozenset[int]
    namespace: str = "default"
    output_subject: str = ""
    prompt_len: int = 0
    cached_len: int = 0
    computed_len: int = 0
    pages: list[int] = field(default_factory=list)
    state_slot: int = -1
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    matched_stop: int | None = None
    reported: int = 0            # output tokens already sent to the scheduler
    slots: torch.Tensor | None = None   # every token slot of `pages` (the runner's cache)
    # hybrid models: the working state slot is state_slot; these come with the grant
    restore_slot: int = -1       # checkpoint to start from (its state is the one after cached_len tokens)
    state_ready: bool = False    # the working slot has been restored or zeroed
    checkpoints: dict[int, int] = field(default_factory=dict)   # position -> slot to copy the state into
    tail_slot: int = -1          # decode keeps the state of the latest page boundary here ...
    tail_pos: int = 0            # ... which is this position (0: none yet)
    checkpoint_at: list[int] = field(default_factory=list)   # extra checkpoints asked for (fork points)
    matcher: Any = None          # structured output: a grammar Matcher (grammar/backends) over the output
    draft: list[int] = field(default_factory=list)   # jump-forward: forced tokens after the pending one (jump.py)
    certain: int = 0     # ... of which the first `certain` are the only token the grammar allows there
    priority: int = 0            # admission order (speculative program branches: lower)
    arrived: float = 0.0         # monotonic time of Engine.add, until it gets pages (queue_seconds)
    quota_pages: int = 0         # > 0: its namespace's owner may keep at most this many cached pages (radix)
    pin: str = ""                # programs: keep the cached prefix locked under this key at release
    pin_ttl_s: float = 0.0
    discard: bool = False        # cancelled branch: cache nothing more at release
    after: str = ""              # programs: not admitted while this request is live here (its parent)
    known: bool = False          # waiting: the pool deferred it last step and kept its prompt (Candidate.known)
    quiet: bool = False          # report the first output and the last only (ExecRequest.quiet)
    logprob_start: int = -1      # >= 0: collect logprobs of prompt tokens from here on ...
    input_logprobs: list[float] = field(default_factory=list)   # ... in order
    input_top_logprobs: list[TopLogprobs] = field(default_factory=list)   # ... and their top alternatives
    # output logprobs (raw: before penalties and temperature; sampling.logprobs or top_logprobs > 0),
    # entry i for output_ids[i]: the runner appends one in the step that samples the token the
    # engine then appends
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    penalties: Any = None        # sampler.Penalties: output token counts, kept on the device
    # preemption (the pool ran out mid-generation): the sequence went back to waiting with every
    # token it had; on its next admission it computes them all (most from the cache) as if they
    # were its prompt, then goes on generating
    resume_len: int = 0          # > 0: tokens it had when preempted
    growing: bool = False        # more pages asked of radix, not yet answered
    # KV tiers (tiers.py): this admission's tokens loaded from the host or disk tier (after cached_len),
    # and the keys of its pages so far (the namespace's root first)
    loaded_len: int = 0
    tier_keys: PageKeys | None = None     # KV tiers: its pages' keys (over `tokens`, which only grows in place)
    unfilled: list[int] = field(default_factory=list)   # planned checkpoints a tier load went past (Progress)
    transfer_to: str = ""        # disaggregation: a prefill-only request whose pages go to this executor ...
    transfer_from: int = 0       # ... from this token on (what it has cached already)

    def __post_init__(self) -> None:
        self.prompt_len = self.prompt_len or len(self.tokens)
        self.stop_ids = frozenset(self.sampling.stop_token_ids) | (frozenset() if self.sampling.ignore_eos else self.eos_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def prefill_len(self) -> int:
        """Tokens computed before this admission's first sample: the prompt, or all it had when preempted."""
        return self.resume_len or self.prompt_len

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def prefill_only(self) -> bool:
        """max_new_tokens == 0: compute the prompt's KV (a program's fork point, prompt logprobs), sample nothing."""
        return self.sampling.max_new_tokens == 0

    @property
    def max_len(self) -> int:
        """Tokens this sequence can reach: prompt plus every token it may generate."""
        return self.prompt_len + self.sampling.max_new_tokens

    def check(self, max_model_len: int) -> None:
        assert 0 <= self.cached_len <= self.computed_len <= len(self.tokens) <= max_model_len, (
            self.rid, self.cached_len, self.computed_len, len(self.tokens), max_model_len)

    def finish(self, reason: str, matched: int | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.matched_stop = matched
