"""Bad input and misuse of the weight transport, one table: each case must raise the right error, name
what was wrong, answer every raw message it consumed, and leave the receiver and engine usable (the old
weights serve if nothing was copied; a valid update then serves exactly the new weights)."""
import math
import json
import re
import threading
from dataclasses import dataclass
from multiprocessing import shared_memory

import pytest
import torch
import zmq
from helpers import GREEDY, hf_greedy, make_prompts

from rollout_engine import Engine, WeightsNotReadyError, WeightSyncTimeout
from rollout_engine.transport import WeightReceiver, WeightSender, WeightUpdateAborted, check_endpoint
from rollout_engine.transport.protocol import MAX_MESSAGE_BYTES, MAX_TENSORS

IDS = make_prompts()[1]
REFERENCE = {}  # seed -> transformers' greedy tokens for IDS


@dataclass
class Case:
    id: str
    run: object  # (Ctx) -> None; raises
    error: type
    match: str  # the offending argument or field, as the message names it
    replies: bool = False  # a raw client: its last reply is an error naming `match` too
    copied: bool = False  # the engine copied part of an update: it refuses until a complete one


class Ctx:
    def __init__(self, engine, receiver, models, tmp_path):
        self.engine, self.receiver, self.models, self.tmp_path = engine, receiver, models, tmp_path
        self.serving = 0
        self.replies: list[dict] = []
        self.closing: list = []
        self.segment = shared_memory.SharedMemory(create=True, size=4096)  # a sender's bucket, by hand

    def raw(self, *bodies):
        """Send `bodies` (bytes, dicts, or lists of frames) from a raw DEALER, then serve one receive()."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.receiver.endpoint)
        try:
            for body in bodies:
                if isinstance(body, dict):
                    body = json.dumps(body).encode()
                frames = body if isinstance(body, list) else [body]
                sock.send_multipart([b""] + frames)
            try:
                self.receiver.receive(begin_timeout_s=3)
            finally:
                while sock.poll(300):
                    self.replies.append(json.loads(sock.recv_multipart()[-1]))
        finally:
            sock.close()

    def sender(self):
        sender = WeightSender(self.receiver.endpoint)
        self.closing.append(sender)
        return sender

    def bucket(self, *items, **fields):
        return {"op": "bucket", "handle": {"shm": self.segment.name}, "tensors": list(items)} | fields

    def close(self):
        for sender in self.closing:
            sender.close()
        self.segment.close()
        self.segment.unlink()


def item(name="model.norm.weight", dtype="float32", shape=(64,), offset=0):
    return {"name": name, "dtype": dtype, "shape": list(shape), "offset": offset}


def embedding(ctx):
    """The embedding as a sender would describe it: its real shape, more bytes than the test's 4 KiB segment."""
    return item("model.embed_tokens.weight", shape=ctx.models[1].get_input_embeddings().weight.shape)


BEGIN = {"op": "begin", "version": None}


def endpoint_case(id, endpoint, match=None):
    return Case(id, lambda c: check_endpoint(endpoint), ValueError, match or "endpoint=")


def send_in_thread(ctx, named, **kwargs):
    result = {}

    def run():
        sender = WeightSender(ctx.receiver.endpoint, bucket_bytes=64 << 10, timeout_s=10, **kwargs)
        try:
            result["version"] = sender.send(named)
        except Exception as err:
            result["error"] = err
        finally:
            sender.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def sender_bad_name(ctx):
    """The sender refuses a name the protocol cannot carry, and aborts the update it began."""
    thread, result = send_in_thread(ctx, [("x" * 300, torch.zeros(4))])
    with pytest.raises(WeightUpdateAborted, match="weight name"):
        ctx.receiver.receive(begin_timeout_s=10)
    thread.join(10)
    raise result["error"]


def second_receiver(ctx):
    WeightReceiver(ctx.engine, ctx.receiver.endpoint)


