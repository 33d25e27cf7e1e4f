"""The trainer's end: WeightSender streams named tensors to a WeightReceiver in bounded buckets."""
from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch
import zmq

from rollout_kernels import get_ops

from ..errors import EngineError, WeightSyncTimeout
from ..weight_store import named_pairs
from ..weights import buckets, padded
from .broadcast import WeightUpdateGroup
from .cuda_ipc import ShareBook
from .endpoints import check_bound, check_endpoint, check_ipc_directory, use_ipv6, zmq_address
from .protocol import FUNCTION_KEYS, MAX_ANNOUNCED, MAX_MESSAGE_BYTES, MAX_REPLY_BYTES, MAX_TENSOR_BYTES, MAX_TENSORS, \
    WeightUpdateRejected, check_reply, check_seconds, encode, error_text, item_metadata
from .shm import SharedBuffer

DEFAULT_BUCKET_BYTES = 512 << 20
# Shared tensors take no buffer, so their buckets bound only the message: one round trip per
# SHARED_BUCKET_BYTES (steady updates in 512 MB, 1 GB and 2 GB buckets measured within 6% of each other).
SHARED_BUCKET_BYTES = 2 << 30
DEFAULT_TIMEOUT_S = 30  # how long one message waits for its reply: what a training step can afford to lose
ABORT_WAIT_S = 5  # how long 'abort' waits for its reply: it only tells a receiver that may be gone
BEGIN_RETRIES = 2  # 'begin' again after the receiver aborted an unfinished update to take this one


