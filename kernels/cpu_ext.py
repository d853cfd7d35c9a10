"""The CPU kernels (gated_delta_rule/cpu_decode.cpp, causal_conv1d/cpu_update.cpp,
elementwise/cpu_fused.cpp, bitmask/cpu_apply.cpp, attention/cpu_decode.cpp, attention/cpu_prefill.cpp,
linear/cpu_gemm.cpp): C++ compiled on the machine that runs them, the first time (torch's
cpp_extension with g++ and ninja, about 30 s on 2 cores; kept in the environment after that, one
build per kind of CPU, see _build_dir).

The build runs in a background thread, started by the first `get()` (the first model step of a
runner that picked the CPU kernels) or `wait()`: an executor waits for it before it serves
(services/executor/service.py, up to kernel_build_wait_s), and an Engine made directly runs the
torch references until the build is done, then the compiled ones (cpu.py in each kernel's folder
asks `get()` per call). Where there is
no compiler, the build fails once, with a warning, and the references stay. RADIXFLOW_CPU_KERNELS=0
turns the build off. Benchmarks and tests `wait()` for it.
"""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path


_HERE = Path(__file__).parent
# elementwise first: its storage loads (F32 / BF16) and exp_fast serve the others (one translation unit)
SOURCES = [_HERE / "elementwise" / "cpu_fused.cpp", _HERE / "gated_delta_rule" / "cpu_decode.cpp",
           _HERE / "causal_conv1d" / "cpu_update.cpp", _HERE / "bitmask" / "cpu_apply.cpp",
           _HERE / "attention" / "cpu_decode.cpp", _HERE / "attention" / "cpu_prefill.cpp",
           _HERE / "linear" / "cpu_gemm.cpp"]
FUNCTIONS = ["gdr_decode_depths", "gdr_prefill", "conv_update_depths", "conv_prefill", "silu_mul",
             "silu_mul_takes_bf16", "rms_norm", "add_rms_norm", "gated_rms_norm", "apply_bitmask", "decode_rows", "attend_prefill",
             "attend_takes_bf16", "attend_takes_fp32", "attend_cascade", "rotary", "linear_takes_bf16", "linear_takes_fp32", "linear_pack", "linear_packed"]

_lock = threading.Lock()
_done = threading.Event()
_thread: threading.Thread | None = None
_module = None


def enabled() -> bool:
    return os.environ.get("RADIXFLOW_CPU_KERNELS", "1") != "0"


STALE_LOCK_S = 600


def _clear_stale_lock(d: str | None) -> None:
    """torch's build holds a `lock` file in the build folder while it compiles; a build that was
    killed leaves it there, and every later build waits on it forever (found in an environment whose
    kernels had silently never built since). Older than any build takes, it is removed."""
    import time
    if d is None:
        return
    lock = Path(d) / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except OSError:
        pass


def _load():
    from torch.utils.cpp_extension import load_inline
    decls = ("void gdr_decode_depths(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, "
             "const at::Tensor& g, const at::Tensor& beta, at::Tensor& pool, const at::Tensor& slots, "
             "const at::Tensor& offsets, const at::Tensor& lens, at::Tensor& o, at::Tensor& saved, "
             "const at::Tensor& soff, bool l2norm, double scale);\n"
             "void gdr_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, "
             "const at::Tensor& beta, at::Tensor& o, at::Tensor& pool, const at::Tensor& starts, "
             "const at::Tensor& ends, const at::Tensor& slots, const at::Tensor& tap_lo, const at::Tensor& tap_at, "
             "const at::Tensor& tap_dst, bool l2norm, double scale);\n"
             "void conv_prefill(const at::Tensor& x, at::Tensor& y, at::Tensor& pool, const at::Tensor& weight, "
             "const at::Tensor& starts, const at::Tensor& ends, const at::Tensor& slots, const at::Tensor& tap_lo, "
             "const at::Tensor& tap_at, const at::Tensor& tap_dst, bool silu);\n"
             "void conv_update_depths(const at::Tensor& x, at::Tensor& pool, const at::Tensor& weight, "
             "const at::Tensor& slots, const at::Tensor& offsets, const at::Tensor& lens, at::Tensor& y, "
             "at::Tensor& saved, const at::Tensor& soff, bool silu);\n"
             "void silu_mul(const at::Tensor& h, at::Tensor& out);\n"
             "bool silu_mul_takes_bf16();\n"
             "void rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool cast_first, at::Tensor& out);\n"
             "void add_rms_norm(at::Tensor& x, const at::Tensor& r, const at::Tensor& w, double eps, bool cast_first, "
             "at::Tensor& out);\n"
             "void gated_rms_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& w, double eps, "
             "at::Tensor& out);\n"
             "void apply_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows, "
             "const at::Tensor& mask_rows);\n"
             "void decode_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, "
             "const at::Tensor& table, const at::Tensor& lens, double scale, at::Tensor& o, at::Tensor& lse);\n"
             "void attend_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, "
             "const at::Tensor& q_pos, const at::Tensor& slots, double scale, at::Tensor& o, at::Tensor& lse);\n"
             "void attend_cascade(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, "
             "const at::Tensor& shared, const at::Tensor& bounds, const at::Tensor& own, const at::Tensor& own_off, "
             "const at::Tensor& q_off, double scale, at::Tensor& o, at::Tensor& lse);\n"
             "bool attend_takes_bf16();\n"
             "bool attend_takes_fp32();\n"
             "void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out);\n"
             "bool linear_takes_bf16();\n"
             "bool linear_takes_fp32();\n"
             "at::Tensor linear_pack(const at::Tensor& w, int64_t halves);\n"
             "void linear_packed(const at::Tensor& x, const at::Tensor& wp, int64_t n_out, bool silu, at::Tensor& out);\n")
    src = "\n".join(p.read_text() for p in SOURCES)
    # -fopenmp: at::parallel_for is OpenMP inlined into the kernel, and without the flag it runs its
    # tasks one after another (the kernels used one core of two). The library it links resolves to
    # the libgomp that torch has loaded (one thread pool, torch's thread count).
    # GCC's tuning for AVX-512 CPUs prefers 256-bit vectors; the rule's 64-float state rows fit four
    # 512-bit registers, which makes prefill faster (a harmless hint where the CPU has no AVX-512)
    flags = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]
    # the bindings release the GIL while a kernel runs (load_inline's own `functions=` keep it): a
    # 3,100-token DeltaNet prefill holds no Python object, and under `radixflow up` the event loop
    # (gateway, scheduler, radix) shares this process and would otherwise wait the kernel out
    binds = "".join(f'm.def("{f}", torch::wrap_pybind_function_no_gil({f}), "{f}");\n' for f in FUNCTIONS)
    module = f"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{binds}}}\n"
    build_dir = _build_dir()
    _clear_stale_lock(build_dir)
    name = "radixflow_cpu_kernels" if build_dir else f"radixflow_cpu_kernels_{cpu_signature()}"
    return load_inline(name, cpp_sources=[src, decls, module],
                       extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=build_dir, verbose=False)


