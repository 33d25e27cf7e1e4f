"""Weight updates from another process: packed buckets, control messages over ZeroMQ.

Tensors move in buckets of bounded size, one request and one reply each. How a bucket travels
depends on where the two processes are:

- same GPU: nothing is packed. Each tensor goes as its storage's key (the sender's address and
  size) plus (dtype, shape, stride, offset); the receiver maps the storage and copies straight
  into the engine's weights, so every byte is copied once and no extra device memory is used.
  Sharing a storage and opening its handle cost far more than copying a small tensor, so both
  ends keep them across updates by one rule: a storage stays shared (sender) and mapped
  (receiver, under the key) while consecutive updates send it, and both let go of the rest at
  the end of an update (of all of them after an error). Only a storage shared afresh carries
  its CUDA IPC handle. A trainer updates its parameters in place, so from the second update on
  neither end shares or opens anything, and from the third each bucket goes as the same bytes as
  before: the receiver neither parses nor checks it again, and the engine replays its copy plan
  (one launch per bucket). (Send the parameters themselves:
  a temporary, say a cast copy, stays mapped, and so alive in the trainer, until the next update ends);
- CPU: packed into one flat POSIX shared-memory buffer, with a JSON list of (name, dtype, shape,
  offset) (the same protocol, so CI runs it);
- separate GPUs: packed and broadcast over a process group of its own (`init_weight_update_group`;
  NCCL on CUDA, gloo on the CPU) into one reusable buffer on the receiver's side.

Every message is JSON: no pickle on any socket, and endpoints (the group's rendezvous store
too) are restricted to ipc:// paths and 127.0.0.1. Each bucket is one request and one reply.
A packed bucket is acknowledged once it is copied, so the sender may then reuse its buffer
(packed transports use one bucket of extra memory on each side); shared tensors must stay
unchanged until send() returns, whose last reply comes after every copy, so their copies run
on while the next bucket's message travels.

    engine process:  WeightReceiver(engine, "ipc:///tmp/weights").receive()   # one whole update
    trainer process: WeightSender("ipc:///tmp/weights").send(model.named_parameters())

Across GPUs both sides first join the group (the trainer is rank 0, and broadcasts), then pass
it to their end of the socket:

    engine:  group = init_weight_update_group("127.0.0.1", 29600, rank=1, world_size=2)
             WeightReceiver(engine, "tcp://127.0.0.1:5555", group=group).receive()
    trainer: group = init_weight_update_group("127.0.0.1", 29600, rank=0, world_size=2)
             WeightSender("tcp://127.0.0.1:5555", group=group).send(model.named_parameters())

and each calls group.close() when it is done with updates.
"""
from __future__ import annotations

import base64
import itertools
import json
import math
import socket
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import resource_tracker, shared_memory

import torch
import torch.distributed as dist
import zmq

from kernels import get_ops

from .weights import ReusableGroup, buckets, padded

DEFAULT_BUCKET_BYTES = 512 << 20
SHARED_BUCKET_BYTES = 2 << 30
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16)}


def check_endpoint(endpoint: str) -> str:
    if not isinstance(endpoint, str) or not (endpoint.startswith("ipc://") or endpoint.startswith("tcp://127.0.0.1:")):
        raise ValueError(f"endpoint={endpoint!r} is not allowed; use ipc://PATH or tcp://127.0.0.1:PORT")
    return endpoint


