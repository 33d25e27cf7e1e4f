"""The engine process's entry: `main(CONFIG_JSON)` connects to the front's sockets (engine_link.py chose them),
builds the Engine and its WeightInbox, and serves an EngineLoop (engine_process.py) until it leaves. A start-up
failure is sent to the front as "startup_failed", which raises it as the server's start-up error."""
from __future__ import annotations

import json
import os
import signal
import sys

import zmq

from ..engine import Engine
from ..transport.endpoints import check_bound, check_endpoint, check_ipc_path
from .engine_process import SEND_TIMEOUT_MS, EngineLoop
from .weight_inbox import WeightInbox
from .wire import MAX_MESSAGE_BYTES, error_fields, pack


def _socket(context: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PULL:
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    else:
        sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    check_endpoint(endpoint)
    if bind:
        check_ipc_path(endpoint[len("ipc://"):])
        sock.bind(endpoint)
        check_bound(sock, endpoint)
    else:
        sock.connect(endpoint)
    return sock


def main(argv=None) -> int:
    config = json.loads((argv or sys.argv[1:])[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when this process ends (Ctrl-C reaches both)
    if config.get("switch_interval_s"):
        sys.setswitchinterval(config["switch_interval_s"])
    context = zmq.Context()
    outputs = _socket(context, zmq.PUSH, config["outputs"], bind=False)
    try:
        commands = _socket(context, zmq.PULL, config["commands"], bind=True)
        engine = Engine(config["model"], **config["engine_kwargs"])
        inbox = WeightInbox(engine, config["weights"]) if config.get("weights") else None
    except Exception as err:  # noqa: BLE001 - the front raises it as the server's start-up error
        outputs.setsockopt(zmq.LINGER, 5000)
        outputs.send_multipart(pack({"kind": "startup_failed", "error": error_fields(err)}))
        outputs.close()
        return 1
    socket_dir = os.path.dirname(config["commands"][len("ipc://"):])
    EngineLoop(engine, commands, outputs, config["front_pid"], socket_dir, inbox).serve()
    if inbox is not None:
        inbox.close()
    outputs.setsockopt(zmq.LINGER, 2000)  # what is still queued (the last replies) goes out first
    outputs.close()
    commands.close()
    return 0