class WeightSender:
    """Trainer side: streams named tensors to a WeightReceiver in bounded buckets.

    Without `group`, CUDA tensors are shared as they are (IPC handles) and CPU tensors packed into
    shared memory; with a WeightUpdateGroup (this process its rank 0) buckets are broadcast.
    `timeout_s` bounds the wait for each reply (the first waits for the engine to call receive());
    a late reply raises WeightSyncTimeout, after which the sender is usable again."""

    def __init__(self, endpoint: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S,
                 group: WeightUpdateGroup | None = None):
        if group is not None and group.rank != 0:
            raise ValueError(f"the sender broadcasts, so it must be rank 0 of its group, not rank {group.rank}")
        if (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                or not 1 <= bucket_bytes <= MAX_TENSOR_BYTES):
            raise ValueError(f"bucket_bytes={bucket_bytes!r} is not allowed; an int from 1 to {MAX_TENSOR_BYTES} "
                             "(the send buffer holds this many bytes)")
        check_seconds("timeout_s", timeout_s)
        self.endpoint = check_endpoint(endpoint)
        if self.endpoint.startswith("ipc://"):
            check_ipc_directory(self.endpoint[len("ipc://"):])
        self.socket = self._connect()
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.group = group
        self.flat: torch.Tensor | None = None  # the reused send buffer ...
        self.shared = None  # ... and, without a group, the SharedBuffer that shares it
        self._shares = ShareBook()

    def _connect(self) -> zmq.Socket:
        socket = zmq.Context.instance().socket(zmq.REQ)
        # Relaxed and correlated: after a reply times out the next request may go, and a late reply to an
        # earlier one is dropped rather than taken for the answer to the next. Immediate: requests go only
        # to a live connection, not onto the pipe of a receiver that has gone.
        socket.setsockopt(zmq.REQ_RELAXED, 1)
        socket.setsockopt(zmq.REQ_CORRELATE, 1)
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        use_ipv6(socket, self.endpoint)
        try:
            socket.connect(zmq_address(self.endpoint))
            check_bound(socket, self.endpoint)
        except BaseException:
            socket.close()
            raise
        return socket

    def _ask(self, raw: bytes, op: str, timeout_s: float | None = None) -> dict:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self.socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))  # waits for a live connection (IMMEDIATE)
        try:
            self.socket.send(raw)
        except zmq.Again:
            raise WeightSyncTimeout(f"no weight receiver at {self.endpoint} was connected to take '{op}' within "
                                    f"{timeout_s:g} s (is the engine's WeightReceiver running?)") from None
        if not self.socket.poll(int(timeout_s * 1000), zmq.POLLIN):
            hint = (" (is the engine calling receive()? A receiver that restarted at this endpoint can lose 'begin': "
                    "send again)") if op == "begin" else ""
            raise WeightSyncTimeout(f"the weight receiver at {self.endpoint} did not answer '{op}' within "
                                    f"{timeout_s:g} s{hint}")
        return check_reply(self.socket.recv())

    def _buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The send buffer, (re)allocated when it is too small or on another device."""
        if self.flat is None or self.flat.device != device or self.flat.numel() < nbytes:
            self._release()
            nbytes = max(nbytes, self.bucket_bytes)
            if self.group is not None:
                self.flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
            else:
                self.shared = SharedBuffer(nbytes)
                self.flat = self.shared.tensor
        return self.flat

    def _pack(self, group: list) -> tuple[torch.Tensor, list[dict]]:
        """Copy one bucket's tensors into the send buffer; the bytes used, and their metadata."""
        meta, end = [], 0
        for name, t in group:
            meta.append(item_metadata(name, t) | {"offset": end})
            end += padded(t.nbytes)
        device = self.group.device if self.group is not None else group[0][1].device
        flat = self._buffer(end, device)
        if self.shared is not None:
            self.shared.reserve(end)
        views = [flat[m["offset"] : m["offset"] + t.nbytes].view(t.dtype).view(t.shape)
                 for m, (_, t) in zip(meta, group)]
        get_ops(device).copy_many(views, [t for _, t in group])
        return flat[:end], meta

    @torch.no_grad()  # packing copies parameters: no autograd history (cheaper than detaching each)
    def send(self, named_tensors, version: int | None = None, manifest=None, config=None) -> int:
        """One whole update; returns the engine's new weight version.

        `manifest`: (name, tensor) pairs of every tensor the update sends (only their names, shapes and dtypes are
        read: a sharded parameter's whole shape, nothing gathered), announced in 'begin'. It makes the update a
        whole model's: the engine refuses it before any copy unless the tensors fit its weights and cover all of
        them, and refuses its end unless each came (protocol.py). None: the update sends what it sends.
        `config`: the model's config (a transformers config or its dict), whose rope and RMSNorm settings the engine
        compares with its checkpoint's, refusing the update before any copy where they compute another function.

        The engine refusing something raises WeightUpdateRejected (a RuntimeError) with the engine's own
        message; any other error after 'begin' went out (the tensors' iterator raising, a tensor the
        protocol cannot carry, WeightSyncTimeout) is first reported to the receiver ('abort', which ends
        the update there at once), then re-raised as it is."""
        if self.socket.closed:
            raise EngineError(f"the weight sender to {self.endpoint} is closed; make a new one")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"version={version!r} is not allowed; None or an int >= 0")
        begin = {"op": "begin", "version": version} | ({} if manifest is None else {"tensors": announced(manifest)})
        if config is not None:
            begin["config"] = function_config(config)
        begin = _checked(encode(begin))  # refused here, before the receiver hears of the update
        # a state_dict's items; a bare tensor, or an iterable of anything but (name, tensor) pairs, is refused at
        # its first item, before 'begin' goes out
        named = named_pairs(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        first = next(named, None)
        named = itertools.chain([first] if first is not None else [], named)
        shared = self.group is None and first is not None and isinstance(first[1], torch.Tensor) and first[1].is_cuda
        bucket_bytes = max(self.bucket_bytes, SHARED_BUCKET_BYTES) if shared else self.bucket_bytes
        try:
            self._begin(begin)
            for position, group in enumerate(bounded(buckets(named, bucket_bytes))):
                if shared:
                    self._share(group, position)
                    continue
                flat, meta = self._pack(group)
                if self.group is not None:
                    message = {"op": "bucket", "nbytes": flat.numel(), "tensors": meta}
                    self._ask(_checked(encode(message)), "bucket")  # answered as the receiver joins
                    self.group.broadcast(flat)
                    self._ask(encode({"op": "sent"}), "sent")  # answered once the engine has copied it
                else:  # acknowledged once copied: the buffer is ours again then
                    message = {"op": "bucket", "handle": self.shared.handle, "tensors": meta}
                    self._ask(_checked(encode(message)), "bucket")
            version = self._ask(encode({"op": "end"}), "end")["version"]
        except BaseException as err:
            self._shares.forget()
            if not isinstance(err, WeightUpdateRejected):  # a rejection ended the update there already
                self._abort(err)
            raise
        self._shares.commit()
        return version

    def _begin(self, raw: bytes) -> None:
        for attempt in range(BEGIN_RETRIES + 1):
            try:
                self._ask(raw, "begin")
                return
            except WeightUpdateRejected as err:
                if not err.retry or attempt == BEGIN_RETRIES:
                    raise

    def _abort(self, err: BaseException) -> None:
        """Tell the receiver the update is over (it then stops waiting for it); best effort."""
        try:
            raw = encode({"op": "abort", "error": error_text(err)[:1000] + f" ({type(err).__name__} in the sender)"})
            self._ask(raw, "abort", timeout_s=min(self.timeout_s, ABORT_WAIT_S))
        except Exception:
            pass  # the original error is the one to report

    def _share(self, group: list, position: int) -> None:
        """A bucket of CUDA tensors, by reference: the receiver copies straight out of them. They must not
        change before send() returns (the last reply comes after every copy)."""
        if any(not isinstance(t, torch.Tensor) or not t.is_cuda for _, t in group):
            raise ValueError("one update mixes CUDA and CPU tensors; send them from one device")
        torch.cuda.synchronize(group[0][1].device)  # the receiver reads them on its own stream
        self._ask(_checked(self._shares.message(group, position)), "bucket")

    def _release(self) -> None:
        self.flat = None
        if self.shared is not None:
            self.shared.close()
            self.shared = None

    def close(self) -> None:
        self._release()
        self.socket.close()

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def announced(manifest) -> list[dict]:
    """'begin's field 'tensors' for `manifest`, (name, tensor) pairs; ValueError before anything is sent."""
    pairs = named_pairs(manifest.items() if isinstance(manifest, Mapping) else manifest, "manifest")
    items = [item_metadata(name, t) for name, t in pairs]
    if not 1 <= len(items) <= MAX_ANNOUNCED:
        raise ValueError(f"manifest names {len(items)} tensors; an update announces 1 to {MAX_ANNOUNCED}")
    return items


def function_config(config) -> dict:
    """'begin's field 'config': the FUNCTION_KEYS of a transformers config (or its dict) that it sets."""
    raw = config.to_dict() if callable(getattr(config, "to_dict", None)) else config
    if not isinstance(raw, Mapping):
        raise ValueError(f"config must be a transformers config or a dict, got {type(config).__name__}")
    return {key: raw[key] for key in FUNCTION_KEYS if raw.get(key) is not None}


def bounded(groups):
    """Buckets of at most MAX_TENSORS tensors (many tiny tensors would otherwise make one huge message)."""
    for group in groups:
        for start in range(0, len(group), MAX_TENSORS):
            yield group[start : start + MAX_TENSORS]


def _checked(raw: bytes) -> bytes:
    """A message within the receiver's bound, which drops a larger one with its connection: a bucket's cannot
    pass it (MAX_TENSORS items of at most ITEM_BYTES), an announcement of many long names can."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ValueError(f"a message of {len(raw)} bytes exceeds the protocol's {MAX_MESSAGE_BYTES} (an announced "
                         "update's 'begin' names every tensor: announce fewer, or send without a manifest)")
    return raw
