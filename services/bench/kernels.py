"""`radixflow bench kernels`: every Triton kernel on the shapes of a Qwen3.5-27B-class layer, against
the device's peak and against its torch reference.

For each op: time (CUDA events, triton.testing.do_bench), the bytes it must move or the FLOPs it
must do, the achieved bandwidth or FLOP/s as a share of the device's peak, the reference's time on
the same inputs (speedup), and the largest difference from the reference's output. The peaks are
measured on the spot (a device-to-device copy for bandwidth, a bf16 matmul for FLOP/s); the
vendor's figure is printed beside them where the device is known. Then end-to-end decode on the
tiny models: the engine's tokens/s with the kernels over the same engine with the references.

`--interpret` runs everything on the CPU through Triton's interpreter at toy sizes: it checks the
plumbing and the outputs; its times mean nothing.
"""
from __future__ import annotations

import os
import time

import torch

from radixflow.services.modelgen.presets import QWEN35_27B as _C

# a Qwen3.5-27B-class layer (the memory calculator's reference model), decode at batch 64 over 4k
# contexts, prefill of 4 x 2k-token chunks over 4k prefixes
FULL = dict(hq=_C["num_attention_heads"], hkv=_C["num_key_value_heads"], d=_C["head_dim"],
            hk=_C["linear_num_key_heads"], hv=_C["linear_num_value_heads"], dk=_C["linear_key_head_dim"],
            dv=_C["linear_value_head_dim"], conv_w=_C["linear_conv_kernel_dim"],
            decode_batch=64, context=4096, prefill_seqs=4, prefill_tokens=2048, shared=4096, own=256)
TOY = dict(hq=4, hkv=2, d=32, hk=1, hv=2, dk=16, dv=16, conv_w=4,
           decode_batch=3, context=70, prefill_seqs=2, prefill_tokens=20, shared=40, own=5)

# vendor peaks (dense bf16 FLOP/s, memory bandwidth B/s) by device name, for the side-by-side
VENDOR = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12)}


