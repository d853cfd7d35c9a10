"""How many tokens does a tiny RANDOM-weight model need to finish each corpus schema under the
grammar? Not a test: a report for deciding how the end-to-end test bounds its outputs.

    .venv/bin/python tests/structured/measure_corpus.py [--model DIR] [--max-tokens 400]
                     [--temps 0,0.7] [--seeds 0,1] [--only name,name] [--json out.json]

Generation: transformers AutoModelForCausalLM (greedy at temperature 0, seeded sampling otherwise),
with the same grammar the service compiles (backends.xgrammar.json_schema_grammar, keys.JSON_OPTIONS) masking
the logits each step; a run "completes" when the grammar accepts a stop token. Each finished output
is validated with jsonschema (Draft 2020-12, format checker), as the scheduler does.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch
import xgrammar as xgr
from jsonschema import Draft202012Validator

from radixflow.services.grammar.lint import needs_validation
from radixflow.services.grammar.tokenizer_info import make_tokenizer_info
from radixflow.services.grammar.backends.xgrammar import json_schema_grammar
from radixflow.services.tokenizer.tokenizer import Tokenizer

if __package__:
    from .corpus import ACCEPTED
else:   # run as a file: tests/structured/measure_corpus.py
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.structured.corpus import ACCEPTED


_FIXED_FORMATS = {"date", "time", "date-time", "uuid", "ipv4", "ipv6"}


def _string_bounded(node: dict) -> bool:
    # mirrors xgrammar: enum/const win; a format, else a pattern, is enforced and minLength/maxLength
    # next to either are ignored; custom formats are skipped
    if {"enum", "const"} & node.keys():
        return True
    if node.get("format") in _FIXED_FORMATS:
        return True
    if node.get("format") in ("email", "hostname", "uri", "uri-reference", "uri-template", "duration",
                              "json-pointer", "relative-json-pointer"):
        return False
    if "pattern" in node:
        bare = re.sub(r"\[(?:\\.|[^\]])*\]", "C", re.sub(r"\\.", "e", node["pattern"]))  # drop escapes, classes
        return not re.search(r"[*+]|\{\d+,\}", bare)
    return "maxLength" in node


def unbounded(schema: Any) -> list[str]:
    """Constructs that put no bound on the output's length (why a random model may ramble)."""
    out: list[str] = []
    stack = [(schema, "$")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        t = node.get("type")
        types = {t} if isinstance(t, str) else set(t or [])
        if node.get("$ref") == "#":
            out.append(f"recursion {path}")
        if "string" in types and not _string_bounded(node):
            out.append(f"string {path}")
        if types & {"number", "integer"} and not ({"maximum", "exclusiveMaximum"} & node.keys()):
            out.append(f"number {path}")
        closed = node.get("items") is False or node.get("unevaluatedItems") is False
        if "array" in types and "maxItems" not in node and not closed:
            out.append(f"array {path}")
        if "object" in types and node.get("additionalProperties") not in (None, False):
            if "maxProperties" not in node:
                out.append(f"open object {path}")
            names = node.get("propertyNames") or {}
            if not (isinstance(names, dict) and _string_bounded(names)):
                out.append(f"additional property name {path}")
        for k in ("$defs", "definitions"):
            for name, sub in (node.get(k) or {}).items():
                if f'"#/{k}/{name}"' in json.dumps(sub):
                    out.append(f"recursion {path}.{k}.{name}")
        for k in ("properties", "$defs", "definitions"):
            for name, sub in (node.get(k) or {}).items():
                stack.append((sub, f"{path}.{name}"))
        for k in ("items", "additionalProperties"):
            if isinstance(node.get(k), dict):
                stack.append((node[k], f"{path}.{k}"))
        for k in ("anyOf", "oneOf", "allOf", "prefixItems"):
            for i, sub in enumerate(node.get(k) or []):
                stack.append((sub, f"{path}.{k}[{i}]"))
    return sorted(set(out))


class Runner:
    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM
        self.tok = Tokenizer(model_dir)
        self.info = make_tokenizer_info(model_dir)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.stops = set(self.info.stop_token_ids)

    def compile(self, schema: dict) -> xgr.CompiledGrammar:
        return self.compiler.compile_grammar(json_schema_grammar(json.dumps(schema)))

    @torch.no_grad()
    def generate(self, grammar: xgr.CompiledGrammar, prompt: list[int], temperature: float, seed: int,
                 max_tokens: int) -> tuple[list[int], bool]:
        matcher = xgr.GrammarMatcher(grammar)
        bitmask = xgr.allocate_token_bitmask(1, self.info.vocab_size)
        gen = torch.Generator().manual_seed(seed)
        out = self.model(torch.tensor([prompt]), use_cache=True)
        ids: list[int] = []
        for _ in range(max_tokens + 1):
            logits = out.logits[:, -1, :].float()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            if temperature == 0:
                t = int(logits.argmax(-1))
            else:
                t = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
            assert matcher.accept_token(t), t
            if t in self.stops:
                return ids, True
            ids.append(t)
            if len(ids) > max_tokens:
                break
            out = self.model(torch.tensor([[t]]), cache=out.cache, use_cache=True)
        return ids, False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model dir (default: a fresh tiny-hybrid from make_model)")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--seeds", default="0,1", help="seeds for temperature > 0 (greedy runs once)")
    ap.add_argument("--only", default="", help="comma-separated schema names")
    ap.add_argument("--json", help="write per-run results here")
    a = ap.parse_args()
    model_dir = a.model
    if not model_dir:
        from radixflow.services.modelgen.make import make_model
        model_dir = str(make_model("tiny-hybrid", tempfile.mkdtemp() + "/tiny-hybrid"))
    runner = Runner(model_dir)
    temps = [float(x) for x in a.temps.split(",")]
    seeds = [int(x) for x in a.seeds.split(",")]
    only = set(filter(None, a.only.split(",")))
    rows, results = [], []
    t_start = time.time()
    for name, schema in ACCEPTED:
        if only and name not in only:
            continue
        grammar = runner.compile(schema)
        validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
        prompt = runner.tok.encode_chat([{"role": "user", "content": f"Answer as JSON ({name})."}])
        runs = []
        for temp in temps:
            for seed in (seeds if temp > 0 else [0]):
                ids, done = runner.generate(grammar, prompt, temp, seed, a.max_tokens)
                text = runner.tok.decode(ids)
                valid = None
                if done:
                    try:
                        valid = validator.is_valid(json.loads(text))
                    except ValueError:
                        valid = False
                runs.append({"temp": temp, "seed": seed, "tokens": len(ids), "done": done, "valid": valid,
                             "text": text[:200]})
        results.append({"name": name, "needs_validation": needs_validation(schema), "runs": runs,
                        "unbounded": unbounded(schema)})
        cells = " ".join(f"{r['tokens']:>4}{'' if r['done'] else '+'}{'!' if r['valid'] is False else ''}" for r in runs)
        print(f"{name:28s} {cells}   {'validated ' if needs_validation(schema) else ''}{', '.join(unbounded(schema))}",
              flush=True)
        rows.extend(runs)
    done = [r["tokens"] for r in rows if r["done"]]
    print(f"\n{len(rows)} runs in {time.time() - t_start:.0f}s; completed {len(done)}; "
          f"tokens min/median/p90/max = {min(done)}/{statistics.median(done):.0f}/"
          f"{sorted(done)[int(0.9 * (len(done) - 1))]}/{max(done)}" if done else "no run completed")
    for temp in temps:
        sel = [r["tokens"] for r in rows if r["done"] and r["temp"] == temp]
        if sel:
            print(f"  temperature {temp}: completed {len(sel)}/{sum(r['temp'] == temp for r in rows)}, "
                  f"median {statistics.median(sel):.0f}, max {max(sel)}")
    stuck = [(x["name"], x["unbounded"]) for x in results if not all(r["done"] for r in x["runs"])]
    print(f"\nnot completed within {a.max_tokens} tokens (in at least one run): {len(stuck)}")
    for name, why in stuck:
        print(f"  {name}: {', '.join(why) or '(no unbounded construct found)'}")
    bad = [x["name"] for x in results if any(r["valid"] is False for r in x["runs"])]
    print(f"finished but failed validation: {bad or 'none'}")
    print("legend: N = tokens to finish, N+ = still going at max_tokens, ! = finished but invalid")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
