"""The control messages between WeightSender and WeightReceiver, and the bounds on them.

Every message is one ZeroMQ frame holding one JSON object (never pickle). The receiver checks each
field before it acts on a message: any local process can reach its socket, and a malformed message
must cost it one error reply, not its state. Messages (sender -> receiver):

    {"op": "begin", "version": null | int,           an update starts; with "tensors" (each {"name", "dtype",
     "tensors": [{"name", "dtype", "shape"}, ...],    "shape"}) a whole one: announced, every tensor it sends;
     "config": {key: value}}                          with "config" the model config's FUNCTION_KEYS
    {"op": "bucket", "tensors": [item, ...], ...}     one bucket, three ways (see check_bucket)
    {"op": "sent"}                                    a broadcast bucket's broadcast is done (below)
    {"op": "end"}                                     the update is complete
    {"op": "abort", "error": str}                     the sender gave up on the update

and each gets one reply {"ok": true, ...} or {"ok": false, "error": str} (with "retry": true when a
'begin' found an unfinished update, which it aborted: the sender then sends 'begin' again). An 'abort'
while no update is in progress is answered ok and changes nothing: its sender timed out on a message
that was lost (ZeroMQ can lose one to a receiver that has just closed) and has already given up.

An announced update (a whole model's weights, as trainer_adapters.sync_weights sends them) is checked whole at
'begin' against the engine's weights (announcement.py): each name, shape and dtype, and that together they cover
every weight the engine holds; its buckets may carry only announced names, and 'end' is refused unless each of them
came. So a model the engine cannot take is refused before any copy, and a stream that stops short is never
served. A 'begin' with "config" (the trainer model's embedding tie, rope and RMSNorm settings) is refused where
these make the same weights compute another function than the engine's checkpoint does
(ModelConfig.check_same_function). Both are checked once the engine has taken the update (awake, its version
accepted). Without "tensors", an update sends what it sends (some of the weights, say) and is checked bucket by
bucket.

A broadcast bucket takes two round trips: the receiver answers 'bucket' once it has checked it, and
joins the broadcast; the sender broadcasts only after that answer, then sends 'sent', which is answered
once the engine has copied the bucket. So a receiver that refuses a bucket, or is not there to read it,
costs the sender an error reply or its message timeout, never a broadcast nobody joins (that waits for
the group's timeout, and NCCL's watchdog then ends the process).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from ..errors import WeightUpdateAborted, WeightUpdateRejected  # noqa: F401 - part of the protocol's vocabulary
from ..weights import ALIGN

DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16)}

# A bucket message is the largest message: at most MAX_TENSORS items of at most ITEM_BYTES each. An item is
# a name (MAX_NAME_CHARS, at most 6 bytes a character once JSON-escaped), up to MAX_DIMS dims of shape and
# stride, offsets, and for a fresh CUDA share its IPC handle (about 300 bytes): well under ITEM_BYTES.
MAX_TENSORS = 1024
MAX_ANNOUNCED = 16 * MAX_TENSORS  # 'begin' names every tensor of a model (an 8B one has 399): about 100 bytes each
MAX_NAME_CHARS = 256
MAX_DIMS = 8
ITEM_BYTES = 4096
MAX_MESSAGE_BYTES = MAX_TENSORS * ITEM_BYTES + 4096  # the receiver's zmq.MAXMSGSIZE
MAX_ERROR_CHARS = 8192
MAX_REPLY_BYTES = 6 * MAX_ERROR_CHARS + 4096  # the sender's zmq.MAXMSGSIZE: an error reply, escaped
MAX_TENSOR_BYTES = 1 << 40  # no weight tensor comes near; bounds what a bucket's metadata can make us allocate
OPS = ("begin", "bucket", "sent", "end", "abort")
# What of a model's config a 'begin' may carry: what decides the function its weights compute beyond their shapes.
FUNCTION_KEYS = ("tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps",
                 "max_position_embeddings", "original_max_position_embeddings")


@dataclass
class Incoming:
    """One message as the receiver's ROUTER socket gave it: who sent it, the envelope a reply goes back with, the
    body."""

    peer: bytes
    envelope: list[bytes]
    body: list[bytes]

    @classmethod
    def split(cls, frames: list[bytes]) -> Incoming:
        # A REQ peer's body follows an empty delimiter frame (with REQ_CORRELATE, after a request id too);
        # a DEALER's may come straight after the peer's identity.
        for i in range(1, len(frames)):
            if not frames[i]:
                return cls(frames[0], frames[: i + 1], frames[i + 1 :])
        return cls(frames[0], frames[:1], frames[1:])


def encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def error_text(err: BaseException) -> str:
    text = str(err) or type(err).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _json_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def decode(frames: list[bytes]) -> dict:
    """The message in `frames` (what followed the envelope), checked; ValueError naming what is wrong."""
    if len(frames) != 1:
        raise ValueError(f"a message is exactly one frame (one JSON object), got {len(frames)} frames")
    try:
        text = frames[0].decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"message is not UTF-8 ({err.reason} at byte {err.start}); send one JSON object") from None
    try:
        message = json.loads(text, parse_constant=_json_constant)
    except (ValueError, RecursionError) as err:
        raise ValueError(f"message is not valid JSON ({err}); send one JSON object") from None
    if not isinstance(message, dict):
        raise ValueError(f"message must be a JSON object with field 'op', got a JSON {type(message).__name__}")
    op = message.get("op")
    if op not in OPS:
        raise ValueError(f"field 'op' is {_short(op)}; allowed: {', '.join(OPS)}")
    if op == "begin":
        _fields(message, {"op"}, {"version", "tensors", "config"})
        version = message.get("version")
        if version is not None and not _is_int(version, 0):
            raise ValueError(f"field 'version' must be null or an int >= 0, got {_short(version)}")
        message.setdefault("version", None)
        if "tensors" in message:
            _check_items(message["tensors"], MAX_ANNOUNCED, ({"name", "dtype", "shape"}, set()))
        if "config" in message:  # its values: checked as a checkpoint's are, by the engine's config
            if not isinstance(message["config"], dict):
                raise ValueError(f"field 'config' must be an object, got {_short(message['config'])}")
            _fields(message["config"], set(), set(FUNCTION_KEYS), where="field 'config'")
    elif op == "abort":
        _fields(message, {"op", "error"})
        if not isinstance(message["error"], str):
            raise ValueError(f"field 'error' of 'abort' must be a string, got {_short(message['error'])}")
    elif op in ("sent", "end"):
        _fields(message, {"op"})
    else:
        check_bucket(message)
    return message


def bucket_kind(message: dict) -> str:
    """How a checked bucket travels: "shm" (a shared-memory handle), "broadcast" (nbytes, then a
    broadcast over the weight-update group) or "shared" (CUDA storages, no buffer)."""
    return "shm" if "handle" in message else "broadcast" if "nbytes" in message else "shared"


PACKED_ITEM = ({"name", "dtype", "shape", "offset"}, set())
SHARED_ITEM = ({"name", "dtype", "shape", "stride", "storage_offset", "storage"}, {"cuda"})


def check_bucket(message: dict) -> None:
    if "handle" in message and "nbytes" in message:
        raise ValueError("a bucket has field 'handle' (shared memory) or 'nbytes' (broadcast), not both")
    kind = bucket_kind(message)
    _fields(message, {"op", "tensors"} | {"shm": {"handle"}, "broadcast": {"nbytes"}, "shared": set()}[kind])
    tensors = message["tensors"]
    _check_items(tensors, MAX_TENSORS, SHARED_ITEM if kind == "shared" else PACKED_ITEM)
    for i, item in enumerate(tensors):
        where, name = f"tensors[{i}]", item["name"]
        if kind == "shared":
            _check_shared_item(item, where)
        elif not _is_int(item["offset"], 0) or item["offset"] % ALIGN:
            raise ValueError(f"field '{where}.offset' of weight {name!r} must be an int >= 0, a multiple of "
                             f"{ALIGN}, got {_short(item['offset'])}")
    if kind == "shm":
        handle = message["handle"]
        if not (isinstance(handle, dict) and set(handle) == {"shm"} and isinstance(handle["shm"], str)):
            raise ValueError(f"field 'handle' must be {{\"shm\": <segment name>}}, got {_short(handle)}")
    elif kind == "broadcast":
        need = sum(tensor_nbytes(item) for item in tensors) + ALIGN * len(tensors)
        if not _is_int(message["nbytes"], 1) or message["nbytes"] > need:
            raise ValueError(f"field 'nbytes' must be an int from 1 to {need} (what the bucket's tensors take, "
                             f"padded), got {_short(message['nbytes'])}")


def _check_items(tensors, most: int, fields: tuple[set, set]) -> None:
    """Field 'tensors': a list of 1 to `most` objects with `fields` (required, optional), each naming a weight
    of a dtype the transport moves and a bounded shape."""
    if not isinstance(tensors, list) or not 1 <= len(tensors) <= most:
        raise ValueError(f"field 'tensors' must be a list of 1 to {most} items, got {_short(tensors)}")
    for i, item in enumerate(tensors):
        where = f"tensors[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"field {where!r} must be an object, got {_short(item)}")
        _fields(item, *fields, where=where)
        name = item["name"]
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS:
            raise ValueError(f"field '{where}.name' must be a string of 1 to {MAX_NAME_CHARS} characters, "
                             f"got {_short(name)}")
        if item["dtype"] not in DTYPES:
            raise ValueError(f"field '{where}.dtype' of weight {name!r} is {_short(item['dtype'])}; "
                             f"allowed: {sorted(DTYPES)}")
        shape = item["shape"]
        if not _int_list(shape, 0) or math.prod(shape) * DTYPES[item["dtype"]].itemsize > MAX_TENSOR_BYTES:
            raise ValueError(f"field '{where}.shape' of weight {name!r} must be a list of at most {MAX_DIMS} "
                             f"ints >= 0 (under {MAX_TENSOR_BYTES} bytes in all), got {_short(shape)}")


def _check_shared_item(item: dict, where: str) -> None:
    name, shape, stride = item["name"], item["shape"], item["stride"]
    if not _int_list(stride, 0) or len(stride) != len(shape):
        raise ValueError(f"field '{where}.stride' of weight {name!r} must be a list of ints >= 0, one per "
                         f"dim of shape {shape}, got {_short(stride)}")
    storage = item["storage"]
    if not (isinstance(storage, list) and len(storage) == 2 and all(_is_int(v, 0) for v in storage)):
        raise ValueError(f"field '{where}.storage' of weight {name!r} must be [address, nbytes], "
                         f"got {_short(storage)}")
    if not _is_int(item["storage_offset"], 0):
        raise ValueError(f"field '{where}.storage_offset' of weight {name!r} must be an int >= 0, "
                         f"got {_short(item['storage_offset'])}")
    if (storage_elements(item) + item["storage_offset"]) * DTYPES[item["dtype"]].itemsize > storage[1]:
        raise ValueError(f"weight {name!r} (field '{where}'): shape {shape}, stride {stride} and storage_offset "
                         f"{item['storage_offset']} reach past the storage's {storage[1]} bytes")
    if "cuda" in item and not (isinstance(item["cuda"], list) and len(item["cuda"]) == 8
                               and all(isinstance(f, (str, int, bool)) for f in item["cuda"])):
        raise ValueError(f"field '{where}.cuda' of weight {name!r} must be a CUDA IPC handle (8 fields)")


def storage_elements(item: dict) -> int:
    """Elements of the storage a strided view spans (0 for an empty tensor)."""
    if 0 in item["shape"]:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(item["shape"], item["stride"]))


MAX_WAIT_S = 86400  # a day: a longer wait is a mistake, and ZeroMQ's poll takes milliseconds as a C int


def check_seconds(name: str, value, none_allowed: bool = False, zero_allowed: bool = False) -> None:
    """A wait in seconds: a finite number > 0 (>= 0 with `zero_allowed`) and at most a day; None where allowed."""
    if value is None and none_allowed:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (0 <= value if zero_allowed else 0 < value) and value <= MAX_WAIT_S):
        raise ValueError(f"{name}={value!r} is not allowed; {'None or ' if none_allowed else ''}seconds, "
                         f"{'>=' if zero_allowed else '>'} 0 and at most a day")


def tensor_nbytes(item: dict) -> int:
    return DTYPES[item["dtype"]].itemsize * math.prod(item["shape"])


def check_fits(items: list[dict], nbytes: int, what: str) -> None:
    """Every packed item lies inside the `nbytes` of its buffer."""
    for i, item in enumerate(items):
        end = item["offset"] + tensor_nbytes(item)
        if end > nbytes:
            raise ValueError(f"field 'tensors[{i}].offset' of weight {item['name']!r}: bytes {item['offset']} to "
                             f"{end} (shape {item['shape']}) lie past the end of {what} ({nbytes} bytes)")


def view(flat: torch.Tensor, item: dict) -> tuple[str, torch.Tensor]:
    """(name, tensor) of one checked packed item: a view into its bucket's bytes."""
    start = item["offset"]
    return item["name"], flat[start : start + tensor_nbytes(item)].view(DTYPES[item["dtype"]]).view(item["shape"])


