"""The weight transport's guards: message sizes, the group's address, abort, timeouts that the sender and
receiver recover from, and shared memory that only its creator tracks (endpoints: test_transport_endpoints)."""
import inspect
import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import zmq
from helpers import GREEDY, hf_greedy, make_prompts

from rollout_engine import Engine, EngineError, WeightsNotReadyError, WeightSyncTimeout, WeightUpdateRejected
from rollout_engine.transport import (
    WeightReceiver,
    WeightSender,
    WeightUpdateAborted,
    init_weight_update_group,
)
from rollout_engine.transport.protocol import MAX_MESSAGE_BYTES, MAX_NAME_CHARS, MAX_REPLY_BYTES, MAX_TENSORS, \
    encode
from rollout_engine.transport.sender import bounded

from transport_fixtures import IDS, engine, models, serves  # noqa: F401 - fixtures


def push(receiver, named, sender=None, version=None):
    """One update from a WeightSender in a thread, served here; (receiver's result, sender's result)."""
    result = {}
    own = sender is None
    sender = sender or WeightSender(receiver.endpoint, bucket_bytes=64 << 10, timeout_s=20)

    def run():
        try:
            result["version"] = sender.send(named, version)
        except Exception as err:
            result["error"] = err
        finally:
            if own:
                sender.close()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        return receiver.receive(begin_timeout_s=20), result
    finally:
        thread.join(20)


def dealer(endpoint, *messages):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    for message in messages:
        sock.send_multipart([b"", message if isinstance(message, bytes) else encode(message)])
    return sock


def replies(sock, wait_ms=1000):
    """Every reply the receiver sent (it raised after sending them): none more comes within `wait_ms` of the last."""
    out = []
    while sock.poll(wait_ms):
        out.append(json.loads(sock.recv_multipart()[-1]))
    return out


# ---------------------------------------------------------------- 3: message sizes

def test_a_message_over_the_limit_is_dropped_and_the_receiver_goes_on(engine, models):
    receiver = WeightReceiver(engine, timeout_s=20)
    assert receiver.socket.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES
    sock = dealer(receiver.endpoint, b"{" + b" " * MAX_MESSAGE_BYTES + b"}")
    with pytest.raises(WeightSyncTimeout, match="'begin'"):
        receiver.receive(begin_timeout_s=2)  # ZeroMQ dropped it with its connection: nothing to parse
    assert replies(sock) == []
    sock.close()
    sender = WeightSender(receiver.endpoint, timeout_s=20)
    assert sender.socket.getsockopt(zmq.MAXMSGSIZE) == MAX_REPLY_BYTES
    assert push(receiver, models[2].state_dict().items(), sender)[0] == 1
    sender.close()
    receiver.close()


def test_the_largest_bucket_message_fits_the_limit():
    name = "\u00e9" * MAX_NAME_CHARS  # 6 bytes each once escaped
    handle = ["A" * 88, 2**40, 2**40, "A" * 64, 2**40, "A" * 88, True, 7]
    item = {"name": name, "dtype": "bfloat16", "shape": [2**40 - 1] * 8, "stride": [2**40 - 1] * 8,
            "storage_offset": 2**40, "storage": [2**48, 2**40], "cuda": handle}
    assert len(encode({"op": "bucket", "tensors": [item] * MAX_TENSORS})) <= MAX_MESSAGE_BYTES
    many = [[(f"t{i}", None) for i in range(2 * MAX_TENSORS + 1)]]
    assert [len(g) for g in bounded(many)] == [MAX_TENSORS, MAX_TENSORS, 1]


# ---------------------------------------------------------------- 4: the group's address

def test_group_address_other_than_loopback_needs_allow_remote():
    with pytest.raises(ValueError, match="allow_remote=True"):
        init_weight_update_group("10.0.0.1", 29600, rank=1, world_size=2, backend="gloo")


@pytest.mark.parametrize("arguments, name", [(dict(timeout_s=math.inf), "timeout_s"), (dict(timeout_s=True), "timeout_s"),
                                             (dict(rank=True), "rank"), (dict(world_size=2.0), "world_size")])
