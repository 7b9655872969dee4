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

N = 256                                  # elements per buffer (float32)


class Failure(Exception):
    pass


# ----------------------------------------------------------------------------- the model
#
# Every object a sequence makes has a Node: its kind, the nodes it cannot be used without (the
# resource model's parents: a buffer its context, a function its module, a prepared launch its
# function and stream) and whether it was ended explicitly (close, free_async, destroy, the last
# release or a reset of its context).  The model says, before each operation, whether cuproc must
# refuse it (some object involved, or a parent of one, has ended: ClosedResourceError) or carry it
# out; run_ops compares that with what happened.  So a live object refused ("was freed") is a
# failure, as is a dead one used, not only a crash: the random sequences check identity, which the
# driver's reuse of handles and addresses can confuse.

class Node:
    __slots__ = ("kind", "parents", "ended", "stream", "launches_on")

    def __init__(self, kind: str, *parents: "Node | None", stream: "Node | None" = None) -> None:
        self.kind = kind
        self.parents = tuple(p for p in parents if p is not None)
        self.ended = False
        self.stream = stream       # a stream-ordered buffer's stream: not a parent, where free_async() frees
        self.launches_on: Any = None   # a prepared launch's (Stream or None for the default one, context)

    def dead(self) -> bool:
        return self.ended or any(p.dead() for p in self.parents)

    def under(self, ctx: "Node") -> bool:
        return any(p is ctx or p.under(ctx) for p in self.parents)


class Model:
    """What a sequence's objects should be: shared by its worlds (the primary context is)."""

    def __init__(self, held: int = 0) -> None:
        self.lock = threading.Lock()
        self.nodes: list[Node] = []
        self.retains = held              # cuproc's retains of the primary context: all worlds', and held ones
        self.primary: Node | None = Node("primary") if held else None   # its current activation

    def node(self, kind: str, *parents: Node | None, stream: Node | None = None) -> Node:
        n = Node(kind, *parents, stream=stream)
        with self.lock:
            self.nodes.append(n)
        return n

    def end_context(self, ctx: Node) -> None:
        """A context went (destroyed, last release, reset): it ends, and so does its stream-ordered
        memory, which cuproc frees first (the buffers end as freed, explicitly)."""
        ctx.ended = True
        with self.lock:
            for n in self.nodes:
                if n.kind == "buf_async" and n.under(ctx):
                    n.ended = True

    def retained(self) -> None:
        with self.lock:
            self.retains += 1
            if self.retains == 1:
                self.primary = Node("primary")
                self.nodes.append(self.primary)

    def released(self) -> None:
        with self.lock:
            self.retains -= 1
            last = self.retains == 0
        if last and self.primary is not None:
            self.end_context(self.primary)
            self.primary = None

    def reset(self) -> None:
        """cuDevicePrimaryCtxReset: everything made in it ends, and its Context object with it (a new
        one stands for the context from then on)."""
        if self.primary is not None:
            self.end_context(self.primary)
            self.primary = Node("primary")
            with self.lock:
                self.nodes.append(self.primary)


class World:
    """One thread's objects, each with its model Node; parents are shared by reference like a user's
    code would."""

    def __init__(self, rng: random.Random, image: bytes, primary: Any, model: Model, keep: int = 0) -> None:
        self.rng, self.image, self.primary, self.model = rng, image, primary, model
        self.retains = 0
        # Retains this world never gives back during the sequence.  With several threads each keeps
        # one: destroying what another thread is using at that moment is a race in the program
        # (as in C), which cuproc does not promise to survive -- see the resource model's docstring.
        self.keep = keep
        self.objects: dict[str, list[tuple[Any, Node | None]]] = {k: [] for k in (
            "ctx", "buf", "pinned", "view", "managed", "stream", "event", "module", "fn", "run")}
        self.expect: bool | None = None    # the model's answer for the running operation: refused?
        self.involved: list[Node] = []     # what it involves (for the failure's message)
        self.quiet = False                 # an operation that never refuses (close is idempotent)

    def involves(self, *nodes: Node | None) -> None:
        """The operation about to run uses these objects: the model says whether it must be refused."""
        dead = any(n is not None and n.dead() for n in nodes)
        self.expect = dead if self.expect is None else (self.expect or dead)
        self.involved.extend(n for n in nodes if n is not None)

    def pick(self, kind: str) -> tuple[Any, Node | None]:
        items = self.objects[kind]
        return self.rng.choice(items) if items else (None, None)

    def contexts(self) -> list[tuple[Any, Node | None]]:
        found = list(self.objects["ctx"])
        if self.retains:
            found.append((self.primary.context, self.model.primary))
        return found

    def some_context(self) -> tuple[Any, Node | None]:
        found = self.contexts()
        return self.rng.choice(found) if found else (None, None)

    def add(self, kind: str, obj: Any, node: Node | None) -> None:
        self.objects[kind].append((obj, node))


