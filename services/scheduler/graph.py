"""ProgramGraph: a program's DAG, validated, and the state of every node. No NATS, no torch.

Two kinds of edge, both dependencies (the graph must be acyclic):

    parent:  the node's prompt is the parent's full text (its prompt and its output), then its own text
    after:   the node waits for these nodes; its text (and select choices) may name their outputs as {id}

    pending --(every dependency done)--> running --> done
       \\                                    \\--> failed | cancelled
        \\-- a dependency failed or was cancelled --> failed | cancelled (with the cause)

Token ids are the currency: a child's prompt is its parent's prompt ids + output ids + its own ids,
so the cached prefix it reuses is exactly the parent's tokens (no re-tokenization at the seam).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from radixflow.shared.errors import BadRequest
from radixflow.shared.messages import Constraint, NodeGen, NodeResult, ProgramNode, SamplingParams
from radixflow.shared.validate import check_sampling, one_constraint

ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
REF = re.compile(r"\{([A-Za-z0-9_.:-]{1,64})\}")
TERMINAL = ("done", "failed", "cancelled")


@dataclass(frozen=True)
class Limits:
    max_nodes: int = 1024
    max_tokens: int = 2_000_000       # own text of every node, plus every token it may generate
    max_choices: int = 64


@dataclass(eq=False)
class Node:
    spec: ProgramNode
    children: list["Node"] = field(default_factory=list)     # nodes whose parent this is
    dependents: list["Node"] = field(default_factory=list)   # children and nodes that wait on this one
    state: str = "pending"
    own_ids: list[int] | None = None       # the node's own text, tokenized (joins: once their inputs are done)
    text: str = ""                         # own text with {id} references substituted
    prompt_ids: list[int] = field(default_factory=list)
    output: str = ""
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    scores: list[float] = field(default_factory=list)
    discarded: bool = False
    error: str | None = None
    error_code: int = 0
    executor: str = ""
    admitted: bool = False                 # its request reached the executor's batch (an output arrived)
    pinned: bool = False                   # its cached prefix is pinned until its children are admitted

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def kind(self) -> str:
        return "select" if self.spec.select is not None else "gen" if self.spec.gen is not None else "prefill"

    @property
    def deps(self) -> list[str]:
        return ([self.spec.parent] if self.spec.parent else []) + [a for a in self.spec.after if a != self.spec.parent]

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def full_ids(self) -> list[int]:
        """What a child continues from: this node's prompt and output."""
        return self.prompt_ids + self.output_ids

    @property
    def needs_late_text(self) -> bool:
        """Its text names other nodes' outputs: tokenized when they are done."""
        return bool(self.spec.after) and self.spec.input_ids is None and bool(REF.search(self.spec.text))


def _bad(node: str, message: str) -> BadRequest:
    return BadRequest(f"node {node!r}: {message}", param="nodes")


def sampling_of(g: NodeGen) -> SamplingParams:
    return SamplingParams(max_new_tokens=g.max_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                          min_p=g.min_p, seed=g.seed, stop=[g.stop] if isinstance(g.stop, str) else list(g.stop),
                          stop_token_ids=list(g.stop_token_ids), ignore_eos=g.ignore_eos)


def constraint_of(g: NodeGen) -> Constraint | None:
    schema = g.json_schema if g.json_schema is None or isinstance(g.json_schema, str) else json.dumps(g.json_schema)
    return one_constraint(schema, g.regex, g.ebnf, g.choices, param="nodes")