def _time(fn, device: torch.device) -> float:
    """Seconds per call."""
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=5, rep=40) / 1e3
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _peaks(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    bw = 2 * x.numel() / _time(lambda: y.copy_(x), device)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    fl = 2 * 8192 ** 3 / _time(lambda: a @ a, device)
    out = {"bandwidth_Bps": bw, "bf16_flops": fl, "device": torch.cuda.get_device_name(device)}
    for name, (f, b) in VENDOR.items():
        if name in out["device"]:
            out |= {"vendor_bf16_flops": f, "vendor_bandwidth_Bps": b}
    return out


def _row(name: str, kern, ref, device, *, bytes_moved: float = 0.0, flops: float = 0.0, peaks: dict,
         compare=None) -> dict:
    """Time kern() and ref(); compare() -> max |kernel - reference| (run on fresh inputs)."""
    t_k, t_r = _time(kern, device), _time(ref, device)
    row = {"op": name, "kernel_ms": round(t_k * 1e3, 4), "reference_ms": round(t_r * 1e3, 4),
           "speedup_vs_reference": round(t_r / t_k, 2)}
    if bytes_moved:
        row["GBps"] = round(bytes_moved / t_k / 1e9, 1)
        if peaks:
            row["share_of_peak_bandwidth"] = round(bytes_moved / t_k / peaks["bandwidth_Bps"], 3)
    if flops:
        row["TFLOPs"] = round(flops / t_k / 1e12, 2)
        if peaks:
            row["share_of_peak_flops"] = round(flops / t_k / peaks["bf16_flops"], 3)
    if compare is not None:
        row["max_abs_diff"] = float(compare())
    return row


def _ops(s: dict, device: torch.device, dt: torch.dtype, peaks: dict) -> list[dict]:
    from radixflow.kernels.dispatch import reference, triton_kernels
    T, R = triton_kernels(), reference()
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, dtype=dt, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)
    hq, hkv, d, N, L = s["hq"], s["hkv"], s["d"], s["decode_batch"], s["context"]
    esz = torch.tensor([], dtype=dt).element_size()
    rows = []

    # decode attention: N sequences of L tokens on scattered pages of 16
    S = N * L + 64
    kc, vc = rnd(S, hkv, d), rnd(S, hkv, d)
    table = torch.randperm(S, generator=g)[:N * L].view(N, L).to(device)
    lens = torch.full((N,), L, device=device)
    q = rnd(N, hq, d)
    rows.append(_row("decode_attention", lambda: T.decode_attention(q, kc, vc, table, lens, d ** -0.5),
                     lambda: R.decode_attention(q, kc, vc, table, lens, d ** -0.5), device, peaks=peaks,
                     bytes_moved=2 * N * L * hkv * d * esz + N * L * 8,
                     compare=lambda: (T.decode_attention(q, kc, vc, table, lens, d ** -0.5).float()
                                      - R.decode_attention(q, kc, vc, table, lens, d ** -0.5).float()).abs().max()))

    # cascade decode: the N sequences share a prefix of `shared` tokens and own `own` each
    from radixflow.kernels.attention.cascade import SharedPrefix
    sh, own = s["shared"], s["own"]
    shared = torch.arange(sh, device=device)
    own_table = (sh + torch.arange(N * own, device=device)).view(N, own)
    own_lens = torch.full((N,), own, device=device)
    groups = [SharedPrefix(seqs=list(range(N)), slots=shared, start=0)]
    rows.append(_row("cascade_decode", lambda: T.cascade_decode(q, kc, vc, own_table, own_lens, groups, d ** -0.5),
                     lambda: R.cascade_decode(q, kc, vc, own_table, own_lens, groups, d ** -0.5), device, peaks=peaks,
                     bytes_moved=2 * (sh + N * own) * hkv * d * esz,
                     compare=lambda: (T.cascade_decode(q, kc, vc, own_table, own_lens, groups, d ** -0.5).float()
                                      - R.cascade_decode(q, kc, vc, own_table, own_lens, groups, d ** -0.5).float()).abs().max()))

    # extend: prefill_seqs chunks of prefill_tokens over a prefix of `context` tokens each
    B, E = s["prefill_seqs"], s["prefill_tokens"]
    seq_slots = [torch.randperm(S, generator=g)[:L + E].to(device) for _ in range(B)]
    bounds = [(i * E, (i + 1) * E) for i in range(B)]
    qe = rnd(B * E, hq, d)
    flops = 4 * B * hq * d * sum(L + i + 1 for i in range(E))
    rows.append(_row("extend_attention", lambda: T.extend_attention(qe, kc, vc, bounds, seq_slots, [L] * B, d ** -0.5),
                     lambda: R.extend_attention(qe, kc, vc, bounds, seq_slots, [L] * B, d ** -0.5), device,
                     peaks=peaks, flops=flops,
                     compare=lambda: (T.extend_attention(qe, kc, vc, bounds, seq_slots, [L] * B, d ** -0.5).float()
                                      - R.extend_attention(qe, kc, vc, bounds, seq_slots, [L] * B, d ** -0.5).float()).abs().max()))

    # write_kv: a prefill's B * E tokens
    kn, vn = rnd(B * E, hkv, d), rnd(B * E, hkv, d)
    out_slots = torch.randperm(S, generator=g)[:B * E].to(device)
    rows.append(_row("write_kv", lambda: T.write_kv(kc, vc, out_slots, kn, vn), lambda: R.write_kv(kc, vc, out_slots, kn, vn),
                     device, peaks=peaks, bytes_moved=4 * B * E * hkv * d * esz))

    # DeltaNet: states fp32 in a pool of N + 8 slots
    hk, hv, dk, dv = s["hk"], s["hv"], s["dk"], s["dv"]
    pool = rnd(N + 8, hv, dk, dv, dtype=torch.float32, scale=0.05)
    slots = torch.randperm(N + 8, generator=g)[:N].to(device)
    qd, kd, vd = rnd(N, hk, dk), rnd(N, hk, dk), rnd(N, hv, dv)
    gd, bd = -torch.rand(N, hv, generator=g).to(device) * 0.1, torch.rand(N, hv, generator=g).to(device)

    def gdr_diff():
        a, b = pool.clone(), pool.clone()
        return (T.gated_delta_rule_decode_slots(qd, kd, vd, gd, bd, a, slots).float()
                - R.gated_delta_rule_decode_slots(qd, kd, vd, gd, bd, b, slots).float()).abs().max()
    rows.append(_row("gated_delta_rule_decode", lambda: T.gated_delta_rule_decode_slots(qd, kd, vd, gd, bd, pool, slots),
                     lambda: R.gated_delta_rule_decode_slots(qd, kd, vd, gd, bd, pool, slots), device, peaks=peaks,
                     bytes_moved=2 * N * hv * dk * dv * 4, compare=gdr_diff))

    Tp = B * E
    qp, kp, vp = rnd(Tp, hk, dk), rnd(Tp, hk, dk), rnd(Tp, hv, dv)
    gp, bp = -torch.rand(Tp, hv, generator=g).to(device) * 0.1, torch.rand(Tp, hv, generator=g).to(device)
    op = torch.empty(Tp, hv, dv, dtype=dt, device=device)
    pslots, taps = slots[:B].tolist(), [[] for _ in range(B)]
    rows.append(_row("gated_delta_rule_prefill",
                     lambda: T.gated_delta_rule_prefill_slots(qp, kp, vp, gp, bp, op, pool, bounds, pslots, taps),
                     lambda: R.gated_delta_rule_prefill_slots(qp, kp, vp, gp, bp, op, pool, bounds, pslots, taps),
                     device, peaks=peaks, flops=6 * Tp * hv * dk * dv))

    # the short conv over [q | k | v]
    C, W = 2 * hk * dk + hv * dv, s["conv_w"]
    cpool = rnd(N + 8, C, W - 1)
    wt = rnd(C, W)
    xc = rnd(N, C)
    rows.append(_row("causal_conv1d_update", lambda: T.causal_conv1d_update_slots(xc, cpool, wt, slots),
                     lambda: R.causal_conv1d_update_slots(xc, cpool, wt, slots), device, peaks=peaks,
                     bytes_moved=(2 * N * C * (W - 1) + 2 * N * C) * esz))
    xp, yp = rnd(Tp, C), torch.empty(Tp, C, dtype=dt, device=device)
    rows.append(_row("causal_conv1d_prefill", lambda: T.causal_conv1d_prefill_slots(xp, yp, cpool, wt, bounds, pslots, taps),
                     lambda: R.causal_conv1d_prefill_slots(xp, yp, cpool, wt, bounds, pslots, taps), device,
                     peaks=peaks, bytes_moved=2 * Tp * C * esz))
    return rows


