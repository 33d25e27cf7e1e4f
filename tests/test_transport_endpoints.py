"""Where the weight sockets listen: loopback or ipc:// only (checked before and after ZeroMQ binds), one
receiver per ipc path, in a directory only this user can write to, and the socket file gone after close."""
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import zmq
from helpers import GREEDY, hf_greedy, make_prompts

from rollout_engine import Engine
from rollout_engine.errors import EngineError, WeightSyncTimeout, WeightUpdateAborted
from rollout_engine.transport import WeightReceiver, WeightSender, check_endpoint, private_ipc_endpoint
from rollout_engine.transport import receiver as receiver_module

from transport_fixtures import IDS, engine, models, serves  # noqa: F401 - fixtures


def push(receiver, named):
    """One update from a WeightSender in a thread, served here; the receiver's result."""
    result = {}

    def run():
        sender = WeightSender(receiver.endpoint, bucket_bytes=64 << 10, timeout_s=20)
        try:
            result["version"] = sender.send(named)
        finally:
            sender.close()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        return receiver.receive(begin_timeout_s=20)
    finally:
        thread.join(20)


# ---------------------------------------------------------------- 1: endpoints

def test_semicolon_endpoint_is_refused_before_zeromq_sees_it(engine):
    trick = "tcp://127.0.0.1:5601;0.0.0.0:5602"  # ZeroMQ: source 127.0.0.1:5601, bind/connect 0.0.0.0:5602
    with pytest.raises(ValueError, match="endpoint='tcp://127.0.0.1:5601;0.0.0.0:5602' is not allowed"):
        check_endpoint(trick)
    with pytest.raises(ValueError, match="endpoint="):
        WeightReceiver(engine, trick)
    with pytest.raises(ValueError, match="endpoint="):
        WeightSender(trick)


def test_what_the_socket_bound_is_checked_after_bind(engine, monkeypatch):
    monkeypatch.setattr(receiver_module, "check_endpoint", lambda endpoint, bind: endpoint)  # as if it missed one
    with pytest.raises(ValueError, match=r"made the socket take 'tcp://0\.0\.0\.0:\d+', which is not the loopback"):
        WeightReceiver(engine, "tcp://127.0.0.1:1;0.0.0.0:0")


@pytest.mark.parametrize("endpoint", ["tcp://[::1]:0", "tcp://localhost:0", "tcp://127.0.0.1:0"])
def test_every_loopback_form_works(engine, models, endpoint):
    receiver = WeightReceiver(engine, endpoint, timeout_s=20)
    assert receiver.endpoint.startswith("tcp://[::1]:" if "::1" in endpoint else "tcp://127.0.0.1:")
    assert push(receiver, models[2].state_dict().items()) == 1
    receiver.close()
    serves(engine, models[2])


# ---------------------------------------------------------------- 2: ipc sockets

def test_a_live_ipc_path_is_refused_and_its_file_goes_with_close(engine, tmp_path):
    endpoint = f"ipc://{tmp_path}/weights"
    first = WeightReceiver(engine, endpoint)
    with pytest.raises(ValueError, match="is in use"):
        WeightReceiver(engine, endpoint)
    assert os.path.exists(tmp_path / "weights")
    first.close()
    assert not os.path.exists(tmp_path / "weights")
    WeightReceiver(engine, endpoint).close()  # free again


def test_a_stale_socket_file_is_replaced(engine, tmp_path):
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "weights"))  # bound, never listening, closed: what a killed process leaves
    stale.close()
    WeightReceiver(engine, f"ipc://{tmp_path}/weights").close()
    assert not os.path.exists(tmp_path / "weights")


