"""Running test steps on fresh threads (ones that never set up any CUDA state).

``in_thread`` runs one step and hands back what happened; ``run_threads`` runs several at once and
raises what went wrong, so that a test's "no thread failed" is the call itself.
"""
from __future__ import annotations

import threading
from typing import Any, Callable


def _started(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """A started thread running ``fn`` and the box it fills: {"value": result} or {"error": exception}."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, box


def in_thread(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` on a new thread; {"value": result} or {"error": exception}."""
    t, box = _started(fn)
    t.join()
    return box


def run_threads(fn: Callable[[int], Any], count: int) -> list[Any]:
    """Run ``fn(0)``, ..., ``fn(count - 1)`` at once, each on a new thread, and wait for all of them.

    Returns their results in that order.  If any raised, raises the first one's exception (by
    thread index) once all have ended, noting how many failed: an exception on a plain thread would
    only be printed, and the test would go on as if nothing happened."""
    started = [_started(lambda k=k: fn(k)) for k in range(count)]
    for t, _ in started:
        t.join()
    errors = [box["error"] for _, box in started if "error" in box]
    if errors:
        note = getattr(errors[0], "add_note", None)   # Python 3.11+
        if note is not None:
            note(f"run_threads: {len(errors)} of {count} threads raised; this is the first")
        raise errors[0]
    return [box["value"] for _, box in started]