# ----------------------------------------------------------------------------- operations

def op_ctx_create(w: World) -> None:
    ctx = Context.create(0)
    Context.pop()
    w.add("ctx", ctx, w.model.node("ctx"))


def op_ctx_destroy(w: World) -> None:
    ctx, node = w.pick("ctx")
    if ctx is not None:
        w.quiet = True                  # idempotent; refused only for views (BufferError)
        ctx.destroy()
        if not node.ended:
            w.model.end_context(node)


def op_retain(w: World) -> None:
    w.primary.retain()
    w.retains += 1
    w.model.retained()


def op_release(w: World) -> None:
    if w.retains > w.keep:
        w.retains -= 1        # counted first: a refused release (host views) is retried at the end
        try:
            w.primary.release()
        except BufferError:
            w.retains += 1
            raise
        w.model.released()


def op_alloc(w: World) -> None:
    ctx, node = w.some_context()
    if ctx is not None:
        w.involves(node)
        w.add("buf", DeviceBuffer(N * 4, context=ctx), w.model.node("buf", node))


def op_alloc_async(w: World) -> None:
    stream, snode = w.pick("stream")
    if stream is not None:
        w.involves(snode)
        w.add("buf", mem.alloc_async(N * 4, stream), w.model.node("buf_async", *snode.parents, stream=snode))
        return
    ctx, node = w.some_context()
    if ctx is not None:
        w.involves(node)
        w.add("buf", mem.alloc_async(N * 4, context=ctx), w.model.node("buf_async", node))


def op_pinned(w: World) -> None:
    ctx, node = w.some_context()
    if ctx is not None:
        w.involves(node)
        p = mem.PinnedBuffer(N * 4, context=ctx)
        pnode = w.model.node("pinned", node)
        w.add("pinned", p, pnode)
        if w.rng.random() < 0.5:
            w.add("view", p.numpy(np.float32), None)


def op_managed(w: World) -> None:
    ctx, node = w.some_context()
    if ctx is not None:
        w.involves(node)
        w.add("managed", mem.ManagedBuffer(N * 4, context=ctx), w.model.node("managed", node))


def op_stream(w: World) -> None:
    ctx, node = w.some_context()
    if ctx is not None:
        w.involves(node)
        w.add("stream", Stream(context=ctx, non_blocking=w.rng.random() < 0.5), w.model.node("stream", node))


def op_event(w: World) -> None:
    ctx, node = w.some_context()
    if ctx is not None:
        w.involves(node)
        w.add("event", Event(context=ctx, timing=False), w.model.node("event", node))


def op_module(w: World) -> None:
    ctx, node = w.some_context()
    if ctx is not None:
        w.involves(node)
        w.add("module", Module.load(w.image, context=ctx), w.model.node("module", node))


def op_function(w: World) -> None:
    m, node = w.pick("module")
    if m is not None:
        w.involves(node)
        w.add("fn", m.get_function("empty"), w.model.node("fn", node))


def op_prepare(w: World) -> None:
    fn, fnode = w.pick("fn")
    if fn is not None:
        stream, snode = w.pick("stream") if w.rng.random() < 0.5 else (None, None)
        if stream is not None and stream.context is not fn.context:
            stream, snode = None, None
        w.involves(fnode, snode)
        run = fn.prepare(["float*", "int", "float"], 1, 32, stream=stream)
        node = w.model.node("run", fnode, snode)
        node.launches_on = (stream, fn.context)
        w.add("run", run, node)


def _a_buffer(w: World) -> tuple[Any, Node | None]:
    buf, node = w.pick("buf")
    return (buf, node) if buf is not None else w.pick("managed")


