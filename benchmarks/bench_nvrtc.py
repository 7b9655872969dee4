"""Kernels from source: a cold compile and a cache hit, each in a fresh process, from the source string to a
loaded kernel, side by side: cuproc (Program + its disk cache), cuda.core (Program, and its
FileStreamProgramCache where the installed cuda.core has one) and CuPy (RawModule with a name expression,
RawKernel with an extern "C" name; its kernel cache).

Every row runs in a fresh interpreter that has imported its library and made device 0's context current
before its clock starts; the child prints the milliseconds from the source string to a kernel it could
launch.  Cold rows get an empty cache directory each run; hit rows one that an earlier run of the same row
filled.  Rows take turns in a new order each round (:func:`harness.round_order`).  The kernel is 50 lines
of templated CUDA C++ (``KERNEL`` below).

Goal (issue 37): a cache hit in a fresh process, source string to loaded module, under 2 ms; the cold
compile is reported next to cuda.core's.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, Goals, bench_args, bench_parser, machine, plot_bars, round_order, write_results  # noqa: E402

KERNEL = r"""
// 50 lines: a templated fused update with device helpers and an extern "C" entry point.
template <typename T>
__device__ __forceinline__ T clamp01(T v) {
    return v < T(0) ? T(0) : (v > T(1) ? T(1) : v);
}

template <typename T>
__device__ __forceinline__ T smoothstep(T e0, T e1, T x) {
    T t = clamp01((x - e0) / (e1 - e0));
    return t * t * (T(3) - T(2) * t);
}

template <typename T>
__device__ T polynomial(T x) {
    T acc = T(0);
    const T coeffs[6] = {T(0.5), T(-1.25), T(0.75), T(0.125), T(-0.0625), T(0.03125)};
    for (int k = 5; k >= 0; --k) acc = acc * x + coeffs[k];
    return acc;
}

template <typename T>
__global__ void fused(const T* __restrict__ x, const T* __restrict__ y, T* __restrict__ out,
                      T alpha, T beta, int n) {
    int stride = blockDim.x * gridDim.x;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        T a = x[i];
        T b = y[i];
        T s = smoothstep(T(-1), T(1), a - b);
        T p = polynomial(a * alpha);
        T q = polynomial(b * beta);
        T r = s * p + (T(1) - s) * q;
        if (r != r) r = T(0);
        out[i] = r;
    }
}

extern "C" __global__ void fused_f32(const float* x, const float* y, float* out,
                                     float alpha, float beta, int n) {
    int stride = blockDim.x * gridDim.x;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float a = x[i], b = y[i];
        float s = smoothstep(-1.0f, 1.0f, a - b);
        out[i] = s * polynomial(a * alpha) + (1.0f - s) * polynomial(b * beta);
    }
}

template __global__ void fused<float>(const float*, const float*, float*, float, float, int);
template __global__ void fused<double>(const double*, const double*, double*, double, double, int);
"""
EXPRESSION = "fused<float>"   # the templated kernel, by a name expression
EXTERN_C = "fused_f32"        # the extern "C" kernel, by its name

# Each child: imports and context first (not timed), then the source string to a loadable kernel, then one
# JSON line: whether it hit its cache ("?" where the library does not say), the milliseconds, and the NVRTC it
# used (version, and the library file this process mapped; the version is asked after the clock).
# BENCH_NAME is the kernel: the name expression EXPRESSION, or the extern "C" EXTERN_C (no name expressions).
NVRTC_MAPPED = """
def nvrtc_mapped():
    with open("/proc/self/maps") as f:
        paths = sorted({{line.split()[-1] for line in f if "libnvrtc" in line and "builtins" not in line}})
    return ", ".join(paths) or "none mapped"
"""   # a template, as the children are: braces doubled
CUPROC = NVRTC_MAPPED + """
import os, sys, time, json
sys.path.insert(0, {root!r})
import cuproc, cuproc.program, cuproc.compiled_module, cuproc.nvrtc
src = open(os.environ["BENCH_SOURCE"]).read()
smoke = os.environ.get("BENCH_SMOKE") == "1"
name = os.environ["BENCH_NAME"]
expressions = [name] if name == {expr!r} else []
cache = False if os.environ.get("BENCH_NO_CACHE") == "1" else os.environ["BENCH_CACHE"]
if not smoke:
    pc = cuproc.use_device(0)
