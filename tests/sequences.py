"""Random sequences of ordinary public calls across every object kind, run in a child process.

Used by the ownership tests on the fake driver (CI) and on the GPU.  Each
sequence creates, uses, closes, destroys and drops contexts, buffers (device,
stream-ordered, pinned with NumPy views, managed), streams, events, modules,
functions and prepared launches, in random order; half of them from four
threads; some fork and check that the child refuses.  A use of something
that ended must raise ClosedResourceError (or BufferError for host memory
with live views) -- never reach the driver, never crash.  Any other error is
a failure.  At the end of each sequence everything is dropped, and the
checker (fake-driver counters, or the GPU's memory and primary-context state)
must find nothing left behind.

    python tests/sequences.py --sequences 200 --seed 1 [--fake /path/libfakecuda.so]

prints one JSON line: counts, failures (with the sequence's seed and op), and
what was left behind.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import cuproc  # noqa: E402
from cuproc import Context, DeviceBuffer, Event, Module, Stream  # noqa: E402
from cuproc import memory as mem  # noqa: E402
from cuproc.errors import ClosedResourceError, ForkedProcessError  # noqa: E402

EXPECTED = (ClosedResourceError, BufferError)
N = 256                                  # elements per buffer (float32)


class Failure(Exception):
    pass


class World:
    """One thread's objects; parents are shared by reference like a user's code would."""

    def __init__(self, rng: random.Random, image: bytes, primary: Any, keep: int = 0) -> None:
        self.rng, self.image, self.primary = rng, image, primary
        self.retains = 0
        # Retains this world never gives back during the sequence.  With several threads each keeps
        # one: destroying what another thread is using at that moment is a race in the program
        # (as in C), which cuproc does not promise to survive -- see the resource model's docstring.
        self.keep = keep
        self.objects: dict[str, list[Any]] = {k: [] for k in (
            "ctx", "buf", "pinned", "view", "managed", "stream", "event", "module", "fn", "run")}

    def pick(self, kind: str) -> Any:
        items = self.objects[kind]
        return self.rng.choice(items) if items else None

    def contexts(self) -> list[Any]:
        found = list(self.objects["ctx"])
        if self.retains:
            found.append(self.primary.context)
        return found

    def some_context(self) -> Any:
        found = self.contexts()
        return self.rng.choice(found) if found else None


# ----------------------------------------------------------------------------- operations

def op_ctx_create(w: World) -> None:
    ctx = Context.create(0)
    Context.pop()
    w.objects["ctx"].append(ctx)


def op_ctx_destroy(w: World) -> None:
    ctx = w.pick("ctx")
    if ctx is not None:
        ctx.destroy()


def op_retain(w: World) -> None:
    w.primary.retain()
    w.retains += 1


def op_release(w: World) -> None:
    if w.retains > w.keep:
        w.retains -= 1        # counted first: a refused release (host views) is retried at the end
        try:
            w.primary.release()
        except BufferError:
            w.retains += 1
            raise


def op_alloc(w: World) -> None:
    ctx = w.some_context()
    if ctx is not None:
        w.objects["buf"].append(DeviceBuffer(N * 4, context=ctx))


def op_alloc_async(w: World) -> None:
    stream = w.pick("stream")
    if stream is not None:
        w.objects["buf"].append(mem.alloc_async(N * 4, stream))
    elif (ctx := w.some_context()) is not None:
        w.objects["buf"].append(mem.alloc_async(N * 4, context=ctx))


def op_pinned(w: World) -> None:
    ctx = w.some_context()
    if ctx is not None:
        p = mem.PinnedBuffer(N * 4, context=ctx)
        w.objects["pinned"].append(p)
        if w.rng.random() < 0.5:
            w.objects["view"].append(p.numpy(np.float32))


def op_managed(w: World) -> None:
    ctx = w.some_context()
    if ctx is not None:
        w.objects["managed"].append(mem.ManagedBuffer(N * 4, context=ctx))


def op_stream(w: World) -> None:
    ctx = w.some_context()
    if ctx is not None:
        w.objects["stream"].append(Stream(context=ctx, non_blocking=w.rng.random() < 0.5))


def op_event(w: World) -> None:
    ctx = w.some_context()
    if ctx is not None:
        w.objects["event"].append(Event(context=ctx, timing=False))


def op_module(w: World) -> None:
    ctx = w.some_context()
    if ctx is not None:
        w.objects["module"].append(Module.load(w.image, context=ctx))


def op_function(w: World) -> None:
    m = w.pick("module")
    if m is not None:
        w.objects["fn"].append(m.get_function("empty"))


def op_prepare(w: World) -> None:
    fn = w.pick("fn")
    if fn is not None:
        stream = w.pick("stream") if w.rng.random() < 0.5 else None
        if stream is not None and stream.context is not fn.context:
            stream = None
        w.objects["run"].append(fn.prepare(["float*", "int", "float"], 1, 32, stream=stream))


def op_copy(w: World) -> None:
    buf = w.pick("buf") or w.pick("managed")
    if buf is None:
        return
    src = np.arange(N, dtype=np.float32) * w.rng.random()
    back = np.zeros_like(src)
    mem.copy(buf, src)
    mem.copy(back, buf)
    if not np.array_equal(back, src):
        raise Failure("copy round trip returned other data")


def op_copy_from_new_thread(w: World) -> None:
    """A thread that never set anything up copies a buffer made elsewhere."""
    buf = w.pick("buf")
    if buf is None:
        return
    src = np.arange(N, dtype=np.float32)
    back = np.zeros_like(src)
    box: list[BaseException] = []

    def run() -> None:
        try:
            mem.copy(buf, src)
            mem.copy(back, buf)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if box:
        raise box[0]
    if not np.array_equal(back, src):
        raise Failure("copy from a new thread returned other data")


def op_memset(w: World) -> None:
    buf = w.pick("buf")
    if buf is not None:
        stream = w.pick("stream")
        if stream is not None and stream.context is buf.context and w.rng.random() < 0.5:
            mem.memset(buf, 7, stream=stream)
        else:
            mem.memset(buf, 7)


def op_launch(w: World) -> None:
    run, buf = w.pick("run"), w.pick("buf")
    if run is not None and buf is not None:
        run(buf, N, 1.5)
    fn = w.pick("fn")
    if fn is not None and buf is not None:
        fn.launch(1, 32, (buf, np.int32(N), np.float32(2.0)))


def op_sync(w: World) -> None:
    stream, event = w.pick("stream"), w.pick("event")
    if stream is not None:
        stream.synchronize()
        if event is not None and event.context is stream.context:
            event.record(stream)
            event.synchronize()
    elif event is not None:
        event.query()


def op_view(w: World) -> None:
    view = w.pick("view")
    if view is not None:
        view[:] = 3.0
        if float(view.sum()) != 3.0 * view.size:
            raise Failure("pinned view lost its data")
    p, buf = w.pick("pinned"), w.pick("buf")
    if p is not None and buf is not None:
        mem.copy(buf, p)                     # pinned -> device -> pinned
        mem.copy(p, buf)


def op_close(w: World) -> None:
    kinds = [k for k in ("buf", "pinned", "managed", "stream", "event", "module") if w.objects[k]]
    if kinds:
        w.pick(w.rng.choice(kinds)).close()


def op_drop(w: World) -> None:
    kinds = [k for k, v in w.objects.items() if v]
    if kinds:
        items = w.objects[w.rng.choice(kinds)]
        items.pop(w.rng.randrange(len(items)))


def op_free_async(w: World) -> None:
    buf, stream = w.pick("buf"), w.pick("stream")
    if buf is not None:
        buf.free_async(stream if stream is not None and stream.context is buf.context else None)


OPS: list[tuple[Callable[[World], None], float]] = [
    (op_ctx_create, 2), (op_ctx_destroy, 1), (op_retain, 2), (op_release, 1.5), (op_alloc, 4),
    (op_alloc_async, 3), (op_pinned, 2), (op_managed, 1), (op_stream, 3), (op_event, 1.5), (op_module, 2),
    (op_function, 3), (op_prepare, 3), (op_copy, 4), (op_copy_from_new_thread, 1), (op_memset, 2),
    (op_launch, 4), (op_sync, 2), (op_view, 2), (op_close, 4), (op_drop, 4), (op_free_async, 1.5),
]
_FUNCS, _WEIGHTS = zip(*OPS)


def run_ops(w: World, count: int, seed_label: str, failures: list[str], counts: dict[str, int]) -> None:
    for _ in range(count):
        op = w.rng.choices(_FUNCS, _WEIGHTS)[0]
        try:
            op(w)
            counts["ok"] = counts.get("ok", 0) + 1
        except EXPECTED:
            counts["refused"] = counts.get("refused", 0) + 1
        except Exception:  # noqa: BLE001 - everything else is a finding
            failures.append(f"{seed_label} {op.__name__}: {traceback.format_exc(limit=6)}")


# ----------------------------------------------------------------------------- fork

def fork_check(w: World, failures: list[str], seed_label: str) -> None:
    """In a forked child every object refuses with ForkedProcessError (exit 0), nothing reaches the driver."""
    targets = [o for k in ("buf", "stream", "run", "fn", "module") for o in w.objects[k]]
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            for t in targets:
                try:
                    if callable(t) and not isinstance(t, (DeviceBuffer, Stream)):
                        t(0, N, 1.0)
                    elif isinstance(t, DeviceBuffer):
                        mem.copy(np.zeros(N, np.float32), t)
                    elif isinstance(t, Stream):
                        t.synchronize()
                    else:
                        t.check("probe")
                    code = 3
                except ForkedProcessError:
                    pass
                except ClosedResourceError:
                    pass           # ended before the fork: refused for that reason first
            try:
                cuproc.driver.default_driver().checked.cuCtxGetCurrent(cuproc.ffi.new("CUcontext *"))
                code = 4
            except ForkedProcessError:
                pass
        except BaseException:  # noqa: BLE001
            code = 5
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        failures.append(f"{seed_label} fork: child exited {os.waitstatus_to_exitcode(status)}")


# ----------------------------------------------------------------------------- one sequence

def sequence(seed: int, ops: int, threads: int, image: bytes, forks: bool, resets: bool,
             failures: list[str], counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    primary = cuproc.Device(0).primary_context()
    worlds = [World(random.Random(rng.random()), image, primary, keep=1 if threads > 1 else 0)
              for _ in range(threads)]
    for w in worlds:            # each thread starts with one retain it owns, like use_device
        op_retain(w)
    label = f"seed={seed}"
    if threads == 1:
        w = worlds[0]
        for step in range(ops):
            run_ops(w, 1, f"{label} step={step}", failures, counts)
            if forks and rng.random() < 0.02:
                fork_check(w, failures, label)
                counts["forks"] = counts.get("forks", 0) + 1
            if resets and rng.random() < 0.01:
                try:
                    primary.reset()
                    counts["resets"] = counts.get("resets", 0) + 1
                except BufferError:
                    counts["refused"] = counts.get("refused", 0) + 1
    else:
        pool = [threading.Thread(target=run_ops, args=(w, ops, f"{label} thread={i}", failures, counts))
                for i, w in enumerate(worlds)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    for w in worlds:             # what a user does at the end: drop everything, release what they retained
        for items in w.objects.values():
            items.clear()
    gc.collect()
    for w in worlds:
        for _ in range(w.retains):
            primary.release()
        w.retains = 0
    del worlds, w
    gc.collect()


# ----------------------------------------------------------------------------- checkers

class FakeChecker:
    """What the fake driver says is left behind (its counters are independent of cuproc)."""

    KINDS = ("context", "primary", "device_alloc", "host_alloc", "managed_alloc", "registered", "async_alloc",
             "stream", "event", "module", "library", "link", "pool")

    def __init__(self, path: str) -> None:
        import ctypes
        self.lib = ctypes.CDLL(path)
        self.lib.fake_stale_calls.argtypes = [ctypes.c_char_p, ctypes.c_int]
        self.lib.fake_live.argtypes = [ctypes.c_char_p]

    def stale(self) -> int:
        return self.lib.fake_stale_count()

    def stale_calls(self) -> str:
        import ctypes
        buf = ctypes.create_string_buffer(4096)
        self.lib.fake_stale_calls(buf, 4096)
        return buf.value.decode()

    def leftovers(self) -> dict[str, int]:
        left = {k: self.lib.fake_live(k.encode()) for k in self.KINDS}
        left["pool_used"] = self.lib.fake_pool_used(0)
        left["primary_refcount"] = self.lib.fake_primary_refcount(0)
        return {k: v for k, v in left.items() if v}


class GpuChecker:
    """The GPU's own account: free memory and the primary context's state, read without cuproc objects."""

    def __init__(self) -> None:
        drv = cuproc.driver.default_driver()
        drv.checked.cuInit(0)
        self.drv = drv
        self.free0 = self.free()
        self.one_time = 0

    def rebase(self) -> None:
        """Measure free memory from here on.  The driver keeps some memory for itself once it has
        seen enough (about 126 MiB once on an H100 after ~40 sequences, with no cuproc object
        alive and no growth after): a leak shows as growth after this point, not as that step."""
        now = self.free()
        self.one_time = self.free0 - now
        self.free0 = now

    def free(self) -> int:
        drv, out, ctx = self.drv, cuproc.ffi.new("CUcontext *"), cuproc.ffi.new("CUcontext *")
        free, total = cuproc.ffi.new("size_t *"), cuproc.ffi.new("size_t *")
        drv.checked.cuDevicePrimaryCtxRetain(ctx, 0)
        drv.checked.cuCtxPushCurrent(ctx[0])
        pool = cuproc.ffi.new("CUmemoryPool *")
        drv.checked.cuDeviceGetDefaultMemPool(pool, 0)
        drv.checked.cuCtxSynchronize(ctx[0]) if len(cuproc.ffi.typeof(
            drv.resolution("cuCtxSynchronize").typedef).args) == 1 else drv.checked.cuCtxSynchronize()
        drv.checked.cuMemPoolTrimTo(pool[0], 0)
        drv.checked.cuMemGetInfo(free, total)
        drv.checked.cuCtxPopCurrent(out)
        drv.checked.cuDevicePrimaryCtxRelease(0)
        return free[0]

    def primary_active(self) -> bool:
        flags, active = cuproc.ffi.new("unsigned int *"), cuproc.ffi.new("int *")
        self.drv.checked.cuDevicePrimaryCtxGetState(0, flags, active)
        return bool(active[0])

    def pool_used(self) -> int:
        drv, pool = self.drv, cuproc.ffi.new("CUmemoryPool *")
        used = cuproc.ffi.new("cuuint64_t *")
        drv.checked.cuDeviceGetDefaultMemPool(pool, 0)
        drv.checked.cuMemPoolGetAttribute(pool[0], drv.CU_MEMPOOL_ATTR_USED_MEM_CURRENT, used)
        return int(used[0])

    def leftovers(self) -> dict[str, int]:
        left = {}
        if self.primary_active():
            left["primary_active"] = 1
        if self.pool_used():
            left["pool_used"] = self.pool_used()
        lost = self.free0 - self.free()
        if lost > (4 << 20):
            left["device_bytes_lost"] = lost
        return left


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=100)
    ap.add_argument("--ops", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fake", help="the fake driver library (else the real driver)")
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args(argv)
    if args.fake:
        sys.path.insert(0, str(ROOT / "tests"))
        from fakedriver import fake_image
        cuproc.set_default_driver(cuproc.Driver(library=args.fake))
        checker: Any = FakeChecker(args.fake)
        image = fake_image({"empty": [8, 4, 4]})
    else:
        checker = GpuChecker()
        image = (ROOT / "kernels" / "kernels.cubin").read_bytes()
    failures: list[str] = []
    counts: dict[str, int] = {"sequences": 0, "threaded": 0}
    leftovers: list[str] = []
    for i in range(args.sequences):
        if i == args.sequences // 2 and isinstance(checker, GpuChecker):
            checker.rebase()
        seed = args.seed * 1_000_003 + i
        threads = args.threads if i % 2 else 1
        sequence(seed, args.ops, threads, image, forks=hasattr(os, "fork"), resets=True, failures=failures,
                 counts=counts)
        counts["sequences"] += 1
        counts["threaded"] += threads > 1
        left = checker.leftovers()
        if isinstance(checker, GpuChecker) and i < args.sequences // 2:
            left.pop("device_bytes_lost", None)      # judged from the rebase on (see GpuChecker.rebase)
        if left:
            alive: dict[str, int] = {}
            for obj in gc.get_objects():
                if type(obj).__module__.startswith("cuproc."):
                    alive[type(obj).__name__] = alive.get(type(obj).__name__, 0) + 1
            leftovers.append(f"seed={seed}: {left}; cuproc objects alive: {alive}")
            if args.fake:
                checker.lib.fake_reset()
        if len(failures) > 20:
            break
    result = {"counts": counts, "failures": failures[:20], "leftovers": leftovers[:20]}
    if isinstance(checker, GpuChecker):
        result["driver_kept_mib_first_half"] = checker.one_time / 2**20
    if args.fake:
        result["stale"] = checker.stale()
        result["stale_calls"] = checker.stale_calls()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
