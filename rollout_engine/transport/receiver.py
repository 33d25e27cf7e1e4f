"""The engine's end: WeightReceiver applies updates from a WeightSender through the engine's update path."""
from __future__ import annotations

import inspect
import itertools
import time

import torch
import zmq

from ..errors import EngineError, WeightSyncTimeout
from ..weights import ReusableGroup
from .announcement import Announcement, check_items
from .broadcast import WeightUpdateGroup
from .closing import Closing
from .cuda_ipc import Storages
from .endpoints import IpcFile, check_bound, check_endpoint, check_ipc_path, private_ipc_endpoint, use_ipv6, zmq_address
from .protocol import MAX_MESSAGE_BYTES, Incoming, WeightUpdateAborted, bucket_kind, check_fits, \
    check_seconds, decode, encode, error_text, view
from .sender import DEFAULT_TIMEOUT_S
from .shm import Segment

STOP_CHECK_MS = 50  # how often a wait for 'begin' given `stop` asks it


class WeightReceiver:
    """Engine side: applies updates from a WeightSender through engine.update_weights_from_buckets.

    `endpoint`: where to listen (see check_endpoint); None makes a private ipc:// socket, whose address trainers read
    from `.endpoint`. `timeout_s` bounds each wait for the sender's next message inside an update (WeightSyncTimeout,
    after which the receiver is usable again). Every message, however malformed, gets a reply; a bad one ends the update
    in progress (the engine keeps its old weights unless some were already copied; then it refuses to generate until a
    complete update arrives). A shared-memory bucket is copied out of the sender's segment into a host buffer of the
    largest bucket, kept until close() (never mapped: a segment shrunk under a mapping would kill the process with
    SIGBUS). With `group` (a WeightUpdateGroup, this process not its rank 0) buckets arrive by broadcast into one buffer
    reused for the whole update; a broadcast announced but never made waits out the group's timeout, not `timeout_s`,
    and close() waits with it (a collective cannot be interrupted)."""

    def __init__(self, engine, endpoint: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 group: WeightUpdateGroup | None = None):
        if group is not None and group.rank == 0:
            raise ValueError("rank 0 of the group broadcasts; a receiver needs another rank")
        updates = getattr(engine, "update_weights_from_buckets", None)
        if not callable(updates) or inspect.iscoroutinefunction(updates):
            raise ValueError(f"engine must be an Engine (the receiver calls its update_weights_from_buckets), got "
                             f"{type(engine).__name__}")
        check_seconds("timeout_s", timeout_s)
        endpoint = private_ipc_endpoint() if endpoint is None else check_endpoint(endpoint, bind=True)
        if endpoint.startswith("ipc://"):
            check_ipc_path(endpoint[len("ipc://"):])
        self.engine, self.group, self.timeout_s = engine, group, timeout_s
        self._segment: Segment | None = None  # the sender's shared-memory segment, open for one update
        self._cuda = Storages()  # the sender's CUDA storages, mapped across updates
        self._received: torch.Tensor | None = None  # the broadcast buffer, kept for one update
        self._host: torch.Tensor | None = None  # the host buffer shared-memory buckets are read into, kept
        self._last: dict[int, tuple] = {}  # position -> (bytes, ReusableGroup, storage keys, names) of the last update
        self._kept: dict[int, tuple] = {}  # ... of this update
        self._peer: bytes | None = None  # the sender of the update in progress
        self._owed: Incoming | None = None  # its message that awaits a reply
        self._announced: Announcement | None = None  # the tensors its 'begin' announced (None: not a whole update)
        # A context of its own, terminated by close(): ZeroMQ closes a socket in its I/O thread, and a
        # listener's close unlinks its ipc path by name, so a receiver bound there next could lose its file.
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # a larger message drops its connection
        self.socket.setsockopt(zmq.RCVHWM, 16)  # a sender has one message in flight; bounds what others can queue
        self._closing = Closing(self, self._context, self.socket)  # close() from another thread or a signal handler
        use_ipv6(self.socket, endpoint)
        self._ipc: IpcFile | None = None
        try:
            self.socket.bind(zmq_address(endpoint))
            if endpoint.startswith("ipc://"):
                self._ipc = IpcFile(self, endpoint[len("ipc://"):])
            self.endpoint = check_bound(self.socket, endpoint)  # what a WeightSender connects to
        except BaseException:
            self.close()
            raise

    @property
    def mapped_storages(self) -> int:
        """(Diagnostics) How many of the sender's CUDA storages stay mapped (shared afresh only when they change)."""
        return len(self._cuda.mapped)

    @property
    def kept_groups(self) -> list:
        """The last update's groups (weights.ReusableGroup) whose copy plans a steady next update replays."""
        return [kept[1] for kept in self._last.values()]

    # ------------------------------------------------------------------ messages

    def _read(self, deadline: float | None, waiting_for: str, wait_s: float | None, stop=None) -> Incoming:
        """The next message before `deadline` (time.monotonic(); None: none), the end of a wait of `wait_s`.
        `stop` (a callable; None: none) is asked every STOP_CHECK_MS: true ends the wait (WeightUpdateAborted)."""
        while True:
            left = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if stop is not None:
                left = STOP_CHECK_MS if left is None else min(left, STOP_CHECK_MS)
            arrived, rang = self._closing.poll(left)
            if rang:
                raise WeightUpdateAborted(f"the weight receiver at {self.endpoint} was closed while it waited for "
                                          f"the {waiting_for}")
            if arrived:
                return Incoming.split(self.socket.recv_multipart())
            if stop is None or (deadline is not None and time.monotonic() >= deadline):
                raise WeightSyncTimeout(f"no {waiting_for} arrived from the weight sender at {self.endpoint} "
                                        f"within {wait_s or 0:g} s")
            if stop():
                raise WeightUpdateAborted(f"the wait for the {waiting_for} at {self.endpoint} was stopped")

    def _answer(self, incoming: Incoming, err: BaseException | None = None, retry: bool = False, **fields) -> None:
        if err is None:
            reply = {"ok": True} | fields
        else:
            reply = {"ok": False, "error": error_text(err) if isinstance(err, ValueError | WeightUpdateAborted)
                     else f"{type(err).__name__}: {error_text(err)}"} | ({"retry": True} if retry else {})
        self.socket.send_multipart(incoming.envelope + [encode(reply)])  # to a peer gone: dropped
        if incoming is self._owed:
            self._owed = None

    def _from_sender(self, waiting_for: str) -> Incoming:
        """The next message from the sender of the update in progress. Other peers' messages are answered
        (an error: they belong to no update) and otherwise ignored, except a 'begin', which aborts this
        update for theirs (this update's sender may have died)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            incoming = self._read(deadline, waiting_for, self.timeout_s)
            if incoming.peer == self._peer:
                return incoming
            try:
                op = decode(incoming.body)["op"]
            except ValueError as err:
                self._answer(incoming, err)
                continue
            if op == "begin":
                self._answer(incoming, WeightUpdateAborted("an unfinished update from another sender was aborted "
                                                           "for this one; send 'begin' again"), retry=True)
                raise WeightUpdateAborted("another sender began an update before this one ended (its sender may "
                                          "have died); this one is aborted")
            self._answer(incoming, ValueError(f"op {op!r} belongs to no update of this sender's: another "
                                              "sender's update is in progress"))

    # ------------------------------------------------------------------ one update

    def receive(self, begin_timeout_s: float | None = None, stop=None) -> int:
        """Serve one whole update (begin, buckets, end); returns the new weight version. Waits for 'begin'
        up to `begin_timeout_s` (None: as long as the trainer takes), for each later message `timeout_s`.
        `stop`: a callable asked during the wait for 'begin' (not after): true ends it (WeightUpdateAborted)."""
        check_seconds("begin_timeout_s", begin_timeout_s, none_allowed=True, zero_allowed=True)
        with self._closing.receiving(self._shut):
            if self._closing.closed:  # not WeightUpdateAborted, which a loop may retry
                raise EngineError(f"the weight receiver at {self.endpoint} is closed; make a new one")
            return self._receive(begin_timeout_s, stop)

    def _receive(self, begin_timeout_s: float | None, stop=None) -> int:
        incoming, message = self._begin(begin_timeout_s, stop)
        self._peer, self._owed = incoming.peer, incoming
        try:
            version = self.engine.update_weights_from_buckets(self._groups(message), message["version"], "target")
            self._sync()
            self._answer(self._owed, version=version)  # 'end': every copy is done
        except BaseException as err:
            self._fail(err)
            raise
        finally:
            self._finish()
        return version

    def _begin(self, timeout_s: float | None, stop=None) -> tuple[Incoming, dict]:
        """The next 'begin'. An 'abort' before it is answered and passed over: it ends an update this receiver
        does not have (its sender gave up after a lost message, as when a receiver restarts at its path)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            incoming = self._read(deadline, "'begin' message", timeout_s, stop)
            try:
                message = decode(incoming.body)
                if message["op"] not in ("begin", "abort"):
                    raise ValueError(f"field 'op' is {message['op']!r} but no update is in progress; an update "
                                     "starts with 'begin'")
            except ValueError as err:
                self._answer(incoming, err)
                raise
            if message["op"] == "begin":
                return incoming, message
            self._answer(incoming)

    def _groups(self, begin: dict):
        """One group of (name, tensor) pairs per bucket, for the engine. A packed bucket is acknowledged once
        the engine has copied it (the sender then reuses its buffer); a shared one at once, so the sender
        prepares the next bucket while the engine takes this one (shared tensors stay unchanged until send
        returns)."""
        # The engine has accepted the update (awake, its version): what 'begin' announced is checked, nothing copied
        if "config" in begin:
            self.engine.cfg.check_same_function(begin["config"])
        if "tensors" in begin:
            self._announced = Announcement(self.engine.weights, begin["tensors"])
        self._answer(self._owed)  # 'begin', answered once the engine has accepted the update
        for position in itertools.count():
            incoming = self._owed = self._from_sender(f"bucket or 'end' (after {position} buckets)")
            raw = incoming.body[0] if len(incoming.body) == 1 else None
            last = self._last.get(position)
            if last is not None and raw == last[0]:
                # The same bytes at the same position name the same tensors in the same mapped storages (a
                # fresh share carries a handle, so it never repeats as is): the engine's checked copy plan
                # on the group still holds, and nothing is parsed or checked again.
                self._arrive(last[3])
                self._answer(incoming)
                self._kept[position] = last
                self._cuda.used |= last[2]
                yield last[1]
                continue
            message = decode(incoming.body)
            if message["op"] == "end":
                if self._announced is not None:
                    self._announced.check_end()
                return
            if message["op"] == "abort":
                self._answer(incoming)
                raise WeightUpdateAborted(f"the sender aborted the update: {message['error'][:2000]}")
            if message["op"] == "begin":
                err = WeightUpdateAborted("op 'begin' came inside an update: the unfinished update is aborted; "
                                          "send 'begin' again")
                self._answer(incoming, err, retry=True)
                raise err
            if message["op"] == "sent":
                raise ValueError("op 'sent' follows a broadcast bucket's broadcast; no broadcast was under way")
            self._arrive([item["name"] for item in message["tensors"]])
            yield from self._bucket(message, incoming, raw, position)

    def _bucket(self, message: dict, incoming: Incoming, raw: bytes, position: int):
        items, kind = message["tensors"], bucket_kind(message)
        if kind == "broadcast" and self.group is None:
            raise ValueError("field 'nbytes' (a bucket to broadcast) needs a weight-update group; this receiver "
                             "has none: send 'handle' (shared memory) or CUDA storages")
        if kind != "broadcast" and self.group is not None:
            raise ValueError("this receiver takes buckets by broadcast over its weight-update group: a bucket "
                             f"needs field 'nbytes', not {'handle' if kind == 'shm' else 'CUDA storages'}")
        if kind != "shared":  # before memory is taken to read it (a share maps memory, checked as it is mapped)
            check_items(self.engine.weights, items, "one bucket")
        if kind == "shared":
            group = ReusableGroup([self._shared_tensor(item) for item in items])
            self._answer(incoming)
            if not any("cuda" in item for item in items):  # a fresh share is never sent again as is
                self._kept[position] = (raw, group, {tuple(item["storage"]) for item in items},
                                        [item["name"] for item in items])
            yield group
            return
        if kind == "broadcast":
            check_fits(items, message["nbytes"], "the broadcast bucket")
            self._answer(incoming)  # the sender broadcasts only after this answer: a refusal above costs no broadcast
            flat = self._receive_broadcast(message["nbytes"])
            incoming = self._owed = self._from_sender("'sent' (after a broadcast bucket)")
            op = decode(incoming.body)["op"]
            if op == "abort":
                self._answer(incoming)
                raise WeightUpdateAborted("the sender aborted the update during a bucket's broadcast")
            if op != "sent":
                raise ValueError(f"op {op!r} came where 'sent' (a broadcast bucket's broadcast is done) belongs")
        else:
            flat, items = self._open(message["handle"]["shm"]).read(items, self._read_buffer)
        yield [view(flat, item) for item in items]
        self._sync()  # copied before the sender (or the next broadcast) reuses the buffer
        self._answer(incoming)

    def _arrive(self, names: list[str]) -> None:
        if self._announced is not None:
            self._announced.arrive(names)

    def _shared_tensor(self, item: dict) -> tuple[str, torch.Tensor]:
        return self._cuda.tensor(item, self.engine.device)

    def _open(self, name: str) -> Segment:
        if self._segment is None or self._segment.name != name:
            self._close_segment()
            self._segment = Segment(name)
        return self._segment

    def _close_segment(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def _read_buffer(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of the host buffer that shared-memory buckets are read into. It is kept across updates, as
        the sender keeps its segment: fresh memory takes a page fault per 4 KiB at its first write, which
        costs more than the read itself (256 MiB: about 200 ms against 65 ms on a 2-core VM)."""
        if self._host is None or self._host.numel() < nbytes:
            self._host = None  # free the smaller one first: never more than one bucket extra
            self._host = torch.empty(nbytes, dtype=torch.uint8)
        return self._host[:nbytes]

    def _receive_broadcast(self, nbytes: int) -> torch.Tensor:
        if self._received is None or self._received.numel() < nbytes:
            self._received = None  # free the smaller one first: never more than one bucket extra
            self._received = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        flat = self._received[:nbytes]
        self.group.broadcast(flat)
        return flat

    def _fail(self, err: BaseException) -> None:
        """After an error the sender forgets every share and plan (cuda_ipc.ShareBook.forget): so do we. The
        error answers the message that caused it, or, when that was acknowledged already (a shared bucket),
        the sender's next message if it comes in time; the error raised stays the real one."""
        self._kept, self._cuda.used = {}, set()
        self._host = None  # a refused bucket's bytes are not kept
        self._sync()
        if self._owed is not None:
            self._answer(self._owed, err)
        elif isinstance(err, Exception) and not isinstance(err, (WeightSyncTimeout, WeightUpdateAborted)):
            try:
                self._answer(self._from_sender("next message (to report an error to)"), err)
            except (WeightSyncTimeout, WeightUpdateAborted):
                pass

    def _finish(self) -> None:
        self._peer = self._owed = self._announced = None
        self._received = None
        self._close_segment()  # the sender's segment stays open for one update: it may unlink it and free its memory
        self._cuda.keep_used()
        # Keep only plans that hold no tensor: one with a cast holds the engine's weights, which a sleep
        # without torch_memory_saver must be able to free.
        self._last = {p: kept for p, kept in self._kept.items() if kept[1].keepable}
        self._kept = {}

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def close(self) -> None:
        """Frees what the receiver holds and its endpoint. From another thread, a receive() in progress ends
        first, with WeightUpdateAborted (an update it was applying is aborted, as by its sender); from a signal
        handler inside a receive() or a close(), that call frees it on its way out (closing.py)."""
        self._closing.close(self._shut)

    def _shut(self) -> None:
        self._close_segment()
        self._host, self._last = None, {}
        self._cuda.clear()
        # The last reply ('end') must leave before the socket goes: a close right after it lost it about one
        # time in three (ipc, even with linger), and the sender then waited out its timeout.
        self.socket.poll(50, zmq.POLLOUT)
        time.sleep(0.05)
        self.socket.close(linger=1000)
        self._closing.close_pair()
        self._context.term()  # waits for ZeroMQ's own close: nothing of this socket acts after here
        if self._ipc is not None:
            self._ipc.remove()