if os.environ.get("BENCH_PREOPEN") == "1":
    cuproc.nvrtc.open_nvrtc()   # the library's 10-15 ms dlopen out of the clock, as a peer's import may do
t0 = time.perf_counter()
code = cuproc.Program(src, name="bench.cu").compile(name_expressions=expressions, cache=cache,
                                                    arch="sm_90" if smoke else None)
if not smoke:
    fn = code.load().get_function(name)
t1 = time.perf_counter()
located = cuproc.nvrtc.locate()
mapped = nvrtc_mapped()
where = mapped if mapped != "none mapped" else f"not opened; keyed on {{located.path if located else '?'}}"
print(json.dumps({{"hit": str(code.from_cache), "ms": (t1 - t0) * 1e3, "nvrtc": f"{{code.nvrtc_version}} ({{where}})"}}))
"""
CORE = NVRTC_MAPPED + """
import os, time, json
try:
    from cuda.core import Device, Program, ProgramOptions
except ImportError:
    from cuda.core.experimental import Device, Program, ProgramOptions
src = open(os.environ["BENCH_SOURCE"]).read()
dev = Device(0)
dev.set_current()
arch = "sm_" + "".join(str(v) for v in dev.compute_capability)
name = os.environ["BENCH_NAME"]
extra = {{"name_expressions": (name,)}} if name == {expr!r} else {{}}
if os.environ.get("BENCH_CORE_CACHE") == "1":   # a cuda.core that refuses name expressions with cache= fails the row
    from cuda.core.utils import FileStreamProgramCache
    extra["cache"] = FileStreamProgramCache(os.environ["BENCH_CACHE"])
t0 = time.perf_counter()
obj = Program(src, "c++", options=ProgramOptions(arch=arch)).compile("cubin", **extra)
kernel = obj.get_kernel(name)
t1 = time.perf_counter()
from cuda.bindings import nvrtc
_, major, minor = nvrtc.nvrtcVersion()
print(json.dumps({{"hit": "?", "ms": (t1 - t0) * 1e3, "nvrtc": f"{{major}}.{{minor}} ({{nvrtc_mapped()}})"}}))
"""
CUPY_VERSION = """
from cupy.cuda import nvrtc
major, minor = nvrtc.getVersion()
print(json.dumps({"hit": "?", "ms": (t1 - t0) * 1e3, "nvrtc": f"{major}.{minor} ({nvrtc_mapped()})"}))
"""
CUPY_MODULE = NVRTC_MAPPED + """
import os, time, json
import cupy
cupy.cuda.Device(0).use()
cupy.empty(1)
src = open(os.environ["BENCH_SOURCE"]).read()
t0 = time.perf_counter()
fn = cupy.RawModule(code=src, name_expressions=[{expr!r}]).get_function({expr!r})
t1 = time.perf_counter()
""" + CUPY_VERSION.replace("{", "{{").replace("}", "}}")
CUPY_KERNEL = NVRTC_MAPPED + """
import os, time, json
import cupy
cupy.cuda.Device(0).use()
cupy.empty(1)
src = open(os.environ["BENCH_SOURCE"]).read()
t0 = time.perf_counter()
k = cupy.RawKernel(src, {extern!r})
k.compile() if hasattr(k, "compile") else k.kernel
t1 = time.perf_counter()
""" + CUPY_VERSION.replace("{", "{{").replace("}", "}}")
NAMED, EXTERN = {"BENCH_NAME": EXPRESSION}, {"BENCH_NAME": EXTERN_C}
NO_CACHE = {"BENCH_NO_CACHE": "1"}
# row -> (child code, cache kind: "cold" | "hit", extra environment).  Both kernel styles for cuproc and
# cuda.core, so that each hit is compared with the same kind of lookup; cold rows of cuproc with and without
# storing the result (cuda.core's cold row stores nothing; CuPy always stores).
ROWS: dict[str, tuple[str, str, dict[str, str]]] = {
    "cuproc Program (name expression), cold, no cache": (CUPROC, "cold", {**NAMED, **NO_CACHE}),
    "cuproc Program (name expression), cold, no cache, NVRTC opened before the clock":
        (CUPROC, "cold", {**NAMED, **NO_CACHE, "BENCH_PREOPEN": "1"}),
    "cuproc Program (name expression), cold, storing in its cache": (CUPROC, "cold", NAMED),
    "cuproc Program (name expression), cache hit": (CUPROC, "hit", NAMED),
    "cuproc Program (extern \"C\"), cache hit": (CUPROC, "hit", EXTERN),
    "cuda.core Program (name expression), cold, no cache": (CORE, "cold", NAMED),
    "cuda.core Program + FileStreamProgramCache (name expression), hit": (CORE, "hit", {**NAMED, "BENCH_CORE_CACHE": "1"}),
    "cuda.core Program + FileStreamProgramCache (extern \"C\"), hit": (CORE, "hit", {**EXTERN, "BENCH_CORE_CACHE": "1"}),
    "CuPy RawModule (name expression), cold, storing in its cache": (CUPY_MODULE, "cold", NAMED),
    "CuPy RawModule (name expression), cache hit": (CUPY_MODULE, "hit", NAMED),
    "CuPy RawKernel (extern \"C\"), cold, storing in its cache": (CUPY_KERNEL, "cold", EXTERN),
    "CuPy RawKernel (extern \"C\"), cache hit": (CUPY_KERNEL, "hit", EXTERN),
}
HIT = "cuproc Program (name expression), cache hit"
COLD = "cuproc Program (name expression), cold, no cache"
COLD_STORING = "cuproc Program (name expression), cold, storing in its cache"
CORE_COLD = "cuda.core Program (name expression), cold, no cache"
CUPROC_ROWS = [name for name in ROWS if name.startswith("cuproc")]


def run_child(code: str, env: dict[str, str]) -> dict[str, Any]:
    """Run one row's child; its last line of output, as JSON: hit, ms, nvrtc."""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def child_code(code: str) -> str:
    return code.format(root=str(ROOT), expr=EXPRESSION, extern=EXTERN_C)


