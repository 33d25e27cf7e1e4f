"""Closing a receiving ZeroMQ socket from another thread or from a signal handler.

A ZeroMQ socket is one thread's at a time, so close() must not close it under another thread's poll. The closer
rings an inproc pair polled beside the socket (the bell stays unread: every later wait of the interrupted call
ends too), marks the receiver closed, then waits until the receiving call has left (`busy`) and shuts it once. A
signal handler runs in the thread it interrupts: when that thread is inside a receive or a close (`inside`), the
handler's close only rings and marks, and the interrupted call shuts on its way out. Nothing a handler does waits
on a lock its own thread may hold.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import zmq


class Closing:
    def __init__(self, owner, context: zmq.Context, socket: zmq.Socket):
        self.closed = self._rung = self._shut = False
        self._busy, self._ringing, self._inside = threading.Lock(), threading.Lock(), set()
        self._bell, self._ring = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        self._bell.bind(f"inproc://closing-{id(self)}")
        self._ring.connect(f"inproc://closing-{id(self)}")
        self._socket, self._poller = socket, zmq.Poller()
        self._poller.register(socket, zmq.POLLIN)
        self._poller.register(self._bell, zmq.POLLIN)
        # An owner dropped without close(): its sockets close before its context ends. Left to the garbage
        # collector, the context's own finalizer may run first and wait forever for sockets it no longer sees.
        self._dropped = weakref.finalize(owner, _drop, context, (socket, self._bell, self._ring))

    def poll(self, timeout_ms: int | None) -> tuple[bool, bool]:
        """(whether the socket has a message, whether close() rang) after waiting up to `timeout_ms`."""
        ready = dict(self._poller.poll(timeout_ms))
        return self._socket in ready, self._bell in ready

    @contextmanager
    def receiving(self, shut):
        """The span of one receive (one at a time); `shut()` runs on the way out if the receiver was closed."""
        self._inside.add(threading.get_ident())
        try:
            with self._busy:
                yield
        finally:
            self._inside.discard(threading.get_ident())
            if self.closed:  # by a signal handler in this thread, or by another thread (then waiting, or done)
                self._shut_once(shut)

    def close(self, shut) -> None:
        if threading.get_ident() in self._inside:  # a signal handler: the call it interrupted shuts
            self._ring_once()
            self.closed = True
            return
        self._inside.add(threading.get_ident())
        try:
            self._ring_once()
            self.closed = True  # after the ring: whoever shuts on seeing it closes the pair after the ring
            self._shut_once(shut)  # the receiving thread has left; a second close() returns once it is shut
        finally:
            self._inside.discard(threading.get_ident())

    def _ring_once(self) -> None:
        if self._ringing.acquire(blocking=False):  # never waits: the holder rings, or shuts (no ring needed then)
            if not self._rung and not self._shut:
                self._rung = True
                self._ring.send(b"")
            self._ringing.release()

    def _shut_once(self, shut) -> None:
        with self._busy:
            with self._ringing:
                if self._shut:
                    return
                self._shut = True
            shut()  # calls close_pair before it ends the context
            self._dropped.detach()

    def close_pair(self) -> None:
        for pair in (self._bell, self._ring):
            pair.close(linger=0)


def _drop(context: zmq.Context, sockets: tuple) -> None:
    for socket in sockets:
        socket.close(linger=0)
    context.term()