def test_ipc_path_must_be_in_a_private_directory(engine, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(ValueError, match="writable by nobody else"):
        WeightReceiver(engine, f"ipc://{shared}/weights")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a socket"):
        WeightReceiver(engine, f"ipc://{tmp_path}/file")
    assert (tmp_path / "file").read_text() == "x"  # ZeroMQ's bind would have deleted it


def test_default_endpoint_is_a_private_directory_removed_on_close(engine, models):
    receiver = WeightReceiver(engine, timeout_s=20)
    path = receiver.endpoint.removeprefix("ipc://")
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    assert push(receiver, models[2].state_dict().items()) == 1
    receiver.close()
    assert not os.path.exists(os.path.dirname(path))
    with pytest.raises(ValueError, match="name="):
        private_ipc_endpoint("../x")


@pytest.mark.parametrize("long", [False, True])
def test_the_default_endpoint_fits_a_socket_path_whatever_the_temporary_directory(engine, models, tmp_path,
                                                                                  monkeypatch, long):
    """A temporary directory too long to hold a Unix socket's path (a cluster job's TMPDIR: a receiver, a server
    failed to start) gives way to /tmp; a short one is used."""
    import shutil
    import tempfile

    parent = tmp_path / ("t" * 90) if long else tempfile.mkdtemp(prefix="t", dir="/tmp")
    os.makedirs(parent, mode=0o700, exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(parent))
    receiver = WeightReceiver(engine, timeout_s=20)
    directory = os.path.dirname(receiver.endpoint.removeprefix("ipc://"))
    try:
        assert os.path.dirname(directory) == ("/tmp" if long else str(parent))
        assert push(receiver, models[2].state_dict().items()) == 1
    finally:
        receiver.close()
        if not long:
            shutil.rmtree(parent)
    assert not os.path.exists(directory)


def test_socket_file_is_removed_at_exit(tmp_path):
    script = textwrap.dedent("""
        import sys, types
        from rollout_engine.transport import WeightReceiver
        engine = types.SimpleNamespace(update_weights_from_buckets=lambda *args, **kwargs: 0)  # never called here
        mine = WeightReceiver(engine, sys.argv[1])
        private = WeightReceiver(engine)
        print(private.endpoint, flush=True)
    """)  # exits without close()
    out = subprocess.run([sys.executable, "-c", script, f"ipc://{tmp_path}/weights"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    private = out.stdout.strip().removeprefix("ipc://")
    assert not os.path.exists(tmp_path / "weights") and not os.path.exists(os.path.dirname(private))


def test_a_sender_connects_only_where_a_receiver_could_bind(engine, tmp_path):
    """WeightSender checks an ipc:// path's directories as the receiver does before binding: in a directory
    others may write, whoever bound the path first would get every bucket (the trainer's weights) and answer
    as the engine; one above the socket's directory could rename the directory away and put its own there."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match="writable by nobody else"):
        WeightSender(f"ipc://{shared}/weights")
    private = shared / "private"
    private.mkdir()
    private.chmod(0o700)  # its own mode is right, but anyone may replace it inside `shared`
    for make in (WeightSender, lambda endpoint: WeightReceiver(engine, endpoint)):
        with pytest.raises(ValueError, match=f"'{shared}' above it .* lets others replace"):
            make(f"ipc://{private}/weights")
    shared.chmod(0o1777)  # sticky, as /tmp is: only the owner of `private` may rename it
    receiver = WeightReceiver(engine, f"ipc://{private}/weights")
    WeightSender(receiver.endpoint).close()
    receiver.close()


def test_a_symbolic_link_on_the_way_is_held_to_the_directories_rule(engine, tmp_path):
    """A link that others may replace (in a directory they may write), or that another user owns (who may point
    it elsewhere), would let them move a checked path to a socket of their own after the check: a sender
    connecting (or reconnecting) there would hand over the weights. Each is refused; this user's link in a
    guarded directory is taken."""
    private = tmp_path / "private"
    private.mkdir()
    private.chmod(0o700)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "link").symlink_to(private)
    for make in (WeightSender, lambda endpoint: WeightReceiver(engine, endpoint)):
        with pytest.raises(ValueError, match=f"'{shared}' above it .* lets others replace '{shared}/link'"):
            make(f"ipc://{shared}/link/weights")
    (tmp_path / "mine").symlink_to(private)
    receiver = WeightReceiver(engine, f"ipc://{tmp_path}/mine/weights")
    WeightSender(receiver.endpoint).close()
    receiver.close()
    (private / "sub").mkdir(mode=0o700)
    (tmp_path / "into").symlink_to(private / "sub")
    receiver = WeightReceiver(engine, f"ipc://{tmp_path}/into/../sub/weights")  # ".." after the link, as the kernel
    receiver.close()
    if os.geteuid() == 0:  # only root may give a link to another user
        shared.chmod(0o1777)
        os.lchown(shared / "link", 65534, 65534)
        with pytest.raises(ValueError, match=f"the symbolic link '{shared}/link' on its way is uid 65534's"):
            WeightSender(f"ipc://{shared}/link/weights")
        theirs = tmp_path / "theirs"  # left by "..": its owner could swap it for a link to anywhere
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ValueError, match=f"it leaves '{theirs}' \\(uid 65534's\\) by '..'"):
            WeightSender(f"ipc://{theirs}/../private/weights")
        (tmp_path / "mine").unlink()
        (tmp_path / "mine").symlink_to("shared/link/sub")  # this user's link, through theirs
        with pytest.raises(ValueError, match=f"the symbolic link '{shared}/link' on its way is uid 65534's"):
            WeightSender(f"ipc://{tmp_path}/mine/weights")


@pytest.fixture
def polling(monkeypatch):
    """An Event set whenever a receiver polls (Closing.poll: receive() waiting for a message), so a test waits for
    that fact rather than for a time a loaded machine may not keep."""
    from rollout_engine.transport import closing

    polled, poll = threading.Event(), closing.Closing.poll

    def poll_and_tell(self, timeout_ms):
        polled.set()
        return poll(self, timeout_ms)

    monkeypatch.setattr(closing.Closing, "poll", poll_and_tell)
    return polled


def receive_in_thread(receiver):
    """receiver.receive() in a thread; the list its error lands in."""
    raised = []

    def run():
        try:
            receiver.receive(30)
        except BaseException as err:  # noqa: BLE001 - the test reads it
            raised.append(err)

    waiting = threading.Thread(target=run)
    waiting.start()
    return waiting, raised


def test_close_from_another_thread_ends_a_waiting_receive_with_a_clear_error(engine, polling):
    """A trainer that stops its receiver's thread by closing the receiver: the receive() waiting for 'begin' ends
    at once with WeightUpdateAborted naming the close, the endpoint is freed, and a later receive() says the
    receiver is closed (a ZeroMQ socket closed under another thread's poll is undefined: it hung or raised a bare
    ZMQError)."""
    receiver = WeightReceiver(engine)
    waiting, raised = receive_in_thread(receiver)
    assert polling.wait(30), "receive() never waited"
    started = time.monotonic()
    receiver.close()
    waiting.join(10)
    assert not waiting.is_alive() and time.monotonic() - started < 5
    assert isinstance(raised[0], WeightUpdateAborted) and "was closed while it waited" in str(raised[0])
    with pytest.raises(EngineError, match="is closed; make a new one") as refused:
        receiver.receive(0)
    assert not isinstance(refused.value, WeightUpdateAborted)  # which a loop may retry: it would spin
    receiver.close()  # twice: nothing more to do


def test_close_from_a_signal_handler_inside_receive_ends_it(engine, tmp_path):
    """A trainer's SIGALRM/SIGTERM handler that closes the receiver runs in the thread inside receive(): the
    close returns at once, and receive() ends with WeightUpdateAborted, shutting the receiver on its way out."""
    import signal

    receiver, closed = WeightReceiver(engine, f"ipc://{tmp_path}/weights"), []
    previous = signal.signal(signal.SIGALRM, lambda *_: closed.append(receiver.close()))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        started = time.monotonic()
        with pytest.raises(WeightUpdateAborted, match="was closed while it waited"):
            receiver.receive(10)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert closed and time.monotonic() - started < 5
    WeightReceiver(engine, receiver.endpoint).close()  # the endpoint is free again


def test_two_concurrent_closes_both_return_once_the_endpoint_is_free(engine, tmp_path, polling):
    """The second close() does not return before the first has freed the endpoint, nor closes anything twice."""
    endpoint, probing = f"ipc://{tmp_path}/weights", threading.Lock()
    for _ in range(5):
        receiver, errors = WeightReceiver(engine, endpoint), []
        polling.clear()
        waiting, raised = receive_in_thread(receiver)
        assert polling.wait(30), "receive() never waited"

        def close():
            try:
                receiver.close()
                with probing:  # one probe at a time: the endpoint is free once close() returns
                    WeightReceiver(engine, endpoint).close()
            except Exception as err:  # noqa: BLE001 - the test reads it
                errors.append(err)

        closers = [threading.Thread(target=close) for _ in range(2)]
        for closer in closers:
            closer.start()
        for thread in (*closers, waiting):
            thread.join(10)
        assert errors == [] and isinstance(raised[0], WeightUpdateAborted)


def test_close_during_an_update_aborts_it_and_the_engine_keeps_its_weights(engine, models):
    """A sender that began an update and went silent: close() from another thread ends receive() long before
    its timeout, and the engine, which copied nothing, serves its old weights. (The sender's next message finds
    no receiver: its own timeout tells it, as for a receiver that died.)"""
    receiver = WeightReceiver(engine, timeout_s=30)
    waiting, raised = receive_in_thread(receiver)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(receiver.endpoint)
    try:
        sock.send_multipart([b"", b'{"op": "begin", "version": null}'])
        # its 'begin' was taken: the update is in progress, and receive() waits for its first bucket
        assert sock.poll(30_000) and sock.recv_multipart()[-1] == b'{"ok":true}'
        started = time.monotonic()
        receiver.close()
        waiting.join(10)
        assert not waiting.is_alive() and time.monotonic() - started < 5
        assert isinstance(raised[0], WeightUpdateAborted) and "closed while it waited" in str(raised[0])
    finally:
        sock.close()
    serves(engine, models[1])


def closing_lines():
    """Every line of rollout_engine/transport/closing.py's functions."""
    import dis
    import inspect

    from rollout_engine.transport import closing

    codes = [f.__code__ for _, f in inspect.getmembers(closing.Closing, inspect.isfunction)]
    codes += [c for code in codes for c in code.co_consts if inspect.iscode(c)]  # a generator's body
    return sorted({line for code in codes for _, line in dis.findlinestarts(code) if line})


@pytest.mark.parametrize("scenario", ["close", "receive", "close beside a receive"])
def test_a_signal_handlers_close_at_any_line_of_the_closing_code_ends_cleanly(engine, tmp_path, scenario):
    """A SIGALRM whose handler closes the receiver, raised as the main thread reaches each line of closing.py in
    turn (a signal runs its handler between any two bytecodes): no deadlock, no ZeroMQ error, the receive (if
    any) ends with WeightUpdateAborted or EngineError, and the endpoint is free afterwards."""
    import signal
    import sys

    from rollout_engine.transport import closing

    endpoint = f"ipc://{tmp_path}/weights"
    for line in closing_lines():
        receiver, fired, raised = WeightReceiver(engine, endpoint), [], []

        def trace(frame, event, arg, line=line):
            if frame.f_code.co_filename == closing.__file__ and event == "line" and frame.f_lineno == line \
                    and not fired:
                fired.append(signal.raise_signal(signal.SIGALRM))
            return trace

        previous = signal.signal(signal.SIGALRM, lambda *_, receiver=receiver: receiver.close())
        waiting = receive_in_thread(receiver) if scenario == "close beside a receive" else None
        time.sleep(0.05 if waiting else 0)
        sys.settrace(trace)
        try:
            receiver.close() if scenario != "receive" else receiver.receive(0.3)
        except (WeightUpdateAborted, EngineError) as err:
            raised.append(err)
        except WeightSyncTimeout:
            assert not fired, line  # a line receive() does not reach: it waited out its time
        finally:
            sys.settrace(None)
            signal.signal(signal.SIGALRM, previous)
        receiver.close()
        if waiting is not None:
            waiting[0].join(10)
            assert not waiting[0].is_alive() and isinstance(waiting[1][0], (WeightUpdateAborted, EngineError))
        assert scenario != "receive" or raised or not fired, line
        WeightReceiver(engine, endpoint).close()  # the endpoint is free
