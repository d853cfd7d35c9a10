"""`radixflow bench WHICH`: the benchmark named, from the command line's arguments (services/cli/main.py
parses them); each prints its JSON (or writes its own report, `schemas`)."""
from __future__ import annotations

import argparse
import json
import sys


def run(a: argparse.Namespace) -> int:
    from radixflow.kernels import cpu_ext
    cpu_ext.wait()          # the CPU kernels are built before anything is timed (a no-op once they are)
    from radixflow.services.bench.common import resolve_model
    model = resolve_model(a.model or ("tiny-dense" if a.which in ("shared-prefix", "scaling", "routing", "multiturn")
                                      else "tiny-hybrid")) \
        if a.which not in ("program", "sampler", "kernels", "evict") else None
    if a.which == "decode":
        from radixflow.services.bench.decode import run_decode
        out = run_decode(model, [int(b) for b in a.batch.split(",")], a.prompt_len, a.new_tokens, stream=a.stream)
    elif a.which == "latency":
        from radixflow.services.bench.decode import run_latency
        out = run_latency(model, a.prompt_len, a.repeats or 60)
    elif a.which == "structured":
        from radixflow.services.bench.structured import run_structured
        out = run_structured(model, batch=16, rounds=a.rounds)
    elif a.which == "scaling":
        from radixflow.services.bench.scaling import run_scaling
        out = run_scaling(model, a.against, dtype=a.dtype, pause_peer=not a.no_pause_peer)
    elif a.which == "mixed":
        from radixflow.services.bench.mixed import run_mixed
        out = run_mixed(model, rounds=a.rounds)
    elif a.which == "program":
        from radixflow.services.bench.program import run_program
        models = [resolve_model(m) for m in (a.model.split(",") if a.model else ["tiny-dense", "tiny-hybrid"])]
        out = run_program(models, a.preamble, a.suffix, a.requests, a.max_tokens or 64)
    elif a.which == "kernels":
        from radixflow.services.bench.kernels import run_kernels
        out = run_kernels(interpret=a.interpret)
    elif a.which == "routing":
        from radixflow.services.bench.routing import run_routing
        out = run_routing(model, [int(x) for x in a.executors.split(",")], a.preambles, a.calls, a.preamble, a.suffix,
                          a.output_tokens)
    elif a.which == "evict":
        from radixflow.services.bench.evict import run_evict
        out = run_evict(admissions=a.repeats or 300)
    elif a.which == "sampler":
        from radixflow.services.bench.sampler import run_sampler
        out = run_sampler(batch=a.rows, vocab=a.vocab, repeats=a.repeats or 20)
    elif a.which == "schemas":
        from radixflow.services.bench.schemas import SchemasBenchConfig, run_schemas
        if not a.dir:
            print("bench schemas needs a DIR of *.json schemas", file=sys.stderr)
            return 2
        run_schemas(model, a.dir, a.backend, a.json, SchemasBenchConfig(
            max_tokens=a.max_tokens or 2048, samples=a.samples, concurrency=a.concurrency,
            probe_concurrency=a.probe_concurrency, limit=a.limit))
        return 0
    elif a.which == "serve":
        from radixflow.services.bench.serve import ServeConfig, run_serve
        cfg = ServeConfig(mode=a.mode, requests=a.num_prompts, input_len=a.input_len, output_len=a.output_len,
                          preamble=a.preamble, suffix=a.suffix, fanout=a.fanout,
                          levels=tuple(float(x) for x in (a.levels or ("1,4,16" if a.mode == "random" else "0.5,1,2")).split(",")))
        if a.layout == "split":
            from radixflow.services.bench.serve import run_layouts
            out = run_layouts(model, cfg, a.disagg_min_tokens if a.disagg_min_tokens is not None else cfg.preamble // 2)
        else:
            out = run_serve(model, cfg, a.against, a.plot)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=2)
    elif a.which == "multiturn":
        from radixflow.services.bench.multiturn import MultiturnConfig, run_multiturn
        out = run_multiturn(model, MultiturnConfig(sessions=a.sessions, turns=a.turns, preamble=a.preamble,
                                                   user=a.suffix, output=a.output_tokens, pool_tokens=a.pool_tokens,
                                                   host_pages=a.host_pages, concurrency=a.concurrency))
    elif a.which == "shared-prefix":
        from radixflow.services.bench.shared_prefix import run_shared_prefix
        out = run_shared_prefix(model, a.preamble, a.suffix, a.requests, a.output_tokens, a.first_alone, a.against,
                                dtype=a.dtype, repeats=a.repeats or 3, pause_peer=not a.no_pause_peer,
                                engine=a.engine)
    else:
        print(f"unknown benchmark {a.which!r}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2))
    return 0