def op_copy(w: World) -> None:
    buf, node = _a_buffer(w)
    if buf is None:
        return
    w.involves(node)
    src = np.arange(N, dtype=np.float32) * w.rng.random()
    back = np.zeros_like(src)
    mem.copy(buf, src)
    mem.copy(back, buf)
    if not np.array_equal(back, src):
        raise Failure("copy round trip returned other data")


def op_copy_from_new_thread(w: World) -> None:
    """A thread that never set anything up copies a buffer made elsewhere."""
    buf, node = w.pick("buf")
    if buf is None:
        return
    w.involves(node)
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
    buf, node = w.pick("buf")
    if buf is not None:
        stream, snode = w.pick("stream")
        if stream is not None and stream.context is buf.context and w.rng.random() < 0.5:
            w.involves(node, snode)
            mem.memset(buf, 7, stream=stream)
        else:
            w.involves(node)
            mem.memset(buf, 7)


def op_launch_prepared(w: World) -> None:
    (run, rnode), (buf, bnode) = w.pick("run"), w.pick("buf")
    # A kernel uses memory of its own context (another context's is not its to use: a program error)
    if run is not None and buf is not None and buf.context is rnode.launches_on[1]:
        w.involves(rnode, bnode)
        run(buf, N, 1.5)
        buf.last_stream = rnode.launches_on[0]   # the documented contract: a launch does not set it


def op_launch(w: World) -> None:
    (fn, fnode), (buf, bnode) = w.pick("fn"), w.pick("buf")
    if fn is not None and buf is not None and buf.context is fn.context:
        w.involves(fnode, bnode)
        fn.launch(1, 32, (buf, np.int32(N), np.float32(2.0)))
        buf.last_stream = None                # (the default stream), as the user must say


def op_sync(w: World) -> None:
    (stream, snode), (event, enode) = w.pick("stream"), w.pick("event")
    if stream is not None:
        if event is not None and event.context is stream.context and w.rng.random() < 0.5:
            w.involves(snode, enode)
            event.record(stream)
            event.synchronize()
        else:
            w.involves(snode)
            stream.synchronize()
    elif event is not None:
        w.involves(enode)
        event.query()


def op_view(w: World) -> None:
    view, _ = w.pick("view")
    if view is not None:
        view[:] = 3.0
        if float(view.sum()) != 3.0 * view.size:
            raise Failure("pinned view lost its data")
    (p, pnode), (buf, bnode) = w.pick("pinned"), w.pick("buf")
    if p is not None and buf is not None:
        w.involves(pnode, bnode)
        mem.copy(buf, p)                     # pinned -> device -> pinned
        mem.copy(p, buf)


def op_close(w: World) -> None:
    kinds = [k for k in ("buf", "pinned", "managed", "stream", "event", "module") if w.objects[k]]
    if kinds:
        obj, node = w.pick(w.rng.choice(kinds))
        w.quiet = True                       # idempotent, also under an ended parent
        obj.close()
        node.ended = True


def op_drop(w: World) -> None:
    kinds = [k for k, v in w.objects.items() if v]
    if kinds:
        items = w.objects[w.rng.choice(kinds)]
        items.pop(w.rng.randrange(len(items)))


def op_free_async(w: World) -> None:
    (buf, node), (stream, snode) = w.pick("buf"), w.pick("stream")
    if buf is None:
        return
    explicit = stream is not None and stream.context is buf.context
    if node.ended:
        w.quiet = True                       # freed already: nothing to do, nothing refused
    elif explicit:
        w.involves(node, snode)
    else:
        # free_async() frees on the buffer's own stream (a stream-ordered buffer's; else the default one)
        w.involves(node, node.stream)
    buf.free_async(stream if explicit else None)
    node.ended = True


def describe(nodes: list[Node]) -> str:
    """The nodes and their parents, as kind(+ended), for a failure's message."""
    def one(n: Node) -> str:
        inner = ", ".join(one(p) for p in n.parents)
        return f"{n.kind}{'+ended' if n.ended else ''}" + (f"[{inner}]" if inner else "")
    return "; ".join(one(n) for n in nodes)