def item_metadata(name: str, t: torch.Tensor) -> dict:
    """The fields every item has, checked on the sender's side against the bounds the receiver enforces."""
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS:
        raise ValueError(f"weight name {_short(name)} is not allowed; a string of 1 to {MAX_NAME_CHARS} characters")
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"weight {name!r} must be a tensor, got {type(t).__name__}")
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"weight {name!r} has dtype {dtype}; the transport moves {sorted(DTYPES)}")
    if t.dim() > MAX_DIMS:
        raise ValueError(f"weight {name!r} has {t.dim()} dims; the transport moves at most {MAX_DIMS}")
    return {"name": name, "dtype": dtype, "shape": list(t.shape)}


def check_reply(raw: bytes) -> dict:
    """A reply from the receiver, checked; WeightUpdateRejected for an error reply."""
    try:
        reply = json.loads(raw)
    except (ValueError, RecursionError):
        reply = None
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise WeightUpdateRejected(f"malformed reply {raw[:200]!r}")
    if not reply["ok"]:
        raise WeightUpdateRejected(str(reply.get("error")), retry=reply.get("retry") is True)
    return reply


def _fields(obj: dict, required: set, optional: set = frozenset(), where: str = "message") -> None:
    missing = sorted(required - set(obj))
    if missing:
        raise ValueError(f"{where} lacks field {missing[0]!r} (op {obj.get('op', '?')!r} needs {sorted(required)})")
    extra = sorted(set(obj) - required - optional)
    if extra:
        raise ValueError(f"{where} has unknown field {extra[0][:80]!r}; allowed: {sorted(required | optional)}")


def _is_int(value, low: int) -> bool:
    return type(value) is int and value >= low


def _int_list(value, low: int) -> bool:
    return isinstance(value, list) and len(value) <= MAX_DIMS and all(_is_int(v, low) and v < 1 << 40 for v in value)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