@dataclass
class WeightUpdateGroup:
    """A process group of its own for weight broadcasts: rank 0 (the trainer) sends, every other rank receives."""

    backend: object        # torch's ProcessGroupNCCL or ProcessGroupGloo, used directly (no default group)
    device: torch.device   # where broadcast buffers live: the current CUDA device for nccl, the CPU for gloo
    rank: int

    def broadcast(self, flat: torch.Tensor) -> None:
        """Rank 0's `flat` into every other rank's `flat` (same byte count on each side)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.backend.broadcast([flat], options).wait()

    def close(self) -> None:
        """Shut the group down (NCCL otherwise warns at exit that it was never destroyed). With NCCL this
        returns once every rank has called it: a rank that waits for another before closing deadlocks."""
        self.backend.shutdown()


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             backend: str | None = None, timeout_s: float = 600) -> WeightUpdateGroup:
    """Join the weight-update group; every rank calls this, and it returns once all have joined.

    Rank 0 is the trainer: it hosts the rendezvous store (listening on 127.0.0.1 only) and
    broadcasts; the engines are ranks 1 .. world_size - 1. backend: "nccl" (CUDA buffers on the
    current device: call torch.cuda.set_device first) or "gloo" (CPU); default nccl when CUDA
    is available. torch.distributed's default group is neither needed nor touched. NCCL picks its
    own network interface for its bootstrap (NCCL_SOCKET_IFNAME=lo keeps it on loopback)."""
    if master_address != "127.0.0.1":
        raise ValueError(f"master_address={master_address!r} is not allowed; use 127.0.0.1")
    if not (isinstance(world_size, int) and world_size >= 2 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank={rank!r}, world_size={world_size!r}: need world_size >= 2 and 0 <= rank < world_size")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r} is not allowed; 'nccl' or 'gloo'")
    timeout = timedelta(seconds=timeout_s)
    # Rank 0 binds the store's socket itself: TCPStore alone would listen on every interface.
    listen_fd = socket.create_server((master_address, master_port)).detach() if rank == 0 else None
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          master_listen_fd=listen_fd)
    store = dist.PrefixStore("weight_update/", store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=master_address)]
        return WeightUpdateGroup(dist.ProcessGroupGloo(store, rank, world_size, options), torch.device("cpu"), rank)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    device = torch.device("cuda", torch.cuda.current_device())
    return WeightUpdateGroup(dist.ProcessGroupNCCL(store, rank, world_size, options), device, rank)


class _SharedBuffer:
    """A flat byte buffer in POSIX shared memory that the other process can map."""

    def __init__(self, nbytes: int):
        self.shm = shared_memory.SharedMemory(create=True, size=nbytes)
        self.tensor = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        self.handle = {"shm": self.shm.name}

    def close(self) -> None:
        del self.tensor
        self.shm.close()
        self.shm.unlink()


def _open(handle: dict):
    """The receiver's view of a sender's shared-memory buffer, and what keeps it mapped."""
    shm = shared_memory.SharedMemory(name=handle["shm"])
    resource_tracker.unregister(shm._name, "shared_memory")  # the sender owns and unlinks it
    return torch.frombuffer(shm.buf, dtype=torch.uint8), shm


def _cuda_handle(t: torch.Tensor) -> list:
    """JSON-able CUDA IPC handle of the storage under `t` (torch's own fields, bytes as base64)."""
    return [base64.b64encode(f).decode() if isinstance(f, bytes) else f for f in t.untyped_storage()._share_cuda_()]


def _dtype(item: dict) -> torch.dtype:
    if item["dtype"] not in _DTYPES:
        raise ValueError(f"weight {item['name']!r} has dtype {item['dtype']}; allowed: {sorted(_DTYPES)}")
    return _DTYPES[item["dtype"]]


def _view(flat: torch.Tensor, item: dict) -> tuple[str, torch.Tensor]:
    """(name, tensor) of one metadata entry, a view into the bucket's bytes."""
    dtype = _dtype(item)
    start = item["offset"]
    nbytes = dtype.itemsize * math.prod(item["shape"])
    return item["name"], flat[start : start + nbytes].view(dtype).view(item["shape"])


class WeightSender:
    """Trainer side: streams named tensors to a WeightReceiver in bounded buckets.

    Without `group`, CUDA tensors are shared as they are (IPC handles) and CPU tensors packed into
    shared memory; with a WeightUpdateGroup (this process its rank 0) buckets are broadcast."""

    def __init__(self, endpoint: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 600,
                 group: WeightUpdateGroup | None = None):
        if group is not None and group.rank != 0:
            raise ValueError(f"the sender broadcasts, so it must be rank 0 of its group, not rank {group.rank}")
        self.socket = zmq.Context.instance().socket(zmq.REQ)
        self.socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(check_endpoint(endpoint))
        self.bucket_bytes = bucket_bytes
        self.group = group
        self.flat: torch.Tensor | None = None      # the reused send buffer ...
        self.shared: _SharedBuffer | None = None   # ... and, without a group, what shares it
        self._shared: set[tuple[int, int]] = set()  # CUDA storages shared, by (data_ptr, nbytes)
        self._sent: set[tuple[int, int]] = set()  # ... that this update sent
        self._encoded: list[tuple[list, bytes]] = []  # each shared bucket's metadata and message, last update
        self._encoding: list[tuple[list, bytes]] = []  # ... this update

    def _ask(self, message: dict | bytes, broadcast: torch.Tensor | None = None) -> dict:
        self.socket.send(message) if isinstance(message, bytes) else self.socket.send_json(message)
        if broadcast is not None:
            self.group.broadcast(broadcast)  # the receiver joins once it has read the message
        reply = self.socket.recv_json()
        if not reply.get("ok"):
            raise RuntimeError(f"the engine rejected the weight update: {reply.get('error')}")
        return reply

    def _buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The send buffer, (re)allocated when it is too small or on another device."""
        if self.flat is None or self.flat.device != device or self.flat.numel() < nbytes:
            self._release()
            nbytes = max(nbytes, self.bucket_bytes)
            if self.group is not None:
                self.flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
            else:
                self.shared = _SharedBuffer(nbytes)
                self.flat = self.shared.tensor
        return self.flat

    def _pack(self, group: list) -> tuple[torch.Tensor, list[dict]]:
        """Copy one bucket's tensors into the send buffer; the bytes used, and their metadata."""
        offsets, end = [], 0
        for _, t in group:
            offsets.append(end)
            end += padded(t.nbytes)
        device = self.group.device if self.group is not None else group[0][1].device
        flat = self._buffer(end, device)
        views = [flat[o : o + t.nbytes].view(t.dtype).view(t.shape) for o, (_, t) in zip(offsets, group)]
        get_ops(device).copy_many(views, [t for _, t in group])
        meta = [{"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": o}
                for o, (name, t) in zip(offsets, group)]
        return flat[:end], meta

    @torch.no_grad()  # packing copies parameters: no autograd history (cheaper than detaching each)
    def send(self, named_tensors, version: int | None = None) -> int:
        """One whole update; returns the engine's new weight version."""
        named = iter(named_tensors)
        first = next(named, None)
        named = itertools.chain([first] if first is not None else [], named)
        # Shared tensors take no buffer, so their buckets bound only the message: one round trip per
        # SHARED_BUCKET_BYTES (steady updates in 512 MB, 1 GB and 2 GB buckets measured within 6% of each other).
        shared = self.group is None and first is not None and first[1].is_cuda
        bucket_bytes = max(self.bucket_bytes, SHARED_BUCKET_BYTES) if shared else self.bucket_bytes
        try:
            self._ask({"op": "begin", "version": version})
            for position, group in enumerate(buckets(named, bucket_bytes)):
                if shared:
                    self._share(group, position)
                    continue
                flat, meta = self._pack(group)
                if self.group is not None:
                    self._ask({"op": "bucket", "nbytes": flat.numel(), "tensors": meta}, broadcast=flat)
                else:
                    self._ask({"op": "bucket", "handle": self.shared.handle, "tensors": meta})
            version = self._ask({"op": "end"})["version"]
        except BaseException:
            self._shared, self._sent = set(), set()  # the receiver lets go of every mapping after an error
            self._encoded, self._encoding = [], []
            raise
        self._shared, self._sent = self._sent, set()
        self._encoded, self._encoding = self._encoding, []
        return version

    def _share(self, group: list, position: int) -> None:
        """A bucket of CUDA tensors, by reference: the receiver copies straight out of them. A bucket that
        describes what the last update's bucket at `position` did goes as the same bytes, not encoded again
        (the receiver, seeing them, reuses what it made of them)."""
        if any(not t.is_cuda for _, t in group):
            raise ValueError("one update mixes CUDA and CPU tensors; send them from one device")
        torch.cuda.synchronize(group[0][1].device)  # the receiver reads them on its own stream
        meta = []
        for name, t in group:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            item = {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                    "stride": list(t.stride()), "storage_offset": t.storage_offset(), "storage": key}
            if key not in self._shared:
                item["cuda"] = _cuda_handle(t)  # only once: the receiver keeps the mapping under `key`
                self._shared.add(key)
            self._sent.add(key)
            meta.append(item)
        last = self._encoded[position] if position < len(self._encoded) else None
        if last is not None and last[0] == meta:
            raw = last[1]
        else:
            raw = json.dumps({"op": "bucket", "tensors": meta}).encode()
        self._encoding.append((meta, raw))
        self._ask(raw)  # they must not change before send() returns

    def _release(self) -> None:
        self.flat = None
        if self.shared is not None:
            self.shared.close()
            self.shared = None

    def close(self) -> None:
        self._release()
        self.socket.close()


class WeightReceiver:
    """Engine side: applies updates from a WeightSender through the engine's update path.

    With `group` (a WeightUpdateGroup of which this process is a rank other than 0) buckets
    arrive by broadcast into one buffer reused for the whole update and freed after it."""

    def __init__(self, engine, endpoint: str, timeout_s: float = 600, group: WeightUpdateGroup | None = None):
        if group is not None and group.rank == 0:
            raise ValueError("rank 0 of the group broadcasts; a receiver needs another rank")
        self.engine = engine
        self.socket = zmq.Context.instance().socket(zmq.REP)
        self.socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(check_endpoint(endpoint))
        self.group = group
        self._mapped: tuple[str, torch.Tensor, object] | None = None  # the sender's shared-memory buffer
        self._storages: dict[tuple, tuple] = {}  # the sender's CUDA storages (and views of them), by its key
        self._used: set[tuple] = set()  # ... that this update referred to
        self._received: torch.Tensor | None = None  # the broadcast buffer, kept for one update
        self._owes_reply = False  # REP: the last message received has not been answered yet
        self._last: dict[int, tuple] = {}  # position -> (bytes, ReusableGroup, storage keys) of the last update
        self._kept: dict[int, tuple] = {}  # ... of this update

    def _map(self, handle: dict) -> torch.Tensor:
        key = json.dumps(handle, sort_keys=True)
        if self._mapped is None or self._mapped[0] != key:
            self._unmap()
            self._mapped = (key, *_open(handle))
        return self._mapped[1]

    def _shared_tensor(self, item: dict) -> tuple[str, torch.Tensor]:
        """(name, tensor) of one tensor shared by CUDA IPC: the sender's storage, mapped here once under the
        sender's key for it, and the view of it kept too (a steady update only looks both up).

        An item with a handle is a fresh share: it is mapped anew (a key from an earlier sender process may
        name other memory). One without must already be mapped here (the rule in the module docstring)."""
        key = tuple(item["storage"])
        if "cuda" in item:
            fields = [base64.b64decode(f) if isinstance(f, str) else f for f in item["cuda"]]
            self._storages[key] = (torch.UntypedStorage._new_shared_cuda(*fields), {})
        elif key not in self._storages:
            raise ValueError(f"weight {item['name']!r} refers to a CUDA storage this receiver no longer maps; "
                             "the sender shares it again on its next send")
        self._used.add(key)
        storage, views = self._storages[key]
        layout = (item["dtype"], item["storage_offset"], tuple(item["shape"]), tuple(item["stride"]))
        if layout not in views:
            view = torch.empty(0, dtype=_dtype(item), device=storage.device)
            views[layout] = view.set_(storage, item["storage_offset"], item["shape"], item["stride"])
        return item["name"], views[layout]

    def _unmap(self) -> None:
        if self._mapped is not None:
            keep = self._mapped[2]
            self._mapped = None  # drop the tensor view first: shared memory cannot close under it
            if isinstance(keep, shared_memory.SharedMemory):
                keep.close()

    def _receive_broadcast(self, nbytes: int) -> torch.Tensor:
        if self._received is None or self._received.numel() < nbytes:
            self._received = None  # free the smaller one first: never more than one bucket extra
            self._received = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        flat = self._received[:nbytes]
        self.group.broadcast(flat)
        return flat

    def _recv(self) -> bytes:
        raw = self.socket.recv()
        self._owes_reply = True
        return raw

    def _reply(self, message: dict) -> None:
        self.socket.send_json(message)
        self._owes_reply = False

    def _groups(self):
        """One group of (name, tensor) views per bucket. A packed bucket is acknowledged once the engine
        has copied it (the sender then reuses its buffer); a shared one at once, so the sender prepares
        the next bucket while the engine takes this one (shared tensors stay unchanged until send returns).

        A shared bucket whose bytes equal the last update's at the same position names the same tensors
        in the same mapped storages: it is not parsed again, and the engine reuses its checked copy plan."""
        self._reply({"ok": True})  # accept 'begin' only once the engine has accepted the update
        for position in itertools.count():
            raw = self._recv()
            last = self._last.get(position)
            if last is not None and last[0] == raw:
                self._reply({"ok": True})
                self._kept[position] = last
                self._used |= last[2]
                yield last[1]
                continue
            message = json.loads(raw)
            if message.get("op") == "end":
                return
            if message.get("op") != "bucket":
                raise ValueError(f"unexpected message {message.get('op')!r} inside an update")
            if self.group is None and "handle" not in message:
                self._reply({"ok": True})
                items = message["tensors"]
                group = ReusableGroup([self._shared_tensor(item) for item in items])
                if not any("cuda" in item for item in items):  # a fresh share is never sent again as is
                    self._kept[position] = (raw, group, {tuple(item["storage"]) for item in items})
                yield group
                continue
            if self.group is not None:
                flat = self._receive_broadcast(int(message["nbytes"]))  # join before anything can fail
            else:
                flat = self._map(message["handle"])
            yield [_view(flat, item) for item in message["tensors"]]
            self._sync()  # copied before the sender (or the next broadcast) reuses the buffer
            self._reply({"ok": True})

    def receive(self) -> int:
        """Serve one whole update (begin, buckets, end); returns the new weight version."""
        begin = json.loads(self._recv())
        if begin.get("op") != "begin":
            self._reply({"ok": False, "error": f"expected 'begin', got {begin.get('op')!r}"})
            raise ValueError(f"expected a 'begin' message, got {begin.get('op')!r}")
        try:
            # One group per bucket; the copies of shared tensors are waited for once, before the last reply.
            version = self.engine._update_groups(self._groups(), begin.get("version"), "target")
        except Exception as err:
            self._used, self._kept = set(), {}  # the sender forgets every share after an error
            self._sync()
            if not isinstance(err, zmq.Again):  # a sender that went silent gets no answer
                if not self._owes_reply:
                    self._recv()  # the bucket was acknowledged already: the error answers the sender's next message
                self._reply({"ok": False, "error": str(err)})
            raise
        finally:
            self._received = None
            # Keep the mappings this update used (the next one likely sends the same storages); let go of the rest.
            self._storages = {k: v for k, v in self._storages.items() if k in self._used}
            # Keep only plans that hold no tensor: one with a cast holds the engine's weights, which a sleep
            # without torch_memory_saver must be able to free.
            self._last = {p: kept for p, kept in self._kept.items() if kept[1].keepable}
            self._kept, self._used = {}, set()
        self._sync()
        self._reply({"ok": True, "version": version})
        return version

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def close(self) -> None:
        self._unmap()
        self._storages, self._last = {}, {}
        self.socket.close()
