"""Pause Python's cyclic garbage collector around work that builds large acyclic object graphs.

A full collection rescans every tracked object while holding the GIL: in a process that imported torch
(~300k objects) one takes 0.2-0.35 s on 2 cores. Measured here, one struck during a checkpoint parse
(202 collections in a 70B x 64 `.metadata` parse, the longest 90 ms; 395 ms at 70B x 256), and one in
about one cold 1.2 GB load in three (0.22 s and 0.34 s of a 0.7 s load). Reference counting still frees
everything while the collector waits; cycles made meanwhile are collected once it is back.
Figures: docs/performance-scale.md.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["collector_paused"]

_lock = threading.Lock()
_holds = 0  # callers (in any thread) that asked for the collector to pause and have not finished
_was_on = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector is off inside; back on when the last overlapping caller leaves, unless the
    program had turned it off itself."""
    global _holds, _was_on
    with _lock:
        if _holds == 0:
            _was_on = gc.isenabled()
            gc.disable()
        _holds += 1
    try:
        yield
    finally:
        with _lock:
            _holds -= 1
            if _holds == 0 and _was_on:
                gc.enable()
