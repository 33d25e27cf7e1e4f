"""The argparse `type=` functions of the `rollout-engine` command (cli.py): each refuses a bad value while the
arguments are parsed, naming what is allowed, so that no command loads a model or trains before it fails."""
from __future__ import annotations

import argparse
import math
import os
import urllib.parse

from rollout_engine.config_checks import DTYPES, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, QUANTIZATIONS
from rollout_engine.sampling_params import MAX_N, SEED_LIMIT, SEED_RANGE

ENGINE_DTYPES = ("auto", *DTYPES)  # the Engine's dtype names ("auto": the checkpoint's on CUDA, else float32)
# make-tiny-model's attention heads (tiny_model's default, with 2 KV heads): --hidden-size is split among them
TINY_MODEL_HEADS = 4


def _refused(value: str, allowed: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{value!r} is not allowed; {allowed}")


def integer(low: int, below: int | None = None, allowed: str | None = None):
    """An argparse type: an int >= `low` (and < `below`, given one); `allowed` words the range for the error."""
    allowed = allowed or (f"an int >= {low}" if below is None else f"an int in [{low}, {below})")

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise _refused(value, allowed) from None
        if number < low or (below is not None and number >= below):
            raise _refused(value, allowed)
        return number
    return parse


def number(zero_allowed: bool, inf_allowed: bool = False, unit: str = "number"):
    """An argparse type: a float > 0 or, with `zero_allowed`, >= 0; finite unless `inf_allowed`; never NaN."""
    bound = ">= 0" if zero_allowed else "> 0"
    allowed = f"a {unit} {bound} (or inf)" if inf_allowed else f"a finite {unit} {bound}"

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            x = math.nan  # NaN fails both bounds below
        if not (x >= 0 if zero_allowed else x > 0) or (math.isinf(x) and not inf_allowed):
            raise _refused(value, allowed)
        return x
    return parse


POSITIVE_INT = integer(1)
NON_NEGATIVE_INT = integer(0)
SEED = integer(0, SEED_LIMIT, SEED_RANGE)  # SamplingParams' range, which the engine's seeds share
SAMPLES_PER_PROMPT = integer(1, MAX_N + 1, f"an int in [1, {MAX_N}]")  # SamplingParams' n
MAX_NUM_SEQS_ARG = integer(1, MAX_NUM_SEQS + 1, f"an int in [1, {MAX_NUM_SEQS}]")  # the Engine's ranges
MAX_NUM_BATCHED_TOKENS_ARG = integer(1, MAX_NUM_BATCHED_TOKENS + 1, f"an int in [1, {MAX_NUM_BATCHED_TOKENS}]")


def milliseconds(zero_allowed: bool):
    """An argparse type: finite milliseconds, > 0 (sys.setswitchinterval refuses 0 and below, and takes inf as
    0) or, with `zero_allowed`, >= 0 (a stream's chunk interval: 0 is a chunk per engine step)."""
    return number(zero_allowed, unit="number of milliseconds")


SWITCH_INTERVAL_MS = (1e-3, 1e6)  # sys.setswitchinterval counts whole microseconds, in a C long of them


def switch_interval_ms(value: str) -> float:
    """--switch-interval-ms: Python's thread switch interval, in [1 us, 1,000 s]. Below a microsecond (or past
    about 1.8e16 ms) sys.setswitchinterval keeps 0: the most frequent switching, the opposite of what was asked."""
    low, high = SWITCH_INTERVAL_MS
    allowed = f"a number of milliseconds in [{low}, {high:g}]"
    x = milliseconds(zero_allowed=False)(value)
    if not low <= x <= high:
        raise _refused(value, allowed)
    return x


def check_switch_interval_s(seconds) -> None:
    """EngineClient's switch_interval_s: None, or seconds within SWITCH_INTERVAL_MS (refused before the engine
    process starts, whose sys.setswitchinterval would refuse it or keep 0)."""
    low, high = SWITCH_INTERVAL_MS
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                or not low / 1e3 <= seconds <= high / 1e3):
        raise ValueError(f"switch_interval_s={seconds!r} is not allowed; a number of seconds in [{low / 1e3:g}, "
                         f"{high / 1e3:g}] (Python's thread switch interval), or None")


def tiny_hidden_size(value: str) -> int:
    """make-tiny-model's --hidden-size: TINY_MODEL_HEADS equal heads (head_dim = hidden size / heads), each of an
    even head_dim, which rotary embeddings need (transformers refuses an odd one)."""
    step = 2 * TINY_MODEL_HEADS
    allowed = f"a positive multiple of {step} ({TINY_MODEL_HEADS} heads of an even head_dim)"
    size = integer(1, allowed=allowed)(value)
    if size % step:
        raise _refused(value, allowed)
    return size


def output_dir(value: str) -> str:
    """A directory to write into, made if missing: it, or else the nearest part of its path that exists, must be
    a directory, or the command would fail only after its work (os.path never raises, unlike Path.exists)."""
    path = os.path.abspath(value)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise _refused(value, f"a directory to write into ({path} exists and is not a directory)")
    return value


def weight_format(name: str, auto_allowed: bool = False):
    """An argparse type for a weight format (the Engine argument `name`): 'none' (any case) is None, the
    model's own dtype, as the Engine takes it; else one of the Engine's QUANTIZATIONS, or with `auto_allowed`
    'auto' (as --quantization). The message names `name` as the Engine's own refusal does."""
    formats = ("auto",) * auto_allowed + QUANTIZATIONS

    def parse(value: str):
        if value.lower() == "none":
            return None
        if value not in formats:
            raise argparse.ArgumentTypeError(f"{name}={value!r} is not supported; allowed: 'none', "
                                             + ", ".join(map(repr, formats)))
        return value
    return parse


# A TCP port (0: one the system picks), checked before the engine loads rather than by uvicorn after it has
PORT = integer(0, 65536, "a port number 0-65535")


def kv_cache_memory(value: str):
    """A fraction of free memory in (0, 1] ("0.3") or bytes > 0 ("2000000000", "2e9": a whole number above 1 is
    bytes, however written), as the Engine takes them."""
    allowed = ("a fraction of free device memory in (0, 1] (e.g. 0.3) or a whole number of bytes (e.g. 2000000000 "
               "or 2e9)")
    try:
        amount = int(value) if not any(c in value for c in ".eE") else float(value)
    except ValueError:
        raise _refused(value, allowed) from None
    if isinstance(amount, float) and amount > 1 and amount.is_integer():
        amount = int(amount)
    if not amount > 0 or (isinstance(amount, float) and amount > 1):  # NaN fails amount > 0
        raise _refused(value, allowed)
    return amount


DEFAULT_PORTS = {"http": 80, "https": 443}


def origin(value: str) -> str:
    """A web page's origin as browsers send it in `Origin` (scheme://host[:port]: lower case, the host in IDNA
    ASCII, no default port, no path), which the server compares exactly: a value that could never match would
    leave the page refused with no hint why."""
    parts = urllib.parse.urlsplit(value.strip())
    try:
        given_port, host = parts.port, (parts.hostname or "").encode("idna").decode("ascii")
    except (ValueError, UnicodeError):
        given_port = host = None
    scheme = parts.scheme.lower()
    if not host or scheme not in DEFAULT_PORTS or parts.path not in ("", "/") or parts.query or parts.fragment \
            or parts.username or parts.password or parts.netloc.endswith(":"):
        raise _refused(value, "an exact web origin, scheme://host[:port] (e.g. http://localhost:3000), with no "
                              "path ('*' is not taken)")
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}" + (f":{given_port}" if given_port not in (None, DEFAULT_PORTS[scheme]) else "")