CASES = [
    # endpoints
    endpoint_case("semicolon-source-trick", "tcp://127.0.0.1:5601;0.0.0.0:5602"),
    endpoint_case("all-interfaces", "tcp://0.0.0.0:5555"),
    endpoint_case("wildcard-host", "tcp://*:5555"),
    endpoint_case("wildcard-port", "tcp://127.0.0.1:*"),
    endpoint_case("hostname", "tcp://example.com:5555"),
    endpoint_case("interface-name", "tcp://lo:5555"),
    endpoint_case("hex-port", "tcp://127.0.0.1:0x10"),
    endpoint_case("port-0-connect", "tcp://127.0.0.1:0"),
    endpoint_case("port-70000", "tcp://127.0.0.1:70000"),
    endpoint_case("relative-ipc", "ipc://weights", match="absolute"),
    endpoint_case("ipc-wildcard", "ipc://*"),
    endpoint_case("ipc-too-long", "ipc:///" + "d" * 120, match="at most 107 bytes"),
    endpoint_case("non-str", 5555),
    endpoint_case("bytes", b"tcp://127.0.0.1:5555"),
    endpoint_case("inproc", "inproc://weights"),
    Case("sender-port-0", lambda c: WeightSender("tcp://127.0.0.1:0"), ValueError, "endpoint="),
    Case("ipc-in-world-writable-dir", lambda c: WeightReceiver(c.engine, "ipc:///tmp/rollout-weights"), ValueError,
         "writable by nobody else"),
    Case("second-receiver-on-live-path", second_receiver, ValueError, "is in use"),
    # arguments
    Case("bucket-bytes-0", lambda c: WeightSender(c.receiver.endpoint, bucket_bytes=0), ValueError, "bucket_bytes"),
    # a send buffer no machine holds: a bare OSError from shared memory at the first send before
    Case("bucket-bytes-2**62", lambda c: WeightSender(c.receiver.endpoint, bucket_bytes=2 ** 62), ValueError,
         "bucket_bytes"),
    Case("timeout-0", lambda c: WeightReceiver(c.engine, timeout_s=0), ValueError, "timeout_s"),
    # no engine: the receiver bound a socket and failed only at its first update
    Case("receiver-engine-None", lambda c: WeightReceiver(None), ValueError, "engine must be an Engine.*NoneType"),
    Case("receiver-engine-str", lambda c: WeightReceiver("engine"), ValueError, "engine must be an Engine.*str"),
    Case("begin-timeout-negative", lambda c: c.receiver.receive(begin_timeout_s=-1), ValueError, "begin_timeout_s"),
    # past a day, inf and 1e20 overflowed ZeroMQ's poll (OverflowError); True was taken as 1 s
    Case("begin-timeout-inf", lambda c: c.receiver.receive(begin_timeout_s=math.inf), ValueError, "begin_timeout_s"),
    Case("begin-timeout-1e20", lambda c: c.receiver.receive(begin_timeout_s=1e20), ValueError, "begin_timeout_s"),
    Case("receiver-timeout-bool", lambda c: WeightReceiver(c.engine, timeout_s=True), ValueError, "timeout_s"),
    Case("sender-timeout-bool", lambda c: WeightSender(c.receiver.endpoint, timeout_s=True), ValueError, "timeout_s"),
    Case("send-version-negative", lambda c: c.sender().send([], version=-1), ValueError, "version"),
    Case("sender-name-too-long", sender_bad_name, ValueError, "weight name"),
    # raw frames to a live receiver
    Case("garbage-json", lambda c: c.raw(b"{oops"), ValueError, "not valid JSON", replies=True),
    Case("not-utf8", lambda c: c.raw(b"\xff\xfe{}"), ValueError, "not UTF-8", replies=True),
    Case("json-list", lambda c: c.raw(b"[1, 2]"), ValueError, "JSON object", replies=True),
    Case("json-nan", lambda c: c.raw(b'{"op": "begin", "version": NaN}'), ValueError, "NaN", replies=True),
    Case("deep-nesting", lambda c: c.raw(b"[" * 100_000), ValueError, "not valid JSON", replies=True),
    Case("empty-frame", lambda c: c.raw(b""), ValueError, "not valid JSON", replies=True),
    Case("no-frame", lambda c: c.raw([]), ValueError, "got 0 frames", replies=True),
    Case("multipart", lambda c: c.raw([json.dumps(BEGIN).encode(), b"x"]), ValueError, "got 2 frames", replies=True),
    Case("over-maxmsgsize", lambda c: c.raw(b" " * (MAX_MESSAGE_BYTES + 1)), WeightSyncTimeout, "'begin' message"),
    Case("missing-op", lambda c: c.raw({"version": 1}), ValueError, "field 'op'", replies=True),
    Case("unknown-op", lambda c: c.raw({"op": "load_pickle"}), ValueError, "field 'op'", replies=True),
    Case("version-string", lambda c: c.raw({"op": "begin", "version": "7"}), ValueError, "'version'", replies=True),
    Case("version-bool", lambda c: c.raw({"op": "begin", "version": True}), ValueError, "'version'", replies=True),
    Case("version-not-increasing", lambda c: c.raw({"op": "begin", "version": 0}), ValueError, "version=0",
         replies=True),
    Case("unknown-field", lambda c: c.raw({"op": "begin", "pickle": "x"}), ValueError, "'pickle'", replies=True),
    Case("bucket-missing-tensors", lambda c: c.raw(BEGIN, {"op": "bucket", "handle": {"shm": c.segment.name}}),
         ValueError, "lacks field 'tensors'", replies=True),
    Case("tensors-not-list", lambda c: c.raw(BEGIN, c.bucket() | {"tensors": {"a": 1}}), ValueError,
         "field 'tensors'", replies=True),
    Case("too-many-tensors", lambda c: c.raw(BEGIN, c.bucket(*[item()] * (MAX_TENSORS + 1))), ValueError,
         "field 'tensors'", replies=True),
    Case("item-wrong-type", lambda c: c.raw(BEGIN, c.bucket(item() | {"offset": "0"})), ValueError,
         r"tensors\[0\]\.offset", replies=True),
    Case("offset-past-buffer", lambda c: c.raw(BEGIN, c.bucket(item(offset=4096))), ValueError,
         r"tensors\[0\]\.offset", replies=True),
    Case("shape-past-buffer", lambda c: c.raw(BEGIN, c.bucket(embedding(c))), ValueError,
         r"tensors\[0\]\.offset.*shape \[\d+, \d+\].*4096 bytes", replies=True),
    Case("shape-not-the-weights", lambda c: c.raw(BEGIN, c.bucket(item(shape=(64, 64)))), ValueError,
         r"'model.norm.weight' has shape \(64, 64\), expected \(64,\)", replies=True),
    Case("offset-unaligned", lambda c: c.raw(BEGIN, c.bucket(item(offset=3))), ValueError, r"tensors\[0\]\.offset",
         replies=True),
    Case("unknown-dtype", lambda c: c.raw(BEGIN, c.bucket(item(dtype="int64"))), ValueError, r"tensors\[0\]\.dtype",
         replies=True),
    Case("negative-shape", lambda c: c.raw(BEGIN, c.bucket(item(shape=(-1, 64)))), ValueError,
         r"tensors\[0\]\.shape", replies=True),
    Case("too-many-dims", lambda c: c.raw(BEGIN, c.bucket(item(shape=(1,) * 9))), ValueError, r"tensors\[0\]\.shape",
         replies=True),
    Case("name-not-in-model", lambda c: c.raw(BEGIN, c.bucket(item(name="model.nope.weight"))), ValueError,
         "model.nope.weight", replies=True),
    Case("wrong-shape-for-name", lambda c: c.raw(BEGIN, c.bucket(item(shape=(3,)))), ValueError,
         "'model.norm.weight' has shape", replies=True),
    # what a bucket takes is bounded by the weights: no name twice (1,024 items naming the embedding were read
    # into 1,024 copies), and a name the engine ignores holds a small buffer (one of a TiB was read, then dropped)
    Case("name-twice-in-a-bucket", lambda c: c.raw(BEGIN, c.bucket(item(), item())), ValueError,
         "'model.norm.weight' comes twice in one bucket", replies=True),
    Case("ignored-name-of-a-gib", lambda c: c.raw(BEGIN, c.bucket(
        item(name="model.layers.0.self_attn.rotary_emb.inv_freq", shape=(1 << 28,)))), ValueError,
         "'model.layers.0.self_attn.rotary_emb.inv_freq', which the engine ignores .* bytes to 1073741824",
         replies=True),
    Case("ignored-names-adding-past-a-mib", lambda c: c.raw(BEGIN, c.bucket(*[
        item(name=f"model.layers.{i}.self_attn.rotary_emb.inv_freq", shape=(3 << 16,)) for i in range(2)])),
         ValueError, "'model.layers.1.self_attn.rotary_emb.inv_freq', which the engine ignores .* bytes to 1572864",
         replies=True),
    Case("handle-path-trick", lambda c: c.raw(BEGIN, c.bucket(item(), handle={"shm": "../../etc/passwd"})),
         ValueError, "field 'handle'", replies=True),
    Case("handle-gone", lambda c: c.raw(BEGIN, c.bucket(item(), handle={"shm": "psm_00000000"})), ValueError,
         "field 'handle'", replies=True),
    Case("broadcast-without-group", lambda c: c.raw(BEGIN, {"op": "bucket", "nbytes": 256, "tensors": [item()]}),
         ValueError, "field 'nbytes'", replies=True),
    Case("cuda-share-to-cpu-engine", lambda c: c.raw(BEGIN, {"op": "bucket", "tensors": [
        {"name": "model.norm.weight", "dtype": "float32", "shape": [64], "stride": [1], "storage_offset": 0,
         "storage": [1 << 20, 256]}]}), ValueError, "'storage'", replies=True),
    Case("stride-past-storage", lambda c: c.raw(BEGIN, {"op": "bucket", "tensors": [
        {"name": "model.norm.weight", "dtype": "float32", "shape": [64], "stride": [2], "storage_offset": 0,
         "storage": [1 << 20, 256]}]}), ValueError, "reach past the storage", replies=True),
    # protocol misuse
    Case("bucket-before-begin", lambda c: c.raw(c.bucket(item())), ValueError, "starts with 'begin'", replies=True),
    Case("end-without-begin", lambda c: c.raw({"op": "end"}), ValueError, "starts with 'begin'", replies=True),
    # an 'abort' of no update is answered and passed over; the wait for 'begin' keeps its deadline
    Case("abort-without-begin", lambda c: c.raw({"op": "abort", "error": "x"}), WeightSyncTimeout, "within 3 s"),
    Case("double-begin", lambda c: c.raw(BEGIN, BEGIN), WeightUpdateAborted, "'begin'", replies=True),
    Case("abort-after-a-copy", lambda c: c.raw(BEGIN, c.bucket(item()), {"op": "abort", "error": "trainer OOM"}),
         WeightUpdateAborted, "trainer OOM", copied=True),
]


