"""The cyclic garbage collector, paused where a pass makes many small containers and no
reference cycles: its collections, triggered by those allocations, walk every live
container again and again for nothing (reference counting still frees everything at once;
a cycle made meanwhile waits for the next collection)."""
from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def collector_paused():
    """Nested or on several threads, the collector runs again once the outermost pause that
    found it running ends."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
