"""Primary-context lifetimes across threads (issue 35, review items 2 and 6), on the fake driver.

* A PrimaryRetains whose finalizer is giving its retains back (the GIL is free while the driver
  releases: 56-89 ms on a GPU) is never handed to another thread through the weak table: its
  finalizer would not run again, and a retain taken through it would never be given back.
* Leaving a ``with pc:`` block never fails because of host views the block may not have made: the
  block's retain is kept by the context for its objects and given back once they are gone.
"""
from __future__ import annotations

import gc
import threading

import pytest

import cuproc
from cuproc import memory as mem


@pytest.fixture()
def held_release(fk):
    """The default driver, whose cuDevicePrimaryCtxRelease, before it runs, says it started and waits (the
    GIL free, as in the real call) until told to go on: the window another thread may use."""
    drv = cuproc.Driver(library=str(fk.path))
    real = drv.cuDevicePrimaryCtxRelease
    started, go_on = threading.Event(), threading.Event()

    def held(device: int) -> int:
        started.set()
        go_on.wait(10)
        return real(device)

    drv.cuDevicePrimaryCtxRelease = held
    cuproc.set_default_driver(drv)
    yield fk, started, go_on
    go_on.set()
    cuproc.set_default_driver(cuproc.Driver(library=str(fk.path)))


def test_a_retain_taken_while_another_thread_finalizes_the_retains_is_given_back(held_release):
    """Thread A drops the last holder of the retains, and its safety net is inside the driver's release when
    thread B uses the device: B must get retains of its own, which go when B drops them."""
    fk, started, go_on = held_release
    pc = cuproc.use_device(0)
    cuproc.driver.default_driver().cuCtxSetCurrent(cuproc.ffi.NULL)
    assert fk.primary_refcount(0) == 1
    errors: list[BaseException] = []

    def drop() -> None:          # the last reference: the safety net releases, held, on this thread
        nonlocal pc
        try:
            del pc
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def use_and_drop() -> None:  # in the window: the device again, dropped to the safety net
        try:
            assert started.wait(10), "the dropped retains were not being released"
            other = cuproc.use_device(0)
            counts = (other.retain_count, fk.primary_refcount(0))
            go_on.set()
            cuproc.driver.default_driver().cuCtxSetCurrent(cuproc.ffi.NULL)
            del other
            assert counts == (1, 2), counts
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=drop), threading.Thread(target=use_and_drop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    gc.collect()
    assert not errors, errors
    assert fk.primary_refcount(0) == 0 and not fk.primary_active(0)


def test_leaving_a_with_block_never_fails_for_views_it_did_not_make(pc, fk):
    pinned = mem.PinnedBuffer(64)
    view = pinned.numpy()
    with cuproc.PrimaryContext(0) as ctx:
        pc.release()             # the view's maker gives its retain back: the block's is the last
    assert fk.primary_active(0) and fk.primary_refcount(0) == 1   # kept for the view
    assert pc.retain_count == 0
    view[:] = 5                  # the memory lives
    assert ctx.alive and pinned.ended is None
    with pytest.raises(BufferError):
        pinned.close()           # the views still refuse what would pull the memory away
    del view
    gc.collect()
    pc.retain()                  # takes the kept retain over: no driver call
    assert fk.primary_refcount(0) == 1 and pc.retain_count == 1
    pc.release()
    assert fk.primary_refcount(0) == 0 and pinned.closed


def test_a_kept_retain_is_given_back_by_the_next_release_once_the_views_are_gone(pc, fk):
    pinned = mem.PinnedBuffer(64)
    view = pinned.numpy()
    with pc.retained():
        pc.release()
    assert fk.primary_refcount(0) == 1 and pc.retain_count == 0
    pc.retain()                  # the kept one, taken over
    pc.retain()                  # a new one
    assert fk.primary_refcount(0) == 2
    del view
    gc.collect()
    pc.release()
    pc.release()
    assert fk.primary_refcount(0) == 0 and not fk.primary_active(0) and pinned.closed


def test_a_kept_retain_goes_with_the_last_object_of_the_context(fk):
    pc = cuproc.use_device(0)
    pinned = mem.PinnedBuffer(64)
    view = pinned.numpy()
    with pc:
        pc.release()
    cuproc.driver.default_driver().cuCtxSetCurrent(cuproc.ffi.NULL)
    assert fk.primary_refcount(0) == 1
    del view, pinned, pc
    gc.collect()
    assert fk.primary_refcount(0) == 0 and not fk.primary_active(0)


def test_an_explicit_release_is_still_refused_while_views_live(pc, fk):
    view = mem.PinnedBuffer(64).numpy()
    with pytest.raises(BufferError):
        pc.release()
    assert pc.retain_count == 1 and fk.primary_refcount(0) == 1
    del view