@pytest.fixture
def ctx(hf_checkpoint, tmp_path):
    path_a, model_a = hf_checkpoint("qwen2", seed=0)
    _, model_b = hf_checkpoint("qwen2", seed=1)
    for seed, model in ((0, model_a), (1, model_b)):
        if seed not in REFERENCE:
            REFERENCE[seed] = hf_greedy(model, IDS, GREEDY.max_tokens)[0]
    engine = Engine(path_a, kv_cache_memory=1 << 22, max_num_seqs=4)
    receiver = WeightReceiver(engine, timeout_s=2)
    context = Ctx(engine, receiver, (model_a, model_b), tmp_path)
    yield context
    context.close()
    receiver.close()


def serves(ctx, seed):
    assert ctx.engine.generate([IDS], GREEDY)[0].outputs[0].token_ids == REFERENCE[seed]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(ctx, case):
    with pytest.raises(case.error, match=case.match):
        case.run(ctx)
    assert all(isinstance(r, dict) and isinstance(r.get("ok"), bool) for r in ctx.replies), ctx.replies
    if case.replies:
        assert not ctx.replies[-1]["ok"], ctx.replies
        assert re.search(case.match, ctx.replies[-1]["error"]), ctx.replies[-1]
    if case.copied:
        with pytest.raises(WeightsNotReadyError):
            ctx.engine.generate([IDS], GREEDY)
    else:
        serves(ctx, 0)  # nothing was copied: the old weights serve
    thread, result = send_in_thread(ctx, ctx.models[1].state_dict().items())
    version = ctx.receiver.receive(begin_timeout_s=10)
    thread.join(10)
    assert result == {"version": version} and version == ctx.engine.weight_version >= 1
    serves(ctx, 1)


