"""The garbage collector, tuned for trajstore's allocation-heavy loops.

CPython collects its youngest objects every 700 allocations, and each collection walks every
young object still alive, garbage or not. The proxy keeps the state of hundreds of requests
alive and makes a dict for every JSON object it parses; the projector holds a batch's rows and
events while it folds them. Both were walking the same live objects hundreds of times a second:
the proxy's p99 and a fifth of the projector's time. The proxy collects rarely and freezes what
it starts with (`fewer_collections`); the projector does not collect at all while a batch is
alive (`collections_paused`). Measured figures in docs/performance.md.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

#: Allocations between two young collections inside `fewer_collections` (CPython's default: 700).
YOUNG_COLLECTION_EVERY = 10_000

_depth = 0
_saved = gc.get_threshold()


@contextlib.contextmanager
def fewer_collections(*, freeze: bool = False) -> Iterator[None]:
    """Collect young objects every `YOUNG_COLLECTION_EVERY` allocations while inside.

    With `freeze`, everything alive on entry (modules, an app, pools) is also moved out of the
    collector's sight until exit: for a server, whose full collections otherwise walk all of it
    and stop every request in flight. The threshold nests, across tasks too: the first entry
    sets it, the last exit restores it. A freeze does not: its exit unfreezes everything, also
    what an enclosing `freeze=True` froze (one server per process needs no more).
    """
    global _depth, _saved
    if _depth == 0:
        _saved = gc.get_threshold()
        gc.set_threshold(YOUNG_COLLECTION_EVERY, *_saved[1:])
    _depth += 1
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
        _depth -= 1
        if _depth == 0:
            gc.set_threshold(*_saved)


_pauses = 0
_was_enabled = True


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """No cyclic collection at all while inside: for a bounded burst of allocations that all stay
    alive until it ends (a projector batch: its rows, sessions, samples and row tuples), which
    even rarer young collections walk again and again for nothing. Reference counting still
    frees what is acyclic at once; cycles wait for the first collection after the last exit.
    Nests, across tasks too: the first entry disables, the last exit restores the state found.
    """
    global _pauses, _was_enabled
    if _pauses == 0:
        _was_enabled = gc.isenabled()
        gc.disable()
    _pauses += 1
    try:
        yield
    finally:
        _pauses -= 1
        if _pauses == 0 and _was_enabled:
            gc.enable()