class Runs:
    """What the rows gave: milliseconds, hit flags and the NVRTC each used, and the rows that failed."""

    def __init__(self, rows: list[str]) -> None:
        self.times: dict[str, list[float]] = {name: [] for name in rows}
        self.flags: dict[str, list[str]] = {name: [] for name in rows}
        self.nvrtc: dict[str, set[str]] = {name: set() for name in rows}
        self.errors: dict[str, str] = {}

    def add(self, name: str, out: dict[str, Any]) -> None:
        self.times[name].append(float(out["ms"]))
        self.flags[name].append(str(out["hit"]))
        self.nvrtc[name].add(str(out["nvrtc"]))

    def fail(self, name: str, exc: subprocess.CalledProcessError) -> None:
        self.errors[name] = ((exc.stderr or "").strip().splitlines() or [str(exc)])[-1][:160]
        for table in (self.times, self.flags, self.nvrtc):
            del table[name]

    def cuproc_flags_right(self) -> bool:
        """Every cuproc hit row hit and every cuproc cold row compiled."""
        return all(all(f == ("True" if ROWS[name][1] == "hit" else "False") for f in self.flags[name])
                   for name in self.flags if name in CUPROC_ROWS)


def measure(rows: dict[str, tuple[str, str, dict[str, str]]], rounds: int, smoke: bool) -> Runs:
    """Each row once to fill its cache (a failing peer is reported, not timed), then ``rounds`` rounds."""
    runs = Runs(list(rows))
    with tempfile.TemporaryDirectory(prefix="cuproc-bench-nvrtc-") as tmp:
        source = Path(tmp, "kernel.cu")
        source.write_text(KERNEL)
        base = {**os.environ, "BENCH_SOURCE": str(source), "BENCH_SMOKE": "1" if smoke else "0"}
        warm = {name: str(Path(tmp, f"warm-{i}")) for i, name in enumerate(rows)}
        for name, (code, _, extra) in rows.items():
            env = {**base, **extra, "BENCH_CACHE": warm[name], "CUPY_CACHE_DIR": warm[name]}
            try:
                run_child(child_code(code), env)   # fills the hit rows' cache
            except subprocess.CalledProcessError as exc:
                runs.fail(name, exc)
        for rnd in range(rounds):
            for name in round_order(list(runs.times), rnd):
                code, kind, extra = rows[name]
                cache = warm[name] if kind == "hit" else tempfile.mkdtemp(dir=tmp, prefix="cold-")
                runs.add(name, run_child(child_code(code), {**base, **extra, "BENCH_CACHE": cache,
                                                            "CUPY_CACHE_DIR": cache}))
    return runs