def test_an_abort_before_begin_is_answered_and_the_update_after_it_taken(ctx):
    """A sender whose 'begin' was lost (its receiver restarted at the same path) times out and sends 'abort',
    which the next receiver gets first: receive() used to raise on it and miss the update sent again."""
    received = {}

    def receive():
        try:
            received["version"] = ctx.receiver.receive(begin_timeout_s=30)
        except Exception as err:
            received["error"] = err

    thread = threading.Thread(target=receive)
    thread.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ctx.receiver.endpoint)
    try:
        sock.send_multipart([b"", json.dumps({"op": "abort", "error": "timed out"}).encode()])
        assert sock.poll(10_000), "the stray 'abort' got no answer"
        assert json.loads(sock.recv_multipart()[-1]) == {"ok": True}
    finally:
        sock.close()
    with WeightSender(ctx.receiver.endpoint, timeout_s=10) as sender:
        version = sender.send(ctx.models[1].state_dict())
    thread.join(30)
    assert received == {"version": version} and version == ctx.engine.weight_version == 1
    serves(ctx, 1)


def test_a_state_dict_is_sent_as_its_items(ctx):
    """send(model.state_dict()) (a Mapping, as Engine.update_weights takes it) sends its (name, tensor) pairs; it
    unpacked each name as a pair and aborted the update."""
    thread, result = send_in_thread(ctx, ctx.models[1].state_dict())
    version = ctx.receiver.receive(begin_timeout_s=10)
    thread.join(10)
    assert result == {"version": version} and version == ctx.engine.weight_version == 1
    serves(ctx, 1)