def test_group_arguments_are_checked_before_anything_listens(arguments, name):
    """inf overflowed the group's timeout (OverflowError), True was taken as 1 s or as rank 1 (then waited for
    peers); each is a ValueError naming it, before the store listens."""
    with pytest.raises(ValueError, match=name):
        init_weight_update_group("127.0.0.1", 29600, **{"rank": 1, "world_size": 2, "backend": "gloo", **arguments})


def test_allow_remote_is_a_bool():
    """bool("false") is True: a string would open the group to the network."""
    with pytest.raises(ValueError, match="allow_remote='false' is not allowed; True or False"):
        init_weight_update_group("10.0.0.1", 29600, rank=1, world_size=2, backend="gloo", allow_remote="false")


def test_group_on_another_address_with_allow_remote():
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    out, loopback_refused = {}, []

    def rank(r):
        group = init_weight_update_group("127.0.0.2", port, rank=r, world_size=2, backend="gloo", timeout_s=60,
                                         allow_remote=True)
        if r == 0:
            with pytest.raises(ConnectionRefusedError):  # the store listens on the address given, nowhere else
                socket.create_connection(("127.0.0.1", port), timeout=5)
            loopback_refused.append(True)
        flat = torch.arange(8, dtype=torch.uint8) if r == 0 else torch.zeros(8, dtype=torch.uint8)
        group.broadcast(flat)
        out[r] = flat
        group.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert loopback_refused and torch.equal(out[1], torch.arange(8, dtype=torch.uint8))


def gloo_pair(timeout_s: float):
    """Both ranks of a gloo weight-update group, made here: (rank 0's, rank 1's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    groups = {}

    def join(r):
        groups[r] = init_weight_update_group("127.0.0.1", port, rank=r, world_size=2, backend="gloo",
                                             timeout_s=timeout_s)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return groups[0], groups[1]


def test_a_broadcast_bucket_the_receiver_refuses_costs_the_sender_no_broadcast(engine, models):
    """The engine side made its group but gave the receiver none: the sender's first bucket is refused with
    the receiver's reason at once. The sender broadcast before it heard back, into a group where nobody
    joined, and waited out the group's timeout (with NCCL its watchdog then ends the trainer)."""
    trainer_group, engine_group = gloo_pair(timeout_s=60)
    receiver = WeightReceiver(engine, timeout_s=20)
    sender = WeightSender(receiver.endpoint, bucket_bytes=64 << 10, timeout_s=20, group=trainer_group)
    thread, outcome = send_in_thread(sender, models[2].state_dict().items())
    with pytest.raises(ValueError, match="needs a weight-update group"):
        receiver.receive(begin_timeout_s=20)
    refused = time.monotonic()
    thread.join(40)
    assert isinstance(outcome.get("error"), WeightUpdateRejected), outcome
    assert "needs a weight-update group" in str(outcome["error"]) and outcome["at"] - refused < 10
    serves(engine, models[1])  # refused before any byte moved: the old weights, whole
    sender.close()
    receiver.close()
    trainer_group.close()
    engine_group.close()


def send_in_thread(sender, named):
    """sender.send(named) in a thread; (the thread, {"error": what it raised, "at": when})."""
    outcome = {}

    def send():
        try:
            sender.send(named)
        except Exception as err:
            outcome["error"], outcome["at"] = err, time.monotonic()

    thread = threading.Thread(target=send)
    thread.start()
    return thread, outcome


def test_a_receiver_that_gave_up_costs_the_sender_its_timeout_not_the_groups(engine, models):
    """The trainer stalls mid-update past the receiver's timeout; the receiver gives up. The sender's next
    bucket gets no answer within the sender's timeout (WeightSyncTimeout), rather than a broadcast that waits
    the group's 60 s for a receiver that is no longer there."""
    trainer_group, engine_group = gloo_pair(timeout_s=60)
    receiver = WeightReceiver(engine, timeout_s=1, group=engine_group)
    sender = WeightSender(receiver.endpoint, bucket_bytes=1 << 10, timeout_s=3, group=trainer_group)
    named = list(models[2].state_dict().items())

    def stalls():
        yield from named[:3]
        time.sleep(2)  # past the receiver's timeout
        yield from named[3:]

    thread, outcome = send_in_thread(sender, stalls())
    with pytest.raises(WeightSyncTimeout, match="bucket or 'end'"):
        receiver.receive(begin_timeout_s=20)
    gave_up = time.monotonic()
    thread.join(40)
    assert isinstance(outcome.get("error"), WeightSyncTimeout), outcome
    assert outcome["at"] - gave_up < 20  # its own 3 s (and the abort's wait), not the group's 60
    sender.close()
    receiver.close()
    trainer_group.close()
    engine_group.close()


