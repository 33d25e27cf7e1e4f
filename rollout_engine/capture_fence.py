"""The process-wide fence between CUDA captures and what may not happen during one: destroying a memory pool,
emptying the allocator's cache, page-locking host memory, and a second thread's graph capture."""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

from .errors import add_note


class CaptureFence:
    """torch aborts the process (an internal assert) when a MemPool is destroyed while any capture is underway in
    it, and its allocator counts two things as captures: a CUDA graph capture and an allocation into a memory
    pool (torch_memory_saver's regions enter one). An engine's pools go when the engine does, which may be while
    another engine captures its graphs or builds its weights and KV pool (its last reference dropped on another
    thread, or by a collection that the other engine's allocations set off): pools let go of then are kept until
    the last capture ends. `capturing()` spans captures; `release(pools)` empties the list it is given, destroying
    the pools at once or keeping them until then. A capture that fails keeps them until a later one ends: torch
    may still count it as underway.

    A CUDA graph capture runs alone (`capturing(graph=True)`): it waits for the captures underway on other threads
    and holds new ones off until it ends, since torch.cuda.graph empties the cache as it begins (which asserts
    while any capture is underway) and CUDA refuses other threads' unsafe calls during a global-mode capture. No
    graph capture may begin inside a region of its own thread: it would wait for itself.

    CUDA refuses page-locking calls on any thread while a graph capture (global mode) is underway, and may
    invalidate the capture: `between_captures()` spans a registration, which waits for the captures underway and
    holds off new ones; `after_captures(fn)` defers an unregistration, which may come from a collection on the
    capturing thread itself and so cannot wait."""

    def __init__(self):
        self._lock = threading.RLock()  # no capture begins while pools are destroyed; a release inside one nests
        self._idle = threading.Condition(self._lock)  # notified when the last capture ends
        self._captures = 0
        self._graph_thread: int | None = None  # the thread whose graph capture runs alone
        self._kept: list = []
        self._deferred: list = []  # calls asked for during a capture, made when the last one ends
        self._emptying = False  # an empty_cache() asked for during a capture

    @contextmanager
    def capturing(self, graph: bool = False):
        """Spans a capture: a region's allocations into a pool, or (graph=True) a CUDA graph capture."""
        me = threading.get_ident()
        with self._idle:
            owns = graph and self._graph_thread != me  # a capture nested in the thread's own graph capture goes on
            if self._graph_thread != me:
                self._idle.wait_for(lambda: self._graph_thread is None and not (graph and self._captures))
            if owns:
                self._graph_thread = me
            self._captures += 1
        try:
            yield
        except BaseException as failure:  # the capture's own error goes on, with any deferred call's as notes
            self._end(owns, failure)
            raise
        self._end(owns, None)

    def _end(self, owns: bool, failure: BaseException | None) -> None:
        with self._lock:
            if owns:
                self._graph_thread = None
            self._captures -= 1
            if self._captures:
                return
            try:
                if failure is None:
                    self._kept.clear()
                    if self._emptying:
                        self._emptying = False
                        torch.cuda.empty_cache()
            finally:  # whatever raised, the deferred calls run and the waiting registrations go on
                try:
                    self._run_deferred(failure)  # a failed capture has left CUDA's capture mode, whatever torch counts
                finally:
                    self._idle.notify_all()

    def _run_deferred(self, failure: BaseException | None) -> None:
        """Every deferred call, whatever the others raise (one left for a later capture's end would keep its memory
        locked till then); their errors are notes on the capture's `failure`, else the first raised notes the rest."""
        errors = []
        while self._deferred:
            try:
                self._deferred.pop(0)()
            except Exception as err:
                errors.append(err)
        first = failure or (errors.pop(0) if errors else None)
        for err in errors:
            add_note(first, f"a call deferred to a capture's end also failed: {type(err).__name__}: {err}")
        if first is not failure:
            raise first

    def release(self, pools: list) -> None:
        with self._lock:
            if self._captures:
                self._kept.extend(pools)
            pools.clear()

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(), which asserts the same (no capture underway): now, or after the last capture
        ends. Another thread's sleep while an engine is built or re-captures its graphs would abort otherwise."""
        with self._lock:
            if self._captures:
                self._emptying = True
            else:
                torch.cuda.empty_cache()

    @contextmanager
    def between_captures(self):
        """Run the body once no capture is underway, holding new ones off until it ends. Not from a thread that
        is capturing: it would wait for itself."""
        with self._idle:
            self._idle.wait_for(lambda: not self._captures)
            yield

    def after_captures(self, fn) -> None:
        """fn() now, or when the last capture ends; no capture begins while it runs."""
        with self._lock:
            if self._captures:
                self._deferred.append(fn)
            else:
                fn()


CAPTURES = CaptureFence()  # one per process: a capture on any thread holds back every engine's pool releases
