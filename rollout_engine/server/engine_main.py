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
from .engine_link import open_socket
from .engine_process import SEND_TIMEOUT_MS, EngineLoop
from .weight_inbox import WeightInbox
from .wire import error_fields, pack


def main(argv=None) -> int:
    config = json.loads((argv or sys.argv[1:])[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front decides when this process ends (Ctrl-C reaches both)
    if config.get("switch_interval_s"):
        sys.setswitchinterval(config["switch_interval_s"])
    context = zmq.Context()
    outputs = open_socket(context, zmq.PUSH, config["outputs"], bind=False, options={zmq.SNDTIMEO: SEND_TIMEOUT_MS})
    try:
        commands = open_socket(context, zmq.PULL, config["commands"], bind=True)
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