OPS: list[tuple[Callable[[World], None], float]] = [
    (op_ctx_create, 2), (op_ctx_destroy, 1), (op_retain, 2), (op_release, 1.5), (op_alloc, 4),
    (op_alloc_async, 3), (op_pinned, 2), (op_managed, 1), (op_stream, 3), (op_event, 1.5), (op_module, 2),
    (op_function, 3), (op_prepare, 3), (op_copy, 4), (op_copy_from_new_thread, 1), (op_memset, 2),
    (op_launch_prepared, 2), (op_launch, 2), (op_sync, 2), (op_view, 2), (op_close, 4), (op_drop, 4),
    (op_free_async, 1.5),
]
_FUNCS, _WEIGHTS = zip(*OPS)
# The operations that NumPy views of pinned memory may refuse (BufferError): freeing that memory, destroying or
# releasing for the last time its context.  Anywhere else a BufferError is a finding.
VIEWS_REFUSE = frozenset({op_close, op_ctx_destroy, op_release})


def run_ops(w: World, count: int, seed_label: str, failures: list[str], counts: dict[str, int],
            log: list[str] | None = None) -> None:
    """Run ``count`` random operations, each checked against the model: refused (ClosedResourceError)
    exactly when it involves something ended.  BufferError (host memory with live views) is allowed
    wherever it can come, and changes nothing."""
    for _ in range(count):
        op = w.rng.choices(_FUNCS, _WEIGHTS)[0]
        w.expect, w.quiet, w.involved = None, False, []
        outcome = "ok"
        try:
            op(w)
        except ClosedResourceError:
            outcome = "refused"
            counts["refused"] = counts.get("refused", 0) + 1
            if not w.expect or w.quiet:
                failures.append(f"{seed_label} {op.__name__}: refused, but the model has every object it "
                                f"involves alive ({describe(w.involved)}): {traceback.format_exc(limit=6)}")
        except BufferError:
            outcome = "views"
            counts["views"] = counts.get("views", 0) + 1
            if op not in VIEWS_REFUSE:
                failures.append(f"{seed_label} {op.__name__}: BufferError where no view can refuse: "
                                f"{traceback.format_exc(limit=6)}")
        except Exception as exc:  # noqa: BLE001 - everything else is a finding
            outcome = type(exc).__name__
            failures.append(f"{seed_label} {op.__name__}: {traceback.format_exc(limit=6)}")
        else:
            counts["ok"] = counts.get("ok", 0) + 1
            if w.expect and not w.quiet:
                failures.append(f"{seed_label} {op.__name__}: carried out, but the model has an object it "
                                f"involves ended: {describe(w.involved)}")
        if log is not None:
            log.append(f"{op.__name__[3:]}:{outcome}")
        if TRACE:
            TRACE.append(f"{seed_label} {op.__name__[3:]}:{outcome} {describe(w.involved)}")
        if PROBE:
            probe(seed_label, op.__name__, outcome, failures)


# ----------------------------------------------------------------------------- the device-error probe
#
# --probe (GPU, with --warm-up: the primary context stays active): after every operation, synchronize
# the primary context through the raw driver; the first operation after which that fails (a device
# error such as CUDA_ERROR_LAUNCH_FAILED is sticky) is reported with the last operations of every thread.
PROBE: list[bool] = []
# --trace: every operation of the running sequence, all threads, in the order they ended (with a failure
# the checker meets after the sequence, the whole sequence is what to look at)
TRACE: list[str] = []
_recent: list[str] = []
_probe_lock = threading.Lock()


def probe(label: str, op: str, outcome: str, failures: list[str]) -> None:
    drv = cuproc.driver.default_driver()
    ffi = cuproc.ffi
    with _probe_lock:
        _recent.append(f"{label} {threading.current_thread().name} {op}:{outcome}")
        del _recent[:-40]
        if len(PROBE) > 1:
            return
        ctx = ffi.new("CUcontext *")
        if drv.cuDevicePrimaryCtxRetain(ctx, 0):
            return
        rc = drv.cuCtxSynchronize(ctx[0])
        drv.cuDevicePrimaryCtxRelease(0)
        if rc:
            PROBE.append(True)
            failures.append(f"{label} {op}: the primary context's synchronize failed with {rc} right after it; "
                            "the last operations, oldest first:\n  " + "\n  ".join(_recent))


# ----------------------------------------------------------------------------- fork

def fork_check(w: World, failures: list[str], seed_label: str) -> None:
    """In a forked child every object refuses with ForkedProcessError (exit 0), nothing reaches the driver."""
    targets = [o for k in ("buf", "stream", "run", "fn", "module") for o, _ in w.objects[k]]
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

