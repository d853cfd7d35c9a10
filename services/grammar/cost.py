"""What an xgrammar compile will cost, guessed from the grammar it prints, before paying for it.

`auto` (compiler._auto) prefers xgrammar, but an eager compile can take seconds where llguidance
takes milliseconds; the auto budget (compiler.AUTO_BUDGET_S) catches a slow compile only after
waiting for it, and the job then holds a worker until it ends. So a budgeted compile is refused
before it starts when this model predicts it over AUTO_MAX_PREDICTED_S.

The model: xgrammar builds a token-mask cache for every position of every rule, so its time grows
with the printed grammar (EBNF characters) and, much faster, with each `Regex(...)` rule (a JSON
Schema `pattern`: its automaton's states each walk the vocabulary trie); both grow with the
vocabulary. The coefficients below are fitted on the real-world corpus
(tests/structured/compile_corpus.py), timing the whole job (compile, serialize, compress). The
model is coarse (some patterns expand into many more states than others): the budget stays as the
backstop.
"""
from __future__ import annotations

_REF_VOCAB = 8192
_S_PER_CHAR, _CHAR_EXP = 2.4e-5, 0.14
_S_PER_REGEX, _REGEX_EXP = 0.085, 0.28

# below the compiler's auto budget, so that what the model lets through mostly finishes within it
AUTO_MAX_PREDICTED_S = 0.4


def xgrammar_compile_s(ebnf: str, vocab_size: int) -> float:
    """Predicted seconds for xgrammar to compile the grammar it printed as `ebnf`."""
    scale = max(vocab_size, 1) / _REF_VOCAB
    return (_S_PER_CHAR * scale ** _CHAR_EXP * len(ebnf)
            + _S_PER_REGEX * scale ** _REGEX_EXP * ebnf.count("Regex("))
