"""The server's weight receiver (`serve --weight-receiver`): a trainer process on the same host pushes new weights
into the serving engine with a transport.WeightSender, without writing a checkpoint.

It listens on an ipc socket in the server's private 0700 directory, so only this user's processes can reach it
(GET /weight_receiver tells the address, behind the API key where there is one). The engine process polls it with
its command socket; once a sender's 'begin' has arrived, the update is served whole between two steps: the
requests in flight wait, then go on under the new weights (their `weight_versions` say where the switch fell), as
after AsyncEngine.update_weights. To hold them first, POST /pause_generation before the send and
/continue_generation after it. A failed update has been answered to its sender (WeightUpdateRejected there); the
engine keeps its old weights, or, if some tensors were copied, refuses to generate until a complete update
arrives (/health's weights_ready), as WeightReceiver.receive leaves it. While an update is in progress the
engine takes no command: a sender that stops part-way holds it for the receiver's timeout_s per message.
"""
from __future__ import annotations

import sys

from ..request_control import RequestControl
from ..transport import WeightReceiver


class _Announcing:
    """The engine as WeightReceiver uses it (`device`, `weights`, `update_weights_from_buckets`), telling the front
    its new status once an update is applied or has failed, before the sender hears back: a trainer that reads
    /health when send() returns sees the update."""

    def __init__(self, engine, inbox: "WeightInbox"):
        self._engine, self._inbox = engine, inbox

    device = property(lambda self: self._engine.device)
    weights = property(lambda self: self._engine.weights)

    def update_weights_from_buckets(self, *args):
        try:
            return self._engine.update_weights_from_buckets(*args)
        finally:
            self._inbox.announce()


class WeightInbox:
    def __init__(self, engine, endpoint: str):
        self.announce = lambda: None  # the engine loop's: send the front the engine's status
        self.receiver = WeightReceiver(_Announcing(engine, self), endpoint)
        self.endpoint, self.socket = self.receiver.endpoint, self.receiver.socket

    def serve(self, control: RequestControl) -> None:
        """The update whose 'begin' has arrived (no wait for one), between two steps; a failure is logged."""
        try:
            control.between_steps(self.receiver.receive, 0)
        except Exception as err:  # noqa: BLE001 - its sender was answered; the engine serves on
            print(f"rollout-engine engine process: a pushed weight update failed: {err}", file=sys.stderr)

    def close(self) -> None:
        self.receiver.close()