def cpu_signature(cpuinfo: str | None = None) -> str:
    """What the build is for: `-march=native` compiles for this CPU's instruction sets, and torch
    rebuilds only when the sources or the flags change, so an environment that machines with other
    CPUs share (a virtualenv on a network disk, a container image moved between hosts) would load a
    build whose instructions their CPU lacks, and the process would die of SIGILL at its first
    kernel. A hash of the CPU's feature flags (/proc/cpuinfo), or of the platform elsewhere."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = next((line.split(":", 1)[1] for line in cpuinfo.splitlines()
                  if line.startswith(("flags", "Features")) and ":" in line), "")
    ident = " ".join(sorted(flags.split())) or f"{platform.machine()} {platform.processor()}"
    return hashlib.sha1(ident.encode()).hexdigest()[:12]


def _build_dir() -> str | None:
    """Inside the environment (a virtualenv's prefix) where it is writable, one folder per kind of
    CPU (cpu_signature): the build depends on that environment's torch headers, and two
    environments sharing torch's default folder would rebuild each other's out. Elsewhere torch's
    default (~/.cache/torch_extensions), under a name that carries the signature."""
    d = Path(sys.prefix) / "var" / "radixflow" / "cpu_kernels" / cpu_signature()
    try:
        d.mkdir(parents=True, exist_ok=True)
        return str(d) if os.access(d, os.W_OK) else None
    except OSError:
        return None


def _build() -> None:
    global _module
    from radixflow.shared.log import get
    log = get("radixflow.kernels")          # the project's logging (stderr), configured once
    try:
        # the compiler runs in a process of its own at the lowest priority, so that a server
        # starting meanwhile (on 2 cores) is not slowed by it; then the build, cached, loads here
        done = subprocess.run(["nice", "-n", "19", sys.executable, "-m", "radixflow.kernels.cpu_ext"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError((done.stderr or done.stdout).strip()[-500:])
        _module = _load()
        log.info("cpu kernels built")
    except Exception as e:        # no compiler, no ninja: the torch references serve
        log.warning("cpu kernels unavailable, the torch references serve", error=f"{type(e).__name__}: {e}"[:500])
    finally:
        _done.set()


def start() -> None:
    """Build (or load the cached build) in the background, once per process."""
    global _thread
    if not enabled():
        _done.set()
        return
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_build, name="cpu-kernels-build", daemon=True)
            _thread.start()


def get():
    """The compiled module, or None while it builds (or where it cannot); the first call starts
    the build (so a runner with other kernels never builds it)."""
    if _thread is None:
        start()
    return _module if _done.is_set() else None


def wait(timeout: float | None = None):
    """Start the build if needed and wait for it: the module, or None where it cannot be built."""
    start()
    _done.wait(timeout)
    return get()


if __name__ == "__main__":      # the build itself (start() runs it in a process of its own)
    _load()


def kept_on(weight, name: str, variant, make):
    """What the kernels derive from a model weight (a packed copy, a norm's fp32 factor), made once per
    variant and kept on the weight itself as `name`: it lives and dies with the model, and a weight
    written in place (its version changes) gets it made again."""
    key = (weight.data_ptr(), weight._version, variant)
    kept = getattr(weight, name, None)
    if kept is None or kept[0] != key:
        kept = (key, make())
        setattr(weight, name, kept)
    return kept[1]
