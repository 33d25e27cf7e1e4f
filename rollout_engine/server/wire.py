"""The messages between the server's HTTP front and its engine process: a JSON header, then raw numeric frames.

A message is one ZeroMQ multipart message: frame 0 is a JSON object (UTF-8); if it names `columns`, one frame
follows per name, the little-endian array of that column (its dtype fixed by COLUMNS, never read from the
message). No pickle crosses the socket, and each side's receiving socket refuses messages over MAX_MESSAGE_BYTES.

Per engine step the engine sends one "tokens" message for every sample that grew: the columns `keys`,
`indices`, `counts` (one row per sample: its request, its sample index, how many new tokens) and the per-token
columns `token_ids`, `logprobs`, `weight_versions` (the samples' new tokens, concatenated in row order), and, when a
sample in the message asks for k >= 1 alternatives (`SamplingParams.logprobs`), `top_k` (one row per sample: its
k, 0 if none) and `top_ids`, `top_logprobs` (k per new token of those samples, in the same order).

A request that scores its prompt (`SamplingParams.prompt_logprobs`) sends the scores once, ahead of the "tokens"
message with its first tokens, in "prompt_scores" messages (its `key`, and `positions`: the prompt's tokens but
the first) of at most PROMPT_ENTRIES entries each, so that no prompt's length makes a message too large:
`prompt_sizes` (one row per position: its entries, the prompt token's first), `prompt_ids`, `prompt_logprobs`
(the entries, concatenated). The positions come in order.
"""
from __future__ import annotations

import json

import numpy as np

from .. import errors

MAX_MESSAGE_BYTES = 64 << 20
COLUMNS = {"keys": "<i8", "indices": "<i8", "counts": "<i8",
           "token_ids": "<i8", "logprobs": "<f8", "weight_versions": "<i8", "top_k": "<i8", "top_ids": "<i8",
           "top_logprobs": "<f8", "prompt_sizes": "<i8", "prompt_ids": "<i8", "prompt_logprobs": "<f8"}
PROMPT_ENTRIES = MAX_MESSAGE_BYTES // 64  # a prompt_scores message's entries: 16 bytes each, a quarter of the limit


def pack(header: dict, columns: dict[str, list] | None = None) -> list[bytes]:
    """The frames of a message: `header` as JSON, then each column's array."""
    columns = columns or {}
    frames = [json.dumps({**header, "columns": list(columns)} if columns else header,
                         separators=(",", ":")).encode()]
    frames += [np.asarray(values, dtype=COLUMNS[name]).tobytes() for name, values in columns.items()]
    return frames


def unpack(frames: list[bytes]) -> tuple[dict, dict[str, list]]:
    """(header, columns) of a message; ValueError, saying what is wrong, for anything malformed."""
    if not frames:
        raise ValueError("an empty message")
    try:
        header = json.loads(frames[0])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"the header is not JSON: {err}") from None
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise ValueError("the header must be a JSON object with a string 'kind'")
    names = header.get("columns", [])
    if not isinstance(names, list) or len(frames) != 1 + len(names):
        raise ValueError(f"the header names columns {names!r} but {len(frames) - 1} frames follow it")
    columns = {}
    for name, frame in zip(names, frames[1:]):
        if not isinstance(name, str) or name not in COLUMNS:
            raise ValueError(f"unknown column {name!r}; columns are {sorted(COLUMNS)}")
        dtype = np.dtype(COLUMNS[name])
        if len(frame) % dtype.itemsize:
            raise ValueError(f"column {name!r} is not a whole number of {dtype} values")
        columns[name] = np.frombuffer(frame, dtype).tolist()
    return header, columns


def error_fields(err: BaseException) -> dict:
    """An exception as JSON: its class name and message."""
    name = "ValueError" if isinstance(err, (ValueError, TypeError)) else type(err).__name__
    return {"type": name, "message": str(err)}


def error_from(fields) -> Exception:
    """The exception that `error_fields` described: ValueError, an EngineError subclass, else RuntimeError."""
    fields = fields if isinstance(fields, dict) else {}
    name, message = str(fields.get("type")), str(fields.get("message"))
    if name == "ValueError":
        return ValueError(message)
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.EngineError):
        try:
            return cls(message)
        except TypeError:  # a subclass built from other arguments
            return errors.EngineError(message)
    return RuntimeError(f"{name} in the engine process: {message}")
