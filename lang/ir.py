"""What a program function appends to a state: text, gen(...), select(...), and the placeholders
that stand for values not generated yet.

    s += "Task: " + gen("answer", max_tokens=64)      ->  Concat([Text, Gen])

While a function is traced (to build the whole DAG before anything runs), reading a generated value
gives a `Var`: a str whose content is a marker naming the node. Concatenating, formatting and
joining it works (the marker becomes a {node} reference resolved by the server: a join); anything
that needs the actual value (comparing, len, str methods) raises NeedsValue, and the function is
then run step by step instead.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

MARK = "\x00rf:"
MARKER = re.compile("\x00rf:([A-Za-z0-9_.:-]+)\x00")


class NeedsValue(Exception):
    """The program's control flow depends on a generated value: it cannot be traced ahead."""


class Expr:
    def __add__(self, other: Any) -> "Concat":
        return Concat(parts(self) + parts(other))

    def __radd__(self, other: Any) -> "Concat":
        return Concat(parts(other) + parts(self))


@dataclass
class Concat(Expr):
    items: list[Any]


@dataclass
class Gen(Expr):
    name: str | None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Select(Expr):
    name: str | None
    choices: list[str]


def parts(x: Any) -> list[Any]:
    if isinstance(x, Concat):
        return list(x.items)
    if isinstance(x, (str, Gen, Select)):
        return [x]
    raise TypeError(f"cannot append {type(x).__name__} to a program state (str, gen(), select())")


def gen(name: str | None = None, *, max_tokens: int = 128, temperature: float | None = None,
        top_p: float | None = None, top_k: int | None = None, min_p: float | None = None, seed: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None, ignore_eos: bool | None = None,
        json_schema: dict | str | None = None, regex: str | None = None, ebnf: str | None = None,
        choices: list[str] | None = None) -> Gen:
    """Generate here and store the output as `name` (SGLang's gen)."""
    params = {k: v for k, v in dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                    min_p=min_p, seed=seed, stop=stop, stop_token_ids=stop_token_ids,
                                    ignore_eos=ignore_eos, json_schema=json_schema, regex=regex, ebnf=ebnf,
                                    choices=choices).items() if v is not None}
    return Gen(name, params)


def select(name: str | None = None, choices: list[str] | None = None) -> Select:
    """Append the most likely of `choices` (scored by the model, not sampled) and store it as `name`."""
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    return Select(name, list(choices))


def _needs(name: str):
    def blocked(self, *a, **k):
        raise NeedsValue(f"{name}() of the value of node {self.node!r}, which is generated at run time")
    return blocked


class Var(str):
    """The output of a node, known only at run time (tracing)."""
    node: str

    def __new__(cls, node: str) -> "Var":
        v = super().__new__(cls, f"{MARK}{node}\x00")
        v.node = node
        return v

    def __repr__(self) -> str:
        return f"<value of {self.node}>"


# comparisons, truth, size and every str method need the real value
for _name in ["__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__", "__len__",
              "__iter__", "__getitem__", "__contains__", "__int__", "__float__", "__mul__", "__rmul__", "__mod__"] + \
        [m for m in dir(str) if not m.startswith("_") and m not in ("join", "format")]:
    setattr(Var, _name, _needs(_name))


def references(text: str) -> tuple[str, list[str]]:
    """Markers -> the server's {node} references, and the nodes named (in order, once each)."""
    named: list[str] = []
    for m in MARKER.finditer(text):
        if m[1] not in named:
            named.append(m[1])
    return MARKER.sub(lambda m: "{" + m[1] + "}", text), named