class ProgramGraph:
    def __init__(self, nodes: list[ProgramNode], limits: Limits = Limits()):
        self.limits = limits
        self.nodes: dict[str, Node] = {}
        self._validate(nodes)
        self.order = self._topological()

    # ------------------------------------------------------------ validation (every failure is a 400 naming the node)

    def _validate(self, specs: list[ProgramNode]) -> None:
        if not specs:
            raise BadRequest("a program needs at least one node", param="nodes")
        if len(specs) > self.limits.max_nodes:
            raise BadRequest(f"a program may have at most {self.limits.max_nodes} nodes, got {len(specs)}",
                             param="nodes")
        for s in specs:
            if not ID.fullmatch(s.id):
                raise _bad(s.id, "ids are 1-64 characters of letters, digits and _ . : -")
            if s.id in self.nodes:
                raise _bad(s.id, "duplicate id")
            self.nodes[s.id] = Node(s)
        for n in self.nodes.values():
            self._check_node(n)
        for n in self.nodes.values():
            for d in n.deps:
                self.nodes[d].dependents.append(n)
            if n.spec.parent:
                self.nodes[n.spec.parent].children.append(n)

    def _check_node(self, n: Node) -> None:
        s = n.spec
        if s.parent is not None and s.parent not in self.nodes:
            raise _bad(s.id, f"parent {s.parent!r} is not a node of this program")
        if s.parent == s.id or s.id in s.after:
            raise _bad(s.id, "a node cannot depend on itself")
        for a in s.after:
            if a not in self.nodes:
                raise _bad(s.id, f"after names {a!r}, which is not a node of this program")
        if len(set(s.after)) != len(s.after):
            raise _bad(s.id, "after lists a node twice")
        if s.gen is not None and s.select is not None:
            raise _bad(s.id, "give gen or select, not both")
        if s.input_ids is not None:
            if s.text:
                raise _bad(s.id, "give text or input_ids, not both")
            if any(t < 0 for t in s.input_ids):
                raise _bad(s.id, "input_ids must be non-negative token ids")
        if s.parent is None and not s.text and not s.input_ids:
            raise _bad(s.id, "a node without a parent needs text or input_ids (the prompt is empty)")
        refs = REF.findall(s.text) + [r for c in (s.select.choices if s.select else []) for r in REF.findall(c)]
        for r in refs:
            if r in self.nodes and r not in s.after:
                raise _bad(s.id, f"its text names {{{r}}}, but {r!r} is not in its after list")
        if s.gen is not None:
            if s.gen.max_tokens < 1:
                raise _bad(s.id, f"gen.max_tokens must be at least 1, got {s.gen.max_tokens}")
            try:
                check_sampling(sampling_of(s.gen))
                constraint_of(s.gen)
            except BadRequest as e:
                raise _bad(s.id, f"gen: {e.message}") from None
        if s.select is not None:
            ch = s.select.choices
            if not ch or len(ch) > self.limits.max_choices:
                raise _bad(s.id, f"select needs 1 to {self.limits.max_choices} choices, got {len(ch)}")
            if not all(ch):
                raise _bad(s.id, "select choices must be non-empty strings")

    def _topological(self) -> list[Node]:
        """Dependencies before dependents; a cycle is a 400 naming a node on it."""
        indeg = {k: len(n.deps) for k, n in self.nodes.items()}
        queue = [n for k, n in self.nodes.items() if indeg[k] == 0]
        order: list[Node] = []
        while queue:
            n = queue.pop(0)
            order.append(n)
            for d in n.dependents:
                indeg[d.id] -= 1
                if indeg[d.id] == 0:
                    queue.append(d)
        if len(order) < len(self.nodes):
            stuck = next(k for k in self.nodes if indeg[k] > 0)
            raise _bad(stuck, "is part of a dependency cycle")
        return order

    def check_tokens(self, max_model_len: int, vocab_size: int) -> None:
        """Once every static text is tokenized: ids inside the vocabulary, every chain's longest
        possible prompt plus output within the context, and the program's total-token limit. Text
        not yet tokenized (joins, choices) is bounded by its UTF-8 bytes (a token is at least one)."""
        full: dict[str, int] = {}            # longest possible prompt + output of each node
        out: dict[str, int] = {}             # longest possible output

        def late(text: str, n: Node) -> int:
            return len(REF.sub("", text).encode()) + sum(out[r] for r in REF.findall(text) if r in n.spec.after)
        total = 0
        for n in self.order:
            if n.own_ids is not None:
                if n.own_ids and max(n.own_ids) >= vocab_size:
                    raise _bad(n.id, f"token ids must be < the vocabulary size {vocab_size}")
                own = len(n.own_ids)
            else:
                own = late(n.spec.text, n)
            gen = n.spec.gen.max_tokens if n.spec.gen else 0
            choices = [late(c, n) for c in n.spec.select.choices] if n.spec.select else [0]
            prompt = (full[n.spec.parent] if n.spec.parent else 0) + own
            o = max(gen, *choices)
            if prompt + o > max_model_len:
                raise _bad(n.id, f"its prompt may reach {prompt} tokens, plus {o} to generate or select: more "
                                 f"than the context length of {max_model_len}")
            full[n.id], out[n.id] = prompt + o, o
            total += own + gen + sum(choices)
        if total > self.limits.max_tokens:
            raise BadRequest(f"the program holds up to {total} tokens; the limit is {self.limits.max_tokens}",
                             param="nodes")

    # ------------------------------------------------------------ progress

    def ready(self) -> list[Node]:
        """Pending nodes whose dependencies are all done, in topological order."""
        return [n for n in self.order if n.state == "pending" and all(self.nodes[d].state == "done" for d in n.deps)]

    def resolve(self, n: Node) -> str:
        """Its text with {id} replaced by the outputs of the nodes in its after list."""
        return REF.sub(lambda m: self.nodes[m[1]].output if m[1] in n.spec.after else m[0], n.spec.text)

    def resolve_choice(self, n: Node, choice: str) -> str:
        return REF.sub(lambda m: self.nodes[m[1]].output if m[1] in n.spec.after else m[0], choice)

    def prefix_ids(self, n: Node) -> list[int]:
        return self.nodes[n.spec.parent].full_ids if n.spec.parent else []

    def end(self, n: Node, state: str, code: int = 0, error: str | None = None) -> list[Node]:
        """End `n` (failed or cancelled) and every dependent not yet ended, transitively, with the
        cause; returns the nodes that changed (n first)."""
        if n.terminal:
            return []
        n.state, n.error, n.error_code = state, error, code
        out = [n]
        for d in n.dependents:
            why = f"dependency {n.id!r} failed: {error}" if state == "failed" else f"dependency {n.id!r} was cancelled"
            out += self.end(d, state, code, why)
        return out

    def cancel(self, node_id: str | None = None) -> list[Node]:
        """Cancel one node and its dependents, or (None) every node not yet ended."""
        if node_id is None:
            return [x for n in self.order for x in self.end(n, "cancelled", 0, "cancelled")]
        return self.end(self.nodes[node_id], "cancelled", 0, "cancelled")

    @property
    def finished(self) -> bool:
        return all(n.terminal for n in self.nodes.values())

    def unpinnable(self) -> list[Node]:
        """Pinned nodes whose children have all been admitted (their own locks now hold the path) or ended."""
        return [n for n in self.nodes.values() if n.pinned and all(c.admitted or c.terminal for c in n.children)]

    def result(self, n: Node) -> NodeResult:
        return NodeResult(id=n.id, state=n.state, parent=n.spec.parent, after=list(n.spec.after), kind=n.kind,
                          speculative=n.spec.speculative, text=n.text, output=n.output, output_ids=n.output_ids,
                          prompt_tokens=n.prompt_tokens, cached_tokens=n.cached_tokens,
                          completion_tokens=n.completion_tokens,
                          finish_reason=n.finish_reason, matched_stop=n.matched_stop, scores=n.scores,
                          discarded=n.discarded, error=n.error, error_code=n.error_code, executor=n.executor)
