"""How kiln's own processes run Python's cyclic garbage collector (KILN_GC_THRESHOLD).

CPython looks for reference cycles among the container objects (lists, dicts, class
instances, coroutines) it tracks: the youngest generation after every 700 allocations net
of frees, the middle one every 10th time, and now and then all of them, every object the
process holds. A ``kiln serve`` or ``kiln worker`` that has imported its web framework,
validation library and drivers holds hundreds of thousands of such objects that live as
long as the process, and each full pass traverses them again; every task makes dozens of
short-lived ones (its coroutines, futures, rows, events), so the passes come often.

Once a process has started, :func:`settle_heap` collects what startup left behind, moves
every object still alive into the permanent generation (``gc.freeze``: never traversed
again) and collects the youngest generation after ``KILN_GC_THRESHOLD`` allocations
instead of 700: the same cycles are found, in fewer passes over fewer objects. A threshold
of 0 leaves the collector as Python sets it.
"""

from __future__ import annotations

import gc


def settle_heap(threshold: int) -> None:
    """Freeze what startup made and collect the young generation every ``threshold``
    allocations (0: leave the collector as it is)."""
    if threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(threshold, middle, oldest)
