"""Weight updates from another process: packed buckets, control messages over ZeroMQ.

A bucket is one flat byte buffer plus a JSON list of (name, dtype, shape, offset). On CUDA
the buffer travels as a CUDA IPC handle (the receiver maps the sender's memory, nothing is
copied twice); on the CPU it lives in POSIX shared memory. Every message is JSON: no pickle
on any socket, and endpoints are restricted to ipc:// paths and 127.0.0.1.

    engine process:  WeightReceiver(engine, "ipc:///tmp/weights").receive()   # one whole update
    trainer process: WeightSender("ipc:///tmp/weights").send(model.named_parameters())
"""
from __future__ import annotations

import base64
from multiprocessing import resource_tracker, shared_memory

import torch
import zmq

DEFAULT_BUCKET_BYTES = 512 << 20
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16)}


def check_endpoint(endpoint: str) -> str:
    if not isinstance(endpoint, str) or not (endpoint.startswith("ipc://") or endpoint.startswith("tcp://127.0.0.1:")):
        raise ValueError(f"endpoint={endpoint!r} is not allowed; use ipc://PATH or tcp://127.0.0.1:PORT")
    return endpoint


def buckets(named_tensors, bucket_bytes: int):
    """Group (name, tensor) pairs into lists of at most `bucket_bytes` (a larger tensor goes alone)."""
    group, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > bucket_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += -(-nbytes // 256) * 256
    if group:
        yield group


class _SharedBuffer:
    """A reusable flat byte buffer the other process can map: CUDA memory or POSIX shared memory."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
            fields = self.tensor.untyped_storage()._share_cuda_()
            self.handle = {"cuda": [base64.b64encode(f).decode() if isinstance(f, bytes) else f for f in fields]}
        else:
            self.shm = shared_memory.SharedMemory(create=True, size=nbytes)
            self.tensor = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
            self.handle = {"shm": self.shm.name}

    def close(self) -> None:
        del self.tensor
        if self.device.type != "cuda":
            self.shm.close()
            self.shm.unlink()


def _open(handle: dict):
    """The receiver's view of a sender's buffer (and what keeps it mapped)."""
    if "cuda" in handle:
        fields = [base64.b64decode(f) if isinstance(f, str) else f for f in handle["cuda"]]
        storage = torch.UntypedStorage._new_shared_cuda(*fields)
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage), storage
    shm = shared_memory.SharedMemory(name=handle["shm"])
    resource_tracker.unregister(shm._name, "shared_memory")  # the sender owns and unlinks it
    return torch.frombuffer(shm.buf, dtype=torch.uint8), shm


class WeightSender:
    """Trainer side: streams named tensors to a WeightReceiver in bounded buckets."""

    def __init__(self, endpoint: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 600):
        self.socket = zmq.Context.instance().socket(zmq.REQ)
        self.socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(check_endpoint(endpoint))
        self.bucket_bytes = bucket_bytes
        self.buffer: _SharedBuffer | None = None

    def _ask(self, message: dict) -> dict:
        self.socket.send_json(message)
        reply = self.socket.recv_json()
        if not reply.get("ok"):
            raise RuntimeError(f"the engine rejected the weight update: {reply.get('error')}")
        return reply

    def send(self, named_tensors, version: int | None = None) -> int:
        """One whole update; returns the engine's new weight version."""
        self._ask({"op": "begin", "version": version})
        for group in buckets(((n, t.detach()) for n, t in named_tensors), self.bucket_bytes):
            device = group[0][1].device
            need = sum(-(-t.numel() * t.element_size() // 256) * 256 for _, t in group)
            if self.buffer is None or self.buffer.device != device or self.buffer.tensor.numel() < need:
                if self.buffer is not None:
                    self.buffer.close()
                self.buffer = _SharedBuffer(max(need, self.bucket_bytes), device)
            meta, offset = [], 0
            for name, t in group:
                nbytes = t.numel() * t.element_size()
                self.buffer.tensor[offset : offset + nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
                meta.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                             "offset": offset})
                offset += -(-nbytes // 256) * 256
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the receiver reads the buffer on its own stream
            self._ask({"op": "bucket", "handle": self.buffer.handle, "tensors": meta})
        return self._ask({"op": "end"})["version"]

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
        self.socket.close()


class WeightReceiver:
    """Engine side: applies updates from a WeightSender through engine.update_weights."""

    def __init__(self, engine, endpoint: str, timeout_s: float = 600):
        self.engine = engine
        self.socket = zmq.Context.instance().socket(zmq.REP)
        self.socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(check_endpoint(endpoint))
        self._mapped: dict[str, tuple[torch.Tensor, object]] = {}  # sender buffers, mapped once per update

    def _map(self, handle: dict) -> torch.Tensor:
        key = str(sorted(handle.items()))
        if key not in self._mapped:
            self._mapped[key] = _open(handle)
        return self._mapped[key][0]

    def _unmap(self) -> None:
        keeps = [keep for _, keep in self._mapped.values()]
        self._mapped = {}  # drop the tensor views first: shared memory cannot close under them
        for keep in keeps:
            if isinstance(keep, shared_memory.SharedMemory):
                keep.close()

    def _stream(self):
        """(name, tensor) pairs as buckets arrive; each bucket is acknowledged once its tensors are copied."""
        while True:
            message = self.socket.recv_json()
            if message.get("op") == "end":
                return
            if message.get("op") != "bucket":
                raise ValueError(f"unexpected message {message.get('op')!r} inside an update")
            flat = self._map(message["handle"])
            for item in message["tensors"]:
                if item["dtype"] not in _DTYPES:
                    raise ValueError(f"weight {item['name']!r} has dtype {item['dtype']}; allowed: {sorted(_DTYPES)}")
                dtype = _DTYPES[item["dtype"]]
                nbytes = dtype.itemsize * int(torch.Size(item["shape"]).numel())
                yield item["name"], flat[item["offset"] : item["offset"] + nbytes].view(dtype).view(item["shape"])
            if flat.is_cuda:
                torch.cuda.synchronize(flat.device)  # copies done before the sender reuses its buffer
            self.socket.send_json({"ok": True})

    def receive(self) -> int:
        """Serve one whole update (begin, buckets, end); returns the new weight version."""
        begin = self.socket.recv_json()
        if begin.get("op") != "begin":
            self.socket.send_json({"ok": False, "error": f"expected 'begin', got {begin.get('op')!r}"})
            raise ValueError(f"expected a 'begin' message, got {begin.get('op')!r}")
        self.socket.send_json({"ok": True})
        try:
            version = self.engine.update_weights(self._stream(), begin.get("version"))
        except Exception as err:
            self.socket.send_json({"ok": False, "error": str(err)})
            raise
        finally:
            self._unmap()
        self.socket.send_json({"ok": True, "version": version})
        return version

    def close(self) -> None:
        self.socket.close()