def warm_up(stream_ordered: bool = True) -> None:
    """What a program does before the sequences (the GPU run that found issue 35's defect did this):
    use the device, allocate (stream-ordered: the pool's first address), release the last retain --
    the driver destroys the primary context -- and use the device again.  On a GPU the new activation
    has the old handle and the pool hands its first address out again."""
    pc = cuproc.use_device(0)
    s = Stream()
    b = mem.alloc_async(N * 4, s) if stream_ordered else DeviceBuffer(N * 4)
    mem.memset(b, 1)
    s.synchronize()
    pc.release()
    if b.ended is None:
        raise Failure("the warm-up's buffer outlived its context's last release")


def sequence(seed: int, ops: int, threads: int, image: bytes, forks: bool, resets: bool,
             failures: list[str], counts: dict[str, int], held: int = 0, log: list[str] | None = None) -> None:
    """One sequence.  ``log`` (single-threaded sequences only: their order is the seed's alone) gets each
    operation's outcome, which the pure and the compiled path must agree on."""
    rng = random.Random(seed)
    primary = cuproc.PrimaryContext(0)
    model = Model(held)
    worlds = [World(random.Random(rng.random()), image, primary, model, keep=1 if threads > 1 else 0)
              for _ in range(threads)]
    for w in worlds:            # each thread starts with one retain it owns, like use_device
        op_retain(w)
    label = f"seed={seed}"
    if threads == 1:
        w = worlds[0]
        for step in range(ops):
            run_ops(w, 1, f"{label} step={step}", failures, counts, log)
            if forks and rng.random() < 0.02:
                fork_check(w, failures, label)
                counts["forks"] = counts.get("forks", 0) + 1
            if resets and rng.random() < 0.01:
                try:
                    primary.reset()
                    model.reset()
                    counts["resets"] = counts.get("resets", 0) + 1
                    outcome = "reset:ok"
                except BufferError:
                    counts["views"] = counts.get("views", 0) + 1
                    outcome = "reset:views"
                if log is not None:
                    log.append(outcome)
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
        self.lib.fake_live.argtypes = [ctypes.c_char_p]
        self.lib.fake_unordered_frees.restype = ctypes.c_long
        self.lib.fake_misrouted_count.restype = ctypes.c_long
        self.held = 0               # retains the run holds throughout (--warm-up)

    def stale(self) -> int:
        return self.lib.fake_stale_count()

    def unordered(self) -> int:
        """Stream-ordered frees not ordered after work queued on the memory on another stream (on a GPU the
        pool may hand the memory out, or release it, while that work runs: a device fault)."""
        return self.lib.fake_unordered_frees()

    def misrouted(self) -> int:
        """Work on one context's memory run in another, current context (on a GPU it is not ordered with
        the memory's own context: a free there may run first, a device fault)."""
        return self.lib.fake_misrouted_count()

    def calls(self, record: str) -> str:
        """The last calls a record of the fake names ("stale", "unordered", "binding", "misrouted"),
        comma-separated."""
        import ctypes
        buf = ctypes.create_string_buffer(4096)
        getattr(self.lib, f"fake_{record}_calls")(buf, 4096)
        return buf.value.decode()

    def leftovers(self) -> dict[str, int]:
        left = {k: self.lib.fake_live(k.encode()) for k in self.KINDS}
        left["pool_used"] = self.lib.fake_pool_used(0)
        left["primary_refcount"] = self.lib.fake_primary_refcount(0) - self.held
        if self.held:
            left["primary"] -= 1
        return {k: v for k, v in left.items() if v}


