"""`radixflow bench program`: the agent task as one program against the same calls sent as
independent concurrent requests, on tiny-dense and tiny-hybrid, in one run; and a tree of thought
(depth 3, branching 3, a select at each level) as one program against the same function run step
by step (each call a separate request, as a client without programs would send them).

Per side: prefill tokens computed (prompt - cached over every request), hybrid state restores,
wall time (best of the repeats, sides alternating, each from an empty cache), JSON validity; greedy
outputs of the two agent sides must be identical (same tokens).
"""
from __future__ import annotations

import asyncio
import json
import time

from .common import Timer, generate, served
from .shared_prefix import workload

SCHEMA = {"type": "object", "properties": {"tool": {"type": "string", "enum": ["search", "calc", "none"]},
                                           "arg": {"type": "string", "maxLength": 24}},
          "required": ["tool", "arg"], "additionalProperties": False}


def _valid(text: str) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _restores(stack) -> int:
    return sum(p.counters["state_restores_total"] for p in stack.actors["radix"].pools.values())


async def _flush(stack, http, base) -> None:
    """Empty the cache once every request has been released (held pages would survive a flush)."""
    pools = stack.actors["radix"].pools.values()
    for _ in range(200):
        if all(p.stats()["requests_held"] == 0 and not p.pins for p in pools):
            break
        await asyncio.sleep(0.01)
    async with http.post(base + "/flush_cache") as r:
        await r.read()


async def _agent(model: str, pre: list[int], sufs: list[list[int]], max_tokens: int, repeats: int) -> dict:
    """Both sides `repeats` times, alternating, from an empty cache each time; wall times are the
    best of the repeats, token counts those of the first."""
    gen = {"max_tokens": max_tokens, "temperature": 0, "json_schema": SCHEMA}
    nodes = [{"id": "pre", "input_ids": pre}] + [{"id": f"q{i}", "parent": "pre", "input_ids": s, "gen": gen}
                                                 for i, s in enumerate(sufs)]
    async with served(model) as (stack, http, base):
        await generate(http, base, {"input_ids": list(range(5, 69)), "sampling_params": {"max_new_tokens": 2}})
        page = stack.cfg.executor.page_size

        async def independent() -> tuple[dict, list]:
            """Every call carries the whole prompt, all sent at once."""
            r0 = _restores(stack)
            with Timer() as t:
                outs = await asyncio.gather(*(generate(http, base, {"input_ids": pre + s, "sampling_params": {
                    "max_new_tokens": max_tokens, "temperature": 0, "json_schema": json.dumps(SCHEMA)}}) for s in sufs))
            return {"wall_s": round(t.s, 3), "state_restores": _restores(stack) - r0,
                    "prefill_tokens_computed": sum(o["meta_info"]["prompt_tokens"] - o["meta_info"]["cached_tokens"]
                                                   for o in outs),
                    "json_valid": sum(_valid(o["text"]) for o in outs)}, [o["output_ids"] for o in outs]

        async def program() -> tuple[dict, list]:
            """The same calls as one program: the preamble is a prefill-only parent."""
            r0 = _restores(stack)
            with Timer() as t:
                async with http.post(base + "/v1/programs", data=json.dumps({"nodes": nodes})) as r:
                    res = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"/v1/programs {r.status}: {res}")
            got = [res["nodes"][f"q{i}"] for i in range(len(sufs))]
            return {"wall_s": round(t.s, 3), "state_restores": _restores(stack) - r0,
                    "prefill_tokens_computed": sum(v["meta_info"]["prompt_tokens"] - v["meta_info"]["cached_tokens"]
                                                   for v in res["nodes"].values()),
                    "json_valid": sum(_valid(v["output"]) for v in got),
                    "children_cached_tokens": sorted({v["meta_info"]["cached_tokens"] for v in got})}, \
                [v["output_ids"] for v in got]

        sides: dict[str, list] = {"independent": [], "program": []}
        for rep in range(repeats):
            for name in (["independent", "program"] if rep % 2 == 0 else ["program", "independent"]):
                await _flush(stack, http, base)
                sides[name].append(await (independent() if name == "independent" else program()))
    indep, prog = sides["independent"][0][0], sides["program"][0][0]
    for name, side in (("independent", indep), ("program", prog)):
        walls = [r[0]["wall_s"] for r in sides[name]]
        side["wall_s"], side["wall_s_each"] = min(walls), walls
    # an output may end on the end-of-turn token, which a program's result leaves out
    same = sum(a[:len(b)] == b for a, b in zip(sides["independent"][0][1], sides["program"][0][1]))
    bound = len(pre) + sum(len(s) for s in sufs) + (len(sufs) + 1) * page
    return {"independent": indep, "program": prog, "bound_prefill_tokens": bound,
            "program_within_bound": prog["prefill_tokens_computed"] <= bound,
            "prefill_token_ratio": round(indep["prefill_tokens_computed"] / max(prog["prefill_tokens_computed"], 1), 3),
            "wall_ratio_independent_over_program": round(indep["wall_s"] / max(prog["wall_s"], 1e-9), 3),
            "greedy_outputs_identical": f"{same}/{len(sufs)}"}


