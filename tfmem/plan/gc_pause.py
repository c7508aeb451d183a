"""GC pause: planning a large graph with Python's cyclic collector held off.

Planning allocates a few objects per op and frees none of them until it is
done; the cyclic collector would scan them all again every few hundred
allocations (a third of the time of planning a 100k-op graph).  Both front
ends plan inside `gc_paused()`.
"""

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    """Disable the cyclic collector for the block; re-enable it after, if it was on."""
    if not gc.isenabled():  # already off (the caller's choice, or an outer pause)
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
