"""Running a test step on a fresh thread (one that never set up any CUDA state)."""
from __future__ import annotations

import threading
from typing import Any, Callable


def in_thread(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` on a new thread; {"value": result} or {"error": exception}."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return box