def _e2e(device: torch.device, interpret: bool) -> list[dict]:
    """Decode tokens/s of the tiny models' engine with the kernels over the same with references."""
    from radixflow.services.bench.common import resolve_model
    from radixflow.services.executor.engine import Engine, EngineConfig
    from radixflow.shared.messages import ExecRequest, SamplingParams
    batch, prompt, steps = (2, 8, 3) if interpret else (32, 512, 64)
    out = []
    for name in ("tiny-dense", "tiny-hybrid"):
        model = resolve_model(name)
        rate = {}
        for kernels in ("torch", "triton"):
            e = Engine(EngineConfig(model=model, device=str(device), dtype="bfloat16" if device.type == "cuda" else "float32",
                                    kernels=kernels, burst_gap_s=0, overlap=False, max_running_requests=batch,
                                    warmup_tokens=8 if interpret else 2048))
            for i in range(batch):
                e.add(ExecRequest(rid=f"{kernels}{i}", input_ids=[(7 * j + i) % 4000 + 3 for j in range(prompt)],
                                  sampling=SamplingParams(max_new_tokens=steps + 1, temperature=0, ignore_eos=True)))
            e.step()                                       # the prefill
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0, toks = time.perf_counter(), 0
            while e.has_work():
                toks += sum(len(o.token_ids) for _, o in e.step())
            if device.type == "cuda":
                torch.cuda.synchronize()
            rate[kernels] = toks / (time.perf_counter() - t0)
        out.append({"model": name, "batch": batch, "decode_tok_s_reference": round(rate["torch"], 1),
                    "decode_tok_s_kernels": round(rate["triton"], 1),
                    "speedup": round(rate["triton"] / rate["torch"], 2)})
    return out


def run_kernels(interpret: bool = False) -> dict:
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"      # before any kernel module is imported
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("bench kernels needs a CUDA device (or --interpret: the kernels in Triton's "
                         "interpreter at toy sizes, which checks them but times nothing)")
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    peaks = _peaks(device)
    t0 = time.perf_counter()
    ops = _ops(TOY if interpret else FULL, device, dt, peaks)
    e2e = _e2e(device, interpret)
    return {"device": peaks.get("device", "cpu (Triton interpreter: times are meaningless)"), "dtype": str(dt),
            "shapes": TOY if interpret else FULL, "peaks": {k: v for k, v in peaks.items() if k != "device"},
            "ops": ops, "end_to_end_decode": e2e, "seconds": round(time.perf_counter() - t0, 1)}
