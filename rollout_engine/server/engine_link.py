"""EngineLink: the engine process and the two ZeroMQ sockets to it, in a private 0700 directory. Commands go out
on one, tokens and replies come back on the other, in order. What the messages mean is EngineClient's job."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import zmq

from ..errors import EngineError
from ..transport.endpoints import check_bound, check_endpoint, check_ipc_path, private_ipc_endpoint
from .wire import MAX_MESSAGE_BYTES, error_from, pack, unpack

COMMAND_QUEUE = 100_000    # commands that may wait for the engine to take them
ENGINE_MAIN = "import sys; from rollout_engine.server.engine_main import main; sys.exit(main())"


def open_socket(context: zmq.Context, kind: int, endpoint: str, bind: bool, options: dict | None = None) -> zmq.Socket:
    """A socket between the front and the engine process, on either side: it drops what is unsent when closed, a
    PULL one refuses messages over MAX_MESSAGE_BYTES, and `options` (ZeroMQ option -> value) are set before it
    binds (its ipc path checked first, and that it is bound there after) or connects."""
    check_endpoint(endpoint)
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PULL:
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    for option, value in (options or {}).items():
        sock.setsockopt(option, value)
    if bind:
        check_ipc_path(endpoint[len("ipc://"):])
        sock.bind(endpoint)
        check_bound(sock, endpoint)
    else:
        sock.connect(endpoint)
    return sock


class EngineLink:
    def __init__(self, config: dict, weight_receiver: bool):
        """Bind the outputs socket, connect the commands one and start the engine process with `config` (what
        engine_main.main reads, less the endpoints, which are chosen here). A failure on the way leaves no
        socket or directory behind."""
        commands = private_ipc_endpoint("engine-commands")
        self.dir = os.path.dirname(commands[len("ipc://"):])
        self.context = zmq.Context()
        try:
            self._start(config, commands, weight_receiver)
        except BaseException:
            self.context.destroy(linger=0)
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def _start(self, config: dict, commands: str, weight_receiver: bool) -> None:
        outputs = f"ipc://{self.dir}/engine-outputs"
        self.outputs = open_socket(self.context, zmq.PULL, outputs, bind=True)
        self.commands = open_socket(self.context, zmq.PUSH, commands, bind=False, options={zmq.SNDHWM: COMMAND_QUEUE})
        self.command_endpoint = commands
        # where a WeightSender connects (the engine process binds its receiver there); None: no receiver
        self.weight_endpoint = check_endpoint(f"ipc://{self.dir}/weights") if weight_receiver else None
        config = {**config, "commands": commands, "outputs": outputs, "front_pid": os.getpid(),
                  "weights": self.weight_endpoint}
        # main() by import rather than `-m`, whose runpy warns when the package has imported the module already
        self.proc = subprocess.Popen([sys.executable, "-c", ENGINE_MAIN, json.dumps(config)])

    @property
    def closed(self) -> bool:
        return self.context.closed

    def exit_code(self) -> int | None:
        """The engine process's exit code; None while it lives."""
        return self.proc.poll()

    def wait_ready(self, timeout_s: float) -> dict:
        """The engine's "ready" info, once its model is loaded; its start-up error raised here."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.outputs.poll(200):
                header, _ = unpack(self.outputs.recv_multipart())
                if header["kind"] == "ready":
                    return header["info"]
                if header["kind"] == "startup_failed":
                    raise error_from(header.get("error"))
            if self.exit_code() is not None:
                raise EngineError(f"the engine process exited with code {self.proc.returncode} before it was "
                                  "ready (its output is above)")
        raise EngineError(f"the engine process was not ready within {timeout_s:g} s")

    def send(self, header: dict) -> None:
        frames = pack(header)
        size = sum(map(len, frames))
        if size > MAX_MESSAGE_BYTES:  # the engine's socket would drop it unread, and its caller wait forever
            raise ValueError(f"the request makes a {size}-byte message to the engine process (its prompt, stop "
                             f"strings and parameters as JSON, non-ASCII escaped); at most {MAX_MESSAGE_BYTES}")
        try:
            self.commands.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            raise EngineError(f"the engine process is not taking commands ({COMMAND_QUEUE} are waiting)") from None

    def received(self) -> list | None:
        """The next message's frames, or None when none is waiting."""
        try:
            return self.outputs.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def close(self, timeout_s: float) -> None:
        """Stop the engine process (asked, then terminated, then killed) and remove the sockets' directory."""
        if self.closed:
            return
        if self.exit_code() is None:
            try:
                self.commands.send_multipart(pack({"kind": "shutdown"}), zmq.NOBLOCK)
                self.proc.wait(timeout_s)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self.context.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)  # its sockets too, where the engine was killed before it left