# ---------------------------------------------------------------- 7: abort

def test_default_timeouts_are_what_a_training_step_can_afford():
    for fn in (WeightSender.__init__, WeightReceiver.__init__):
        assert inspect.signature(fn).parameters["timeout_s"].default <= 30


def test_a_sender_error_aborts_the_update_at_once(engine, models):
    receiver = WeightReceiver(engine, timeout_s=120)  # no waiting for it: 'abort' ends the update
    boom = RuntimeError("dataloader died")

    def failing():
        for i, pair in enumerate(models[2].state_dict().items()):
            if i == 10:
                raise boom
            yield pair

    sender = WeightSender(receiver.endpoint, bucket_bytes=64 << 10, timeout_s=20)
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, sender.send, failing()).value))
    start = time.monotonic()
    thread.start()
    with pytest.raises(WeightUpdateAborted, match="dataloader died"):
        receiver.receive(begin_timeout_s=20)
    thread.join(20)
    assert time.monotonic() - start < 20 and errors[0] is boom  # at once, and the sender re-raises its own error
    with pytest.raises(WeightsNotReadyError):  # buckets before the error were copied
        engine.generate([IDS], GREEDY)
    version, result = push(receiver, models[2].state_dict().items(), sender)  # the retry is a fresh update
    assert result == {"version": version} == {"version": 1}
    serves(engine, models[2])
    sender.close()
    receiver.close()


def test_a_shared_memory_without_fallocate_still_carries_an_update(engine, models, monkeypatch):
    """posix_fallocate reserves a bucket's pages where the filesystem has it; where it has not (EOPNOTSUPP), the
    pages come as they are written, as before, rather than every CPU send failing."""
    import errno

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")
    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    receiver = WeightReceiver(engine, timeout_s=20)
    try:
        version, result = push(receiver, models[2].state_dict().items())
        assert result == {"version": version} == {"version": 1}
        serves(engine, models[2])
    finally:
        receiver.close()


def test_a_closed_sender_says_so(engine, models):
    receiver = WeightReceiver(engine, timeout_s=20)
    sender = WeightSender(receiver.endpoint, timeout_s=20)
    sender.close()
    with pytest.raises(EngineError, match="the weight sender to .* is closed; make a new one"):
        sender.send(models[2].state_dict())  # was zmq's "Socket operation on non-socket"
    sender.close()  # a second close is harmless
    receiver.close()


def test_a_new_begin_aborts_an_unfinished_update(engine, models):
    """A sender stalls mid-update (as if dead); another sender's update aborts it: the engine refuses to
    generate from the mix, and the next receive() serves the new sender's whole update."""
    receiver = WeightReceiver(engine, timeout_s=120)
    named = list(models[2].state_dict().items())
    stalled, release, results = threading.Event(), threading.Event(), {}

    def stalls():
        yield from named[:10]
        stalled.set()
        release.wait(60)
        raise RuntimeError("released")

    def send(key, sender, tensors, wait=None):
        if wait is not None:
            wait.wait(60)
        try:
            results[key] = sender.send(tensors)
        except Exception as err:
            results[key] = err

    first = WeightSender(receiver.endpoint, bucket_bytes=1 << 10, timeout_s=20)
    second = WeightSender(receiver.endpoint, bucket_bytes=64 << 10, timeout_s=20)
    threads = [threading.Thread(target=send, args=("first", first, stalls())),
               threading.Thread(target=send, args=("second", second, named, stalled))]
    for t in threads:
        t.start()
    with pytest.raises(WeightUpdateAborted, match="another sender began an update"):
        receiver.receive(begin_timeout_s=20)
    with pytest.raises(WeightsNotReadyError):  # the first sender's buckets were copied
        engine.generate([IDS], GREEDY)
    assert receiver.receive(begin_timeout_s=20) == 1
    serves(engine, models[2])
    release.set()
    for t in threads:
        t.join(30)
    assert results["second"] == 1 and isinstance(results["first"], RuntimeError)
    first.close()
    second.close()
    receiver.close()


