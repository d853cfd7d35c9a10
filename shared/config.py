"""Typed, frozen configuration, layered by who uses it.

Every field can be overridden from the environment as RADIXFLOW_<SECTION>_<FIELD> (for example
RADIXFLOW_EXECUTOR_PAGE_SIZE=32); explicit overrides passed to `load` win over the environment.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_type_hints

T = TypeVar("T")


@dataclass(frozen=True)
class BusConfig:
    SECTION = "BUS"
    nats_url: str = "nats://127.0.0.1:4222"   # or a comma-separated list: a NATS cluster's nodes, own first
    # nats-py's 0.5 s default request timeout is wrong for LLM work; every request names its own.
    request_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    reconnect_wait_s: float = 0.5
    # credentials, from files named here or in RADIXFLOW_BUS_* (never on a command line): a directory of
    # per-service nkeys (`radixflow creds DIR`; each service takes DIR/<service>.nk), one seed file, or
    # a .creds file (NATS JWT auth); TLS to the server with a CA (and a client certificate)
    nkey_dir: str = ""
    nkey_seed_file: str = ""
    creds_file: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_handshake_first: bool = False


@dataclass(frozen=True)
class ExecutorConfig:
    SECTION = "EXECUTOR"
    model: str = ""
    served_model_name: str = ""       # empty: the model directory's name
    instance: str = ""                # empty: derived from host and pid
    device: str = "auto"              # auto | cpu | cuda | cuda:N
    dtype: str = "auto"               # auto | float32 | bfloat16 (auto: bf16 on a GPU, fp32 on a CPU)
    kernels: str = "auto"             # auto | torch | cpu | triton (auto: the Triton kernels on a GPU, the CPU ones on a CPU)
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192    # token budget of one prefill step
    mixed_chunk_tokens: int = 2048    # a prefill step that carries decode rows: tokens in all (0: never mixed)
    page_size: int = 16
    max_total_tokens: int = 0         # KV pool size in tokens; 0 = from mem_fraction, or sized from max_model_len
    mem_fraction: float = 0.0         # > 0: the pools take this share of free device memory, less the weights
    max_model_len: int = 0            # 0 = the model's max_position_embeddings
    num_threads: int = 0              # torch intra-op threads; 0 = leave torch's default
    orphan_timeout_s: float = 3.5     # a request's scheduler silent this long: abort the request
    radix_wait_s: float = 15.0        # radix unreachable (restarting): waiting requests wait this long, then fail
    kernel_build_wait_s: float = 90.0   # CPU kernels: the first start in an environment waits for their build
    decode_reserve: int = 256         # output tokens reserved at admission (0: all of max_new_tokens); past
                                      # them requests grow page by page, preempted if the pool runs out
    state_slots: int = 0              # hybrid: DeltaNet state slots (0: 2 per running request + 64)
    checkpoint_interval: int = 0      # hybrid: checkpoint long prefills every this many tokens (0: at chunk boundaries)
    burst_gap_s: float = 0.002        # admission waits while requests keep arriving this close together
    burst_wait_s: float = 0.05        # ... but never longer than this (0 and 0: admit at once)
    burst_enough_tokens: int = 2048   # ... and not once this many prompt tokens have arrived (0: always)
    jump_forward: int = 0             # structured output: draft tokens verified per step (0: off; docs/structured.md)
    jump_forward_policy: str = "auto"  # ... of every forced token ("all"), only "certain" ones (the only token
                                       # allowed), or "auto": the others too while they pay (engine.py)
    forced_spelling: str = "tokenizer"  # ... text the grammar forces: any spelling ("model") or the tokenizer's
                                      # ("tokenizer": masks keep its next token alone; spelling.py)
    overlap: bool = True              # radix exchanges travel while a step computes (engine.EngineConfig.overlap)
    disable_radix_cache: bool = False
    kv_host_pages: int = 0            # KV tiers: evicted pages kept in this many host-memory pages (0: none)
    kv_disk_dir: str = ""             # ... and below them in files under this directory (empty: no disk tier)
    kv_disk_pages: int = 0            # ... at most this many
    role: str = "both"                # disaggregation: prefill (long prompts' prefills only) | decode | both
    sampling_defaults: str = "model"  # model: generation_config.json's temperature, top_p, ... for fields a request
                                      # leaves unset (vLLM's and SGLang's default); openai: the API's own defaults


@dataclass(frozen=True)
class SchedulerConfig:
    SECTION = "SCHEDULER"
    instance: str = ""
    executor_timeout_s: float = 3.5   # no heartbeat for this long (3 missed beats): the executor is dead
    max_queued_requests: int = 4096   # accepted but unfinished; beyond it a request gets 429
    max_queued_tokens: int = 8_000_000   # ... and their prompt plus max_new_tokens
    tenant_share: float = 0.5         # one tenant's default share of both, over every scheduler instance
                                      # (their heartbeats carry their tenants' counts): no tenant fills the
                                      # queue for the others; a key file's limits come on top
    request_timeout_s: float = 900.0  # an accepted request ends by then, whatever happens
    max_program_nodes: int = 1024     # programs: more nodes is a 400
    max_program_tokens: int = 2_000_000   # programs: own text plus generation budget of every node
    local_detokenize: bool = True     # decode outputs in process when the model's tokenizer is readable here
    routing: str = "cache_aware"      # cache_aware | round_robin | cache_first (scheduler/routing.py)
    route_load_tokens: int = 128      # cache_aware: a request in flight weighs like this many tokens to prefill
                                      # (more sends a hot preamble's requests to more executors, each computing it)
    stall_check_s: float = 5.0        # a request silent this long: ask its executor whether it still runs it
                                      # (an output lost to a NATS reconnect ends it with a clear error)
    max_resamples: int = 3            # structured output: a finished output that fails its check is
                                      # sampled again (new seed) up to this many times, then a clear error
    check_budget_s: float = 1.0       # ... and one check (a schema's patterns included) gets this long: past
                                      # it the request fails with a 400 (shared/patterns.py)
    disagg_min_tokens: int = 1024     # disaggregation: a prompt with at least this many tokens to compute goes
                                      # through a prefill executor first, when there is one (0: never; disagg.py)
    disagg_max_queue: int = 4         # ... whose queue is shorter than this; else it prefills where it decodes


@dataclass(frozen=True)
class GatewayConfig:
    SECTION = "GATEWAY"
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()    # "key" or "key:tenant"; with auth_file empty too: auth off, tenant "default"
    auth_file: str = ""               # keys, tenants, groups, roles, limits (JSON or TOML; gateway/auth.py)
    scheduler_timeout_s: float = 3.5  # no scheduler heartbeat for this long: 503 for in-flight streams
    health_timeout_s: float = 2.0
    stall_check_s: float = 5.0        # a stream silent this long: ask its scheduler whether it still runs it
    # streams' items from one scheduler pass arrive in one message (StreamBatch) rather than one each
    coalesce_streams: bool = True
    reuse_port: bool = False          # several gateway processes on one port (SO_REUSEPORT; `up --processes`)
    insecure: bool = False            # serve without keys on a non-loopback address (refused otherwise)
    metrics_token: str = ""           # GET /metrics with this bearer token sees every tenant's series (from the
                                      # environment, RADIXFLOW_GATEWAY_METRICS_TOKEN, or the file below)
    metrics_token_file: str = ""


@dataclass(frozen=True)
class ServiceConfig:
    SECTION = "SERVICE"
    concurrency: int = 64             # in-flight handlers per actor
    alive_file: str = ""              # touched at every heartbeat sent: `radixflow alive FILE` is a health check
    # Every wakeup of the event loop steals a core from the model's threads, so beats are slow and
    # timeouts 3.5 beats.
    heartbeat_s: float = 1.0
    drain_timeout_s: float = 30.0
    max_mailbox: int = 10_000         # requests waiting for a handler; past it they get a 429 at once


def _parse(raw: str, typ: Any) -> Any:
    if typ is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    if typ is int:
        return int(raw)
    if typ is float:
        return float(raw)
    if typ == tuple[str, ...]:
        return tuple(p.strip() for p in raw.split(",") if p.strip())
    return raw


def load(cls: type[T], env: dict[str, str] | None = None, **overrides: Any) -> T:
    """Build `cls` from its defaults, then RADIXFLOW_<SECTION>_<FIELD> variables, then overrides."""
    env = os.environ if env is None else env
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = f"RADIXFLOW_{cls.SECTION}_{f.name.upper()}"
        if key in env:
            try:
                values[f.name] = _parse(env[key], hints[f.name])
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    return cls(**values)


__all__ = ["BusConfig", "ExecutorConfig", "SchedulerConfig", "GatewayConfig", "ServiceConfig", "load", "field"]
