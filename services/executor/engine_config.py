"""EngineConfig: what an Engine (engine.py) is built with, each field with why it is there. The
executor service builds one from its section of the deployment's config (shared/config.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "auto"
    # compute and KV dtype: float32 | bfloat16 | auto (runner.pick_dtype: bf16 on a GPU, fp32 on a
    # CPU). The plain class defaults to fp32, the exact reference path; the service's default is auto
    dtype: str = "float32"
    # paged-attention and DeltaNet decode kernels: auto | torch | cpu | triton (kernels.dispatch:
    # Triton on CUDA, the C++ DeltaNet decode kernels on a CPU)
    kernels: str = "auto"
    page_size: int = 16
    max_total_tokens: int = 0        # 0: auto (from mem_fraction when set, else 2 x max_model_len, >= 131072)
    mem_fraction: float = 0.0        # > 0: KV and state pools take this share of free device memory, less the weights
    max_model_len: int = 0           # 0: the model's max_position_embeddings
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    # Chunked prefill with decode rows (vLLM's and SGLang's mixed chunk): while some requests decode,
    # a prefill step takes at most this many tokens in all and carries one token of every decoding
    # request, so they keep producing tokens while a long prompt is prefilled instead of waiting
    # for all of it; 0: a prefill step never carries decode rows
    mixed_chunk_tokens: int = 2048
    disable_radix_cache: bool = False
    pool: str = "local"
    state_slots: int = 0             # hybrid: DeltaNet state slots; 0: 2 per running request + 64 checkpoints
    checkpoint_interval: int = 0     # hybrid: checkpoint long prefills every this many tokens (0: chunk size)
    # A burst of requests (an agent's fan-out) arrives over tens of milliseconds; prefilling it in
    # a few big steps costs about half as much per request as in many small ones. So when requests
    # are still arriving (the last one less than burst_gap_s ago), admission waits, up to
    # burst_wait_s. A lone request waits burst_gap_s once. Requests the scheduler announces
    # (ExecRequest.burst: what it still held when it sent one) are waited for too, up to burst_wait_s.
    burst_gap_s: float = 0.002
    burst_wait_s: float = 0.05
    # ... unless what has arrived is this many prompt tokens already: a step that size is as cheap
    # per token as a bigger one, and waiting only delays it (each stage of the served path handles
    # a whole burst before the next sees its first request, so a burst arrives spread out); an
    # agent's siblings wait for the first one's preamble anyway. 0: always wait
    burst_enough_tokens: int = 2048
    # structured output: draft the tokens of text the grammar forces and verify them in the next
    # decode step (jump.py); at most this many per step, 0: off
    jump_forward: int = 0
    # which forced tokens: "all", only "certain" ones (the only token the grammar allows there:
    # kept without sampling, never undone), or "auto": the others too while they pay (see
    # _uncertain_pays)
    jump_forward_policy: str = "auto"
    # structured output: how text the grammar forces is spelled in tokens (spelling.py).
    # "tokenizer": as the tokenizer spells it (a mask keeps the spelling's next token alone), the
    # tokens a trained model saw for such text; llguidance's masks do so already, SGLang's
    # jump-forward appends them, and jump-forward keeps them without sampling. "model": any
    # spelling the grammar allows, the model's choice
    forced_spelling: str = "tokenizer"
    # Overlap (SGLang's overlap scheduler, for the page authority): while sequences are running, a
    # step's exchange with radix travels while the step computes, and its admissions join the next
    # step, so the round trip is off the compute thread's critical path. An idle engine still
    # waits for its exchange (there is nothing to overlap, and a lone request should start now)
    overlap: bool = True
    # the prefill of this many tokens (and a few decode steps) on scratch pages at start, so that the
    # first request does not pay first-call costs; 0: none
    warmup_tokens: int = 2048
    # KV tiers (tiers.py): pages the radix cache evicts go to this many host-memory pages (0: no
    # tiers) and from there to disk under kv_disk_dir (at most kv_disk_pages files), and come back
    # instead of being computed again
    kv_host_pages: int = 0
    kv_disk_dir: str = ""
    kv_disk_pages: int = 0
    # radix unreachable (restarting): waiting requests wait this long for it, then fail
    radix_wait_s: float = 15.0
    # output tokens whose pages are reserved at admission; 0: every one of max_new_tokens (a
    # running request never needs a page). > 0: a request grows page by page as it decodes, and
    # when the pool has none left it is preempted (back to waiting, its computed tokens cached)
    # and resumes by recomputing them, mostly from the cache
    decode_reserve: int = 256