# ---------------------------------------------------------------- 8: timeouts

def test_the_sender_recovers_after_a_timeout(engine, models):
    receiver = WeightReceiver(engine, timeout_s=20)
    sender = WeightSender(receiver.endpoint, bucket_bytes=64 << 10, timeout_s=0.5)
    with pytest.raises(WeightSyncTimeout, match=r"did not answer 'begin' within 0.5 s"):
        sender.send(models[2].state_dict().items())
    # The engine gets to it late: the stale 'begin' and the 'abort' that followed it end one receive() ...
    with pytest.raises(WeightUpdateAborted, match="WeightSyncTimeout in the sender"):
        receiver.receive(begin_timeout_s=5)
    sender.timeout_s = 20
    version, result = push(receiver, models[2].state_dict().items(), sender)  # ... and the same sender works on
    assert result == {"version": version} == {"version": 1}
    serves(engine, models[2])
    sender.close()
    receiver.close()


def test_the_receiver_recovers_after_a_timeout(engine, models):
    receiver = WeightReceiver(engine, timeout_s=0.5)
    sock = dealer(receiver.endpoint, {"op": "begin", "version": None})
    with pytest.raises(WeightSyncTimeout, match=r"bucket or 'end' \(after 0 buckets\).* within 0.5 s"):
        receiver.receive(begin_timeout_s=5)
    assert replies(sock) == [{"ok": True}]
    sock.close()
    serves(engine, models[1])  # nothing was copied
    receiver.timeout_s = 20
    assert push(receiver, models[2].state_dict().items())[0] == 1
    serves(engine, models[2])
    receiver.close()


@pytest.mark.parametrize("sender_goes_on", [True, False], ids=["sender-sends-end", "sender-silent"])
def test_an_error_after_an_early_ack_is_the_one_raised(engine, models, monkeypatch, sender_goes_on):
    """A shared bucket is acknowledged before the engine checks it: its error answers the sender's next
    message, and when none comes in time the engine's error is still the one raised, not the wait."""
    receiver = WeightReceiver(engine, timeout_s=0.5)
    monkeypatch.setattr(receiver, "_shared_tensor", lambda item: (item["name"], torch.zeros(3)))
    bucket = {"op": "bucket", "tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [3],
                                           "stride": [1], "storage_offset": 0, "storage": [4096, 12]}]}
    messages = [{"op": "begin", "version": None}, bucket] + ([{"op": "end"}] if sender_goes_on else [])
    sock = dealer(receiver.endpoint, *messages)
    with pytest.raises(ValueError, match="has shape"):
        receiver.receive(begin_timeout_s=5)
    answers = replies(sock)
    assert answers[:2] == [{"ok": True}, {"ok": True}]
    assert (len(answers) == 3 and "has shape" in answers[2]["error"]) if sender_goes_on else len(answers) == 2
    sock.close()
    receiver.timeout_s = 20
    assert push(receiver, models[2].state_dict().items())[0] == 1
    receiver.close()


# ---------------------------------------------------------------- 9: shared memory

IN_PROCESS = textwrap.dedent("""
    import os, signal, sys, threading, torch
    from transformers import AutoModelForCausalLM
    from rollout_engine import Engine
    from rollout_engine.transport import WeightReceiver, WeightSender
    path_a, path_b, how = sys.argv[1:4]
    engine = Engine(path_a, kv_cache_memory=1 << 22, max_num_seqs=4)
    receiver = WeightReceiver(engine, timeout_s=60)
    sender = WeightSender(receiver.endpoint, bucket_bytes=64 << 10, timeout_s=60)
    named = list(AutoModelForCausalLM.from_pretrained(path_b, dtype=torch.float32).state_dict().items())
    thread = threading.Thread(target=sender.send, args=(named,))
    thread.start()
    receiver.receive(begin_timeout_s=60)
    thread.join()
    print(sender.shared.handle["shm"], flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # the sender's segment is still there: the tracker must unlink it
    sender.close()
    receiver.close()
""")


