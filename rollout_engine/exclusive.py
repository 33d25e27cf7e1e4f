"""One public call at a time: the synchronous Engine (and EnginePool) serves one thread, and refuses a second at
once rather than letting two calls interleave their steps (one would lose the other's requests)."""
from __future__ import annotations

import contextlib
import functools

from .errors import EngineBusyError


def exclusive(method):
    """One public call at a time: a call made while another runs (another thread) raises EngineBusyError
    at once and changes nothing."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        cls = type(self).__name__
        if not self._lock.acquire(blocking=False):
            raise EngineBusyError(f"{cls}.{method.__name__}() was called while "
                                  f"{self._running or getattr(self, '_holder', None)} runs in another thread; an "
                                  f"{cls} serves one thread at a time: call it from one thread, or give each thread "
                                  f"its own {cls}")
        if self._running is not None:  # the lock may be reentrant (held_by): a call from inside a call is not one
            self._lock.release()       # at a time either (an update's tensors calling back into the engine)
            raise EngineBusyError(f"{cls}.{method.__name__}() was called from inside {self._running}; one public "
                                  f"call at a time")
        self._running = f"{cls}.{method.__name__}()"
        try:
            return method(self, *args, **kwargs)
        finally:
            self._running = None
            self._lock.release()

    return guarded


@contextlib.contextmanager
def held_by(obj, owner: str):
    """`obj`'s exclusive calls belong to this thread while the block runs (its lock must be reentrant, so the
    thread's own calls go through); any other thread's are refused, naming `owner`."""
    with obj._lock:
        obj._holder = owner
        try:
            yield
        finally:
            obj._holder = None