class GpuChecker:
    """The GPU's own account: free memory and the primary context's state, read without cuproc objects."""

    def __init__(self) -> None:
        drv = cuproc.driver.default_driver()
        drv.checked.cuInit(0)
        self.drv = drv
        self.free0 = self.free()
        self.one_time = 0
        self.held = 0               # retains the run holds throughout (--warm-up): the context stays active

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
        if self.primary_active() != bool(self.held):
            left["primary_active"] = int(self.primary_active())
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
    ap.add_argument("--warm-up", action="store_true",
                    help="first use the device, release its last retain, and hold a new retain while the "
                         "sequences run (each sequence then starts in a re-retained primary context)")
    ap.add_argument("--probe", action="store_true",
                    help="(GPU, with --warm-up) synchronize the primary context after every operation and report "
                         "the first one after which that fails")
    ap.add_argument("--start", type=int, default=0, help="the first sequence's index (its seed follows)")
    ap.add_argument("--trace", action="store_true",
                    help="with a failure the checker meets, report every operation of that sequence")
    ap.add_argument("--outcomes", help="write each single-threaded sequence's operation outcomes here (JSON)")
    args = ap.parse_args(argv)
    if args.fake:
        sys.path.insert(0, str(ROOT / "tests"))
        from fakedriver import fake_image
        cuproc.set_default_driver(cuproc.Driver(library=args.fake))
        checker: Any = FakeChecker(args.fake)
        image = fake_image({"empty": [8, 4, 4]})
    else:
        checker = GpuChecker()
        image = (ROOT / "kernels" / "kernels.fatbin").read_bytes()
    failures: list[str] = []
    counts: dict[str, int] = {"sequences": 0, "threaded": 0}
    leftovers: list[str] = []
    outcomes: dict[str, str] = {}           # seed -> each operation's outcome (single-threaded sequences)
    reported = unordered = misrouted = 0
    if args.probe:
        PROBE.append(True)
    held = None
    if args.warm_up:
        warm_up()
        held = cuproc.use_device(0)
        checker.held = held.retain_count
    if args.trace:
        TRACE.append("(trace)")
    for i in range(args.start, args.start + args.sequences):
        if i == args.start + args.sequences // 2 and isinstance(checker, GpuChecker):
            checker.rebase()
        seed = args.seed * 1_000_003 + i
        threads = args.threads if i % 2 else 1
        log: list[str] | None = [] if threads == 1 else None
        sequence(seed, args.ops, threads, image, forks=hasattr(os, "fork"), resets=True, failures=failures,
                 counts=counts, held=held.retain_count if held is not None else 0, log=log)
        if log is not None:
            outcomes[str(seed)] = " ".join(log)
        counts["sequences"] += 1
        counts["threaded"] += threads > 1
        if isinstance(checker, FakeChecker) and checker.unordered() > unordered:
            failures.append(f"seed={seed}: {checker.unordered() - unordered} stream-ordered free(s) not ordered "
                            f"after work queued on the memory on another stream")
            unordered = checker.unordered()
        if isinstance(checker, FakeChecker) and checker.misrouted() > misrouted:
            failures.append(f"seed={seed}: {checker.misrouted() - misrouted} operation(s) on a context's memory ran "
                            f"in another, current context: {checker.calls('misrouted')}")
            misrouted = checker.misrouted()
        try:
            left = checker.leftovers()
        except Exception:  # noqa: BLE001 - the driver's own check failed (a device error): stop here
            failures.append(f"seed={seed} checker: {traceback.format_exc(limit=4)}" + (
                "\n  the sequence's operations:\n  " + "\n  ".join(TRACE[1:]) if TRACE else ""))
            break
        del TRACE[1:]
        if isinstance(checker, GpuChecker) and i < args.start + args.sequences // 2:
            left.pop("device_bytes_lost", None)      # judged from the rebase on (see GpuChecker.rebase)
        if left:
            alive: dict[str, int] = {}
            for obj in gc.get_objects():
                if type(obj).__module__.startswith("cuproc."):
                    alive[type(obj).__name__] = alive.get(type(obj).__name__, 0) + 1
            leftovers.append(f"seed={seed}: {left}; cuproc objects alive: {alive}")
            if held is not None:
                break              # a reset would take the held retain with it: everything after would fail
            if args.fake:
                checker.lib.fake_reset()
                unordered = misrouted = 0
        for failure in failures[reported:]:      # as they come: a crash later loses nothing
            print(failure, file=sys.stderr, flush=True)
        reported = len(failures)
        if len(failures) > 20:
            break
    result: dict[str, Any] = {"counts": counts, "failures": failures[:20], "leftovers": leftovers[:20]}
    if args.outcomes:
        Path(args.outcomes).write_text(json.dumps(outcomes))
    if isinstance(checker, GpuChecker):
        result["driver_kept_mib_first_half"] = checker.one_time / 2**20
    if args.fake:
        result["stale"] = checker.stale()
        result["unordered"] = checker.unordered()
        result["misrouted"] = checker.misrouted()
        result["binding"] = checker.lib.fake_binding_errors()
        for record in ("stale", "unordered", "binding", "misrouted"):
            result[f"{record}_calls"] = checker.calls(record)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
