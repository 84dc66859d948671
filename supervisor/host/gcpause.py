"""Pause Python's cyclic garbage collector around work that builds large acyclic object graphs.

A full collection rescans every tracked object while holding the GIL (0.2-0.35 s in a process that imported
torch; figures and what the pause costs: docs/performance-scale.md, 'Loads' ("The collector") and 'The loop').
Cycles made meanwhile are collected once it is back. A child forked while another thread holds the pause gets
the collector back (that thread does not exist there).
"""
from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections import Counter
from collections.abc import Iterator

__all__ = ["collector_paused"]

_lock = threading.Lock()
# Callers that asked for the collector to pause and have not finished, by thread: a child forked while
# another thread holds a pause has no such thread, and must not keep the collector off for good.
_holds: Counter[int] = Counter()
_was_on = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector is off inside; back on when the last overlapping caller leaves, unless the
    program had turned it off itself."""
    global _was_on
    me = threading.get_ident()
    with _lock:
        if not _holds:
            _was_on = gc.isenabled()
            gc.disable()
        _holds[me] += 1
    try:
        yield
    finally:
        with _lock:
            _holds[me] -= 1
            if not _holds[me]:
                del _holds[me]
            if not _holds and _was_on:
                gc.enable()


def _after_fork_in_child() -> None:
    """Only the forking thread lives on in the child: keep its own pauses (it leaves them as usual), drop the
    rest, and give the collector back if none is left."""
    global _holds
    _lock.release()  # taken before the fork (below); the forking thread, the child's only one, gives it back
    mine = _holds.get(threading.get_ident(), 0)
    _holds = Counter({threading.get_ident(): mine}) if mine else Counter()
    if not _holds and _was_on:
        gc.enable()


if hasattr(os, "register_at_fork"):
    # The lock is held across the fork, so the child sees whole updates of `_holds` and `_was_on`.
    os.register_at_fork(before=_lock.acquire, after_in_parent=_lock.release, after_in_child=_after_fork_in_child)
