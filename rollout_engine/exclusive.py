"""One public call at a time: the synchronous Engine (and EnginePool) serves one thread, and refuses a second at
once rather than letting two calls interleave their steps (one would lose the other's requests)."""
from __future__ import annotations

import functools

from .errors import EngineBusyError


def exclusive(method):
    """One public call at a time: a call made while another runs (another thread) raises EngineBusyError
    at once and changes nothing."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        if not self._lock.acquire(blocking=False):
            cls = type(self).__name__
            raise EngineBusyError(f"{cls}.{method.__name__}() was called while {cls}.{self._running}() is running "
                                  f"in another thread; an {cls} serves one thread at a time: call it from one "
                                  f"thread, or give each thread its own {cls}")
        self._running = method.__name__
        try:
            return method(self, *args, **kwargs)
        finally:
            self._running = None
            self._lock.release()

    return guarded