def _tree_function():
    from radixflow.lang import function, gen, select

    @function
    def tree_of_thought(s, question, depth=3, width=3):
        s += question
        for level in range(depth):
            branches = s.fork(width)
            for i, b in enumerate(branches):
                b += f"\nThought {level}.{i}:" + gen("thought", max_tokens=16, temperature=0.8, seed=7 * level + i)
            branches.join()
            s += f"\nBest thought at level {level}:" + select(f"best{level}", choices=s["thought"])
    return tree_of_thought


def _tree(model: str, question: str, repeats: int) -> dict:
    """Both sides `repeats` times, alternating, each from an empty cache: best wall time, and the
    prefill tokens of the first repeat."""
    from radixflow.lang import Runtime
    fn = _tree_function()
    nodes, _, _ = fn.trace(question=question)

    async def main():
        async with served(model) as (stack, http, base):
            await generate(http, base, {"input_ids": list(range(5, 69)), "sampling_params": {"max_new_tokens": 2}})
            backend = Runtime(base)
            loop = asyncio.get_running_loop()
            # first calls of each path (select's prompt logprobs, sampling) are slow: warm both up
            await loop.run_in_executor(None, lambda: fn.run(question="Warm up. " * 20, depth=1, backend=backend))
            await loop.run_in_executor(None, lambda: fn.run_eager(question="Warm up. " * 20, depth=1, backend=backend))
            computed = lambda: stack.actors["executor"].engine.counters["prefill_tokens_computed_total"]
            runs = {"program": fn.run, "step_by_step": fn.run_eager}
            out: dict[str, list] = {"program": [], "step_by_step": []}
            for rep in range(repeats):
                for name in (["program", "step_by_step"] if rep % 2 == 0 else ["step_by_step", "program"]):
                    await _flush(stack, http, base)
                    c0, t0 = computed(), time.perf_counter()
                    res = await loop.run_in_executor(None, lambda: runs[name](question=question, backend=backend))
                    out[name].append((res, time.perf_counter() - t0, computed() - c0))
            return out, stack.cfg.executor.page_size
    out, page = asyncio.run(main())
    n = out["program"][0][0].nodes
    # each level's shared prefix (the question and every chosen thought so far) is computed once:
    # a thought recomputes only its own line and the prefix's last partial page
    levels = []
    for level in range(3):
        kids = [n[x["id"]]["meta_info"] for x in nodes if x["text"].startswith(f"\nThought {level}.")]
        levels.append({"shared_prefix_cached": [m["cached_tokens"] for m in kids],
                       "computed_per_thought": [m["prompt_tokens"] - m["cached_tokens"] for m in kids]})
    side = lambda name: {"wall_s": round(min(w for _, w, _ in out[name]), 3),
                         "wall_s_each": [round(w, 3) for _, w, _ in out[name]],
                         "prefill_tokens_computed": out[name][0][2]}
    prog, eager = side("program"), side("step_by_step")
    return {"nodes": len(nodes), "program": prog, "step_by_step": eager,
            "prefill_token_ratio": round(eager["prefill_tokens_computed"] / max(prog["prefill_tokens_computed"], 1), 3),
            "wall_ratio_step_by_step_over_program": round(eager["wall_s"] / max(prog["wall_s"], 1e-9), 3),
            "levels": levels, "page_size": page}


def run_program(models: list[str], preamble: int, suffix: int, n: int, max_tokens: int, repeats: int = 3) -> dict:
    out = {"workload": {"preamble": preamble, "suffix": suffix, "children": n, "max_tokens": max_tokens,
                        "schema": SCHEMA, "repeats": repeats}}
    question = "Question: how should a serving runtime share a long prompt between forty agent calls? " * 8
    for model in models:
        vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
        pre, sufs = workload(preamble, suffix, n, vocab)
        name = model.rstrip("/").rsplit("/", 1)[-1]
        out[name] = {"agent": asyncio.run(_agent(model, pre, sufs, max_tokens, repeats)), "tree_of_thought": _tree(model, question, repeats)}
    return out