def test_one_process_sender_and_receiver_leave_the_tracker_alone(models, hf_checkpoint):
    path_b = hf_checkpoint("qwen2", seed=1)[0]
    out = subprocess.run([sys.executable, "-c", IN_PROCESS, str(models[0]), str(path_b), "close"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "KeyError" not in out.stderr and "leaked" not in out.stderr, out.stderr
    assert not os.path.exists(f"/dev/shm/{out.stdout.strip()}")


def test_sigkill_leaves_no_segment_behind(models, hf_checkpoint):
    path_b = hf_checkpoint("qwen2", seed=1)[0]
    out = subprocess.run([sys.executable, "-c", IN_PROCESS, str(models[0]), str(path_b), "kill"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == -signal.SIGKILL, out.stderr
    name = out.stdout.strip()
    assert name.startswith("psm_")
    deadline = time.monotonic() + 20
    while os.path.exists(f"/dev/shm/{name}") and time.monotonic() < deadline:
        time.sleep(0.1)  # the resource tracker unlinks it once it sees its process gone
    assert not os.path.exists(f"/dev/shm/{name}")


def test_the_receiver_unmaps_the_segment_when_the_update_ends(engine, models):
    receiver = WeightReceiver(engine, timeout_s=20)
    sender = WeightSender(receiver.endpoint, bucket_bytes=64 << 10, timeout_s=20)
    assert push(receiver, models[2].state_dict().items(), sender)[0] == 1
    name = sender.shared.handle["shm"]
    sender.close()  # unlinks it; a receiver's mapping or open descriptor would keep its memory
    with open("/proc/self/maps") as f:
        assert name not in f.read()
    assert not [fd for fd in os.listdir("/proc/self/fd") if name in _link(f"/proc/self/fd/{fd}")]
    receiver.close()


def _link(path):
    try:
        return os.readlink(path)
    except OSError:  # the listing's own descriptor, closed since
        return ""


# A peer truncates the shared-memory segment its bucket names: the bucket is refused, the process lives on.
TRUNCATED = textwrap.dedent("""
    import json, os, sys, threading
    from multiprocessing import shared_memory
    import torch, zmq
    from transformers import AutoModelForCausalLM
    from rollout_engine import Engine, SamplingParams
    from rollout_engine.transport import WeightReceiver, WeightSender
    path_a, path_b, when, ids = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    engine = Engine(path_a, kv_cache_memory=1 << 22, max_num_seqs=4)
    receiver = WeightReceiver(engine, "tcp://127.0.0.1:0", timeout_s=20)
    named = AutoModelForCausalLM.from_pretrained(path_b, dtype=torch.float32).state_dict()
    norm = named["model.norm.weight"]
    segment = shared_memory.SharedMemory(create=True, size=1 << 20)
    torch.frombuffer(segment.buf, dtype=torch.float32)[: norm.numel()].copy_(norm)
    item = {"name": "model.norm.weight", "dtype": "float32", "shape": list(norm.shape), "offset": 0}
    bucket = {"op": "bucket", "handle": {"shm": segment.name}, "tensors": [item]}
    if when == "during":  # shrunk after the receiver checked its size, before it reads the bytes
        read = os.preadv
        def preadv(fd, buffers, offset):
            os.ftruncate(segment._fd, 0)
            return read(fd, buffers, offset)
        os.preadv = preadv
    replies = []
    def peer():
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(receiver.endpoint)
        def ask(message):
            sock.send_multipart([b"", json.dumps(message).encode()])
            replies.append(json.loads(sock.recv_multipart()[-1]) if sock.poll(20000) else "no reply")
        ask({"op": "begin", "version": None})
        if when == "between":  # bucket 1 is read whole; bucket 2 names the same segment, shrunk since
            ask(bucket)
            os.ftruncate(segment._fd, 0)
            ask(dict(bucket, tensors=[dict(item, offset=512 << 10)]))
        else:
            ask(bucket)
        sock.close()
    thread = threading.Thread(target=peer)
    thread.start()
    try:
        receiver.receive(begin_timeout_s=20)
        raised = None
    except ValueError as err:
        raised = str(err)
    thread.join(20)
    if when == "during":
        os.preadv = read
    segment.close()
    segment.unlink()
    sender = WeightSender(receiver.endpoint, bucket_bytes=64 << 10, timeout_s=20)  # the next update lands
    thread = threading.Thread(target=sender.send, args=(named.items(),))
    thread.start()
    version = receiver.receive(begin_timeout_s=20)
    thread.join(20)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = engine.generate([ids], greedy)[0].outputs[0].token_ids
    print(json.dumps({"raised": raised, "replies": replies, "version": version, "tokens": tokens}), flush=True)
    sender.close()
    receiver.close()
""")


@pytest.mark.parametrize("when", ["between", "during"], ids=["between-buckets", "between-check-and-read"])
def test_a_segment_truncated_under_the_receiver_is_refused_and_the_engine_lives_on(models, hf_checkpoint, when):
    """A local peer that shrinks (ftruncate) the segment it named, between two buckets or between the
    receiver's size check and its read, gets an error reply; the engine's process lives on (a mapping read
    past the segment's new end was SIGBUS) and takes the next update. In a subprocess: the old crash killed
    the process."""
    path_b = hf_checkpoint("qwen2", seed=1)[0]
    out = subprocess.run([sys.executable, "-c", TRUNCATED, str(models[0]), str(path_b), when, json.dumps(IDS)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"exit {out.returncode} (-7: SIGBUS): {out.stderr[-3000:]}"
    result = json.loads(out.stdout.strip().splitlines()[-1])
    shrank = "past the end of shared-memory segment" if when == "between" else "the sender shrank it"
    assert shrank in result["raised"]
    assert result["replies"][0] == {"ok": True}  # begin
    assert result["replies"][-1]["ok"] is False and shrank in result["replies"][-1]["error"]
    assert result["version"] == 1
    assert result["tokens"] == hf_greedy(models[2], IDS, GREEDY.max_tokens)[0]


# ---------------------------------------------------------------- hostile segment names and sizes

def test_a_fifo_named_as_a_segment_is_refused_not_waited_on():
    """A local peer may plant a FIFO under a psm_ name in /dev/shm: opening it read-only blocked until someone
    wrote to it, holding the receiver (and its engine thread) past every timeout. It is refused at once."""
    from rollout_engine.transport.shm import Segment

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    name = f"psm_{os.urandom(8).hex()}"
    os.mkfifo(f"/dev/shm/{name}", 0o600)
    outcome = {}

    def open_it():
        try:
            Segment(name).close()
        except ValueError as err:
            outcome["error"] = str(err)

    thread = threading.Thread(target=open_it, daemon=True)
    thread.start()
    thread.join(10)
    try:
        assert not thread.is_alive(), "the receiver waits on a FIFO"
        assert "is not a shared-memory segment of this user's" in outcome["error"]
    finally:
        if thread.is_alive():  # release it: a writer opens the other end
            os.close(os.open(f"/dev/shm/{name}", os.O_WRONLY | os.O_NONBLOCK))
        os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("item, error", [
    ({"name": "no.such.weight", "shape": [1 << 28]}, "unknown weight name 'no.such.weight'"),
    ({"name": "model.norm.weight", "shape": [1 << 28]}, "'model.norm.weight' has shape"),
])
def test_a_bucket_is_checked_before_its_bytes_are_read(engine, models, monkeypatch, item, error):
    """A shared-memory bucket's names and shapes are checked against the engine's weights before a byte is
    allocated or read: a peer's bucket naming a sparse 1 GiB (or 100 GiB) segment was read into host memory in
    full, then refused, and the buffer kept."""
    receiver = WeightReceiver(engine, timeout_s=5)
    allocated = []
    monkeypatch.setattr(receiver, "_read_buffer", lambda nbytes: allocated.append(nbytes) or torch.empty(nbytes))
    bucket = {"op": "bucket", "handle": {"shm": "psm_0123abcd"},
              "tensors": [item | {"dtype": "float32", "offset": 0}]}
    sock = dealer(receiver.endpoint, {"op": "begin", "version": None}, bucket)
    with pytest.raises(ValueError, match=error):
        receiver.receive(begin_timeout_s=5)
    answers = replies(sock)
    assert answers[0] == {"ok": True} and error in answers[1]["error"].replace('"', "'")
    assert allocated == []
    sock.close()
    monkeypatch.undo()
    receiver.timeout_s = 20
    assert push(receiver, models[2].state_dict().items())[0] == 1
    receiver.close()


def test_a_dropped_sender_takes_its_shared_memory_with_it(engine, models):
    """WeightSender(endpoint).send(...) without close(): its segment (tmpfs, so memory) is removed once the sender
    is collected, not left in /dev/shm, one per update, until the trainer's process exits. `with` closes it."""
    import gc

    receiver = WeightReceiver(engine, timeout_s=20)
    try:
        sender = WeightSender(receiver.endpoint)
        assert push(receiver, models[2].state_dict().items(), sender=sender)[0] == 1
        segment = f"/dev/shm/{sender.shared.handle['shm']}"
        assert os.path.exists(segment)
        del sender
        gc.collect()
        assert not os.path.exists(segment)
        with WeightSender(receiver.endpoint) as sender:
            assert push(receiver, models[1].state_dict().items(), sender=sender)[0] == 2
            segment = f"/dev/shm/{sender.shared.handle['shm']}"
        assert not os.path.exists(segment)
    finally:
        receiver.close()


@pytest.mark.parametrize("named, shown", [(torch.zeros(3, 4), "got a Tensor"),
                                          ([torch.zeros(3, 4)], "got a tensor of shape \\(3, 4\\)")])
def test_a_sender_refuses_what_is_no_named_tensors_before_it_begins(engine, named, shown):
    """A bare tensor, or a list of tensors, is refused naming the argument before 'begin' goes out (it was an
    unpacking error after it, which aborted the update on the receiver): no receiver need be listening."""
    receiver = WeightReceiver(engine, timeout_s=20)
    try:
        with WeightSender(receiver.endpoint, timeout_s=1) as sender:
            with pytest.raises(ValueError, match=f"named_tensors must .*{shown}"):
                sender.send(named)
    finally:
        receiver.close()


def test_a_name_given_twice_is_refused_whatever_the_buckets(engine, models):
    """Which copy of a twice-given weight would serve depended on how the update was cut: in one bucket the
    receiver refused it, across two it took the later one, and update_weights took it. Refused everywhere, naming
    it, and the engine keeps serving its weights."""
    named = list(models[2].state_dict().items())
    twice = named + [named[-1]]
    with pytest.raises(ValueError, match=f"named_tensors gives weight '{named[-1][0]}' twice; each name once"):
        engine.update_weights(twice)
    serves(engine, models[1])
    receiver = WeightReceiver(engine, timeout_s=20)
    try:
        for bucket_bytes in (64 << 10, 512 << 20):  # the copy in another bucket, and in the same one
            with WeightSender(receiver.endpoint, bucket_bytes=bucket_bytes, timeout_s=20) as sender:
                with pytest.raises(WeightUpdateAborted, match="gives weight 'lm_head.weight' twice"):
                    push(receiver, twice, sender=sender)
        assert push(receiver, named)[0] == engine.weight_version  # a whole update serves as ever
        serves(engine, models[2])
    finally:
        receiver.close()


def test_a_forked_childs_exit_leaves_the_senders_segment(tmp_path):
    """A child forked from a trainer (a dataloader worker, a subprocess launcher) runs the finalizers at its exit
    too: it must not unlink the segment its parent's sender is still using."""
    script = textwrap.dedent("""
        import os, sys
        from rollout_engine.transport.shm import SharedBuffer
        buffer = SharedBuffer(4096)
        path = "/dev/shm/" + buffer.handle["shm"]
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: atexit and the finalizers run
        os.waitpid(pid, 0)
        print(os.path.exists(path))
        buffer.close()
        print(os.path.exists(path))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]
