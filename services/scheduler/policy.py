"""ProgramPolicy: what a program's node sends to an executor, and what happens at a select.
Plain decisions over a ProgramGraph; the service shell (programs.py) does the I/O.

- every ready node is dispatched at once, so the children of a parent share prefill batches;
- a node with children is pinned: its cached prefix stays locked until they are all admitted, and
  (hybrid) its state is checkpointed exactly at the fork point, so each child resumes there;
- a node without gen or select is prefill-only (max_new_tokens 0);
- the children of a prefill-only parent need nothing from it but its prompt: they are sent with
  it, held by the executor until its release has cached the prefix, and admitted in that same
  exchange (no round trip through the scheduler between the parent and its children);
- speculative nodes are admitted after everything else that waits;
- select scores each choice by the mean logprob of its tokens after the node's prompt (SGLang's
  token-length-normalized default), from one prefill-only request per choice, all sent together;
  the losing choices, and the speculative branches they named, are evicted first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from radixflow.shared.messages import SamplingParams

from .graph import REF, Node, ProgramGraph, sampling_of

SPECULATIVE_PRIORITY = -1


@dataclass(frozen=True)
class Job:
    """One request of a node (a select sends one per choice)."""
    suffix: str                        # appended to the node's request id
    input_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    pin: bool = False                  # keep the prefix it caches locked until the node's children are admitted
    checkpoint_at: list[int] = field(default_factory=list)
    logprob_start: int = -1
    choice: int = -1
    after: str = ""                    # the request id of a running parent it waits for at the executor


class ProgramPolicy:
    def jobs(self, graph: ProgramGraph, n: Node, choice_ids: list[list[int]] | None = None) -> list[Job]:
        """The requests for ready node `n`, whose own text is tokenized (and, for a select, its choices)."""
        prompt = graph.prefix_ids(n) + (n.own_ids or [])
        n.prompt_ids = prompt
        prio = SPECULATIVE_PRIORITY if n.spec.speculative else 0
        forks = bool(n.children)
        if n.kind == "gen":
            return [Job("", prompt, sampling_of(n.spec.gen), prio, forks)]
        prefill = SamplingParams(max_new_tokens=0, temperature=0.0)
        if n.kind == "prefill":
            return [Job("", prompt, prefill, prio, forks, [len(prompt)] if forks else [])]
        return [Job(f"#{i}", prompt + ids, prefill, prio, forks, [len(prompt) + len(ids)] if forks else [],
                    logprob_start=len(prompt), choice=i) for i, ids in enumerate(choice_ids or [])]

    @staticmethod
    def early_children(n: Node) -> list[Node]:
        """Children that can go with prefill-only `n`: their prompt is known (no other dependency)."""
        if n.kind != "prefill":
            return []
        return [c for c in n.children if c.state == "pending" and c.deps == [n.id] and c.own_ids is not None]

    @staticmethod
    def choose(logprobs: list[list[float]]) -> tuple[int, list[float]]:
        """The winning choice and every choice's score (mean token logprob); ties go to the first."""
        scores = [sum(lp) / len(lp) if lp else float("-inf") for lp in logprobs]
        return max(range(len(scores)), key=lambda i: (scores[i], -i)), scores

    @staticmethod
    def discarded_branches(graph: ProgramGraph, n: Node, winner: int) -> list[Node]:
        """Speculative nodes named as a whole losing choice ("{id}"), unless the winner names them too."""
        choices = n.spec.select.choices
        named = lambda c: [graph.nodes[r] for r in REF.findall(c) if r in n.spec.after and c == "{" + r + "}"]
        keep = {x.id for x in named(choices[winner])}
        return [x for i, c in enumerate(choices) if i != winner
                for x in named(c) if x.spec.speculative and x.id not in keep]