def nvrtc_line(runs: Runs) -> str:
    """Which NVRTC each library used (version and file), as its rows reported it."""
    by_library: dict[str, set[str]] = {}
    for name, used in runs.nvrtc.items():
        by_library.setdefault(name.split(" Program")[0].split(" Raw")[0], set()).update(used)
    return "; ".join(f"{lib}: {' | '.join(sorted(used))}" for lib, used in by_library.items())


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("Kernels from source, cold and cached, cuproc against cuda.core and "
                     "CuPy (GPU machine); --smoke runs cuproc's rows on CPU",
                     smoke_help="cuproc on CPU only (compile and cache, no loading)")
    p.add_argument("--rounds", type=int, default=7)
    args = bench_args(p, argv)
    rounds = 2 if args.smoke else args.rounds
    rows = {k: v for k, v in ROWS.items() if not args.smoke or k in CUPROC_ROWS}
    runs = measure(rows, rounds, args.smoke)
    ms = {name: statistics.median(v) for name, v in runs.times.items() if v}
    goals = Goals()
    goals.check("cuproc cache hit in a fresh process, source string to loaded module (50-line kernel), median",
                ms.get(HIT), 2.0, unit=" ms",
                why_not="smoke run: no module is loaded" if args.smoke else
                (None if runs.cuproc_flags_right() else "a cuproc hit row did not hit, or a cold row did not compile"))
    used = nvrtc_line(runs)
    print(f"NVRTC used: {used}")
    data = {"machine": machine(), "smoke": args.smoke, "median_ms": ms, "runs_ms": runs.times,
            "from_cache": runs.flags, "nvrtc_by_row": {k: sorted(v) for k, v in runs.nvrtc.items()},
            "nvrtc": used, "errors": runs.errors, "kernel_lines": KERNEL.strip().count("\n") + 1}
    table = [[name, f"{v:.2f}", f"{min(runs.times[name]):.2f} - {max(runs.times[name]):.2f}",
              f"{v / ms[CORE_COLD]:.2f}" if CORE_COLD in ms else "", " | ".join(sorted(runs.nvrtc[name]))]
             for name, v in ms.items()]
    table += [[name, "missing", why[:80], "", ""] for name, why in runs.errors.items()]
    notes = [f"{rounds} rounds, each row in a fresh process per round, rows in a new order each round; medians",
             "clock: from the source string to a kernel ready to launch (cuproc: Program.compile + load + "
             "get_function; cuda.core: Program.compile + ObjectCode.get_kernel; CuPy: RawModule.get_function, "
             "RawKernel.compile), after the library's import and device 0's context (not timed)",
             f"kernels: {EXPRESSION} by a name expression, {EXTERN_C} (extern \"C\") by its name, in one source; "
             "each hit is compared with the same kind of lookup",
             f"NVRTC used (version, and the file the process mapped; a cuproc hit maps none): {used}",
             f"cold compile without a cache, cuproc vs cuda.core: {ms[COLD]:.1f} ms vs {ms[CORE_COLD]:.1f} ms"
             if COLD in ms and CORE_COLD in ms else "cold compile vs cuda.core: not measured in this run",
             f"cold compile storing in the cache, cuproc: {ms[COLD_STORING]:.1f} ms" if COLD_STORING in ms else "",
             f"cache hit vs cold, cuproc: {ms[HIT]:.2f} ms vs {ms[COLD]:.1f} ms" if HIT in ms and COLD in ms else ""]
    args.out.mkdir(parents=True, exist_ok=True)
    plot = plot_bars(args.out / "bench_nvrtc.png", f"Source string to loaded kernel, fresh process, "
                     f"{data['machine'].get('gpu')}, {data['machine']['date']}", "ms (median)",
                     list(ms.items()), None)
    path = write_results(args.out, "bench_nvrtc", data, table,
                         ["row", "ms (median)", "range (ms)", "vs cuda.core cold", "NVRTC"], notes, goals, [plot])
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
