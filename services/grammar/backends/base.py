"""The contract every grammar engine (xgrammar, llguidance) keeps, so the compiler, its workers and
the executor handle them alike.

    grammar worker     Backend.compile(kind, text) -> Compiled(raw, enforcement, notes)
                         the raw bytes are what the cache stores (zlib'd) and executors fetch
    executor           Backend.load(raw) -> Grammar          once per key, shared by its requests
                       Grammar.matcher() -> Matcher          one per request
                       Backend.fill(matchers, bitmask, rows)  the rows of one step's bitmask
                       Matcher.accept_token(t), Matcher.is_terminated()
                       Matcher.forced_text(), legal_prefix(ts), rollback(n)   jump-forward drafts

The bitmask is the one both engines write: int32 [rows, ceil(V / 32)], bit t % 32 of word t // 32
set when token t is allowed, V the model's (possibly padded) vocabulary. So the executor fills the
rows of each engine and applies one mask to the whole batch.

A Backend is made once per process for one model (its tokenizer state costs up to seconds for a
150k vocabulary); what only one side uses (the compiler, the batch-fill thread pool) is made on
first use, so compile workers and executors pay only for their own side.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:   # the compiler's process needs OverBudget, not torch
    import torch

FULL, CHECKED = "full", "checked"


class Compiled(NamedTuple):
    raw: bytes           # the engine's serialized grammar
    enforcement: str     # FULL: the grammar enforces the whole constraint; CHECKED: parts are only
                         # validated on the finished output (the engine ignores or approximates them)
    notes: list[str]     # what the engine reported it approximates or ignores (for logs)


class OverBudget(Exception):
    """A budgeted compile (the `auto` choice) refused early: this engine would take too long."""


class Matcher(ABC):
    """One request's position in its grammar."""
    backend: "Backend"

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by `token`; False (and the matcher is dead) when the grammar does not allow it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted where the grammar may end."""

    @abstractmethod
    def forced_text(self) -> str:
        """The text the grammar forces next from here, whole characters only ("" when none);
        jump-forward decoding drafts its tokens (executor/jump.py)."""

    @abstractmethod
    def legal_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar accepts from here; the state is unchanged."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (a verified draft's rejected tail)."""


class Grammar(ABC):
    """A compiled grammar loaded in an executor; cheap to start matchers from."""

    @abstractmethod
    def matcher(self) -> Matcher: ...


class Backend(ABC):
    name: str

    @abstractmethod
    def compile(self, kind: str, text: str, budgeted: bool = False) -> Compiled:
        """Compile one canonical constraint (keys.canonicalize). Raises ValueError (or the engine's
        own error) for input the engine cannot compile; with `budgeted`, OverBudget where it can tell
        early that the compile would not fit the auto budget."""

    @abstractmethod
    def load(self, raw: bytes) -> Grammar:
        """What Compiled.raw becomes in an executor."""

    @abstractmethod
    def fill(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Write the allowed tokens of matchers[i] into bitmask[rows[i]] (a CPU int32 tensor)."""
