"""How the HTTP server stops on SIGTERM or Ctrl-C (uvicorn's signal handling, then its shutdown).

Listening stops at once; requests in flight may finish for `shutdown_timeout` seconds (vLLM's --shutdown-timeout;
0: none may), then those still running end as "abort": a partial output (a completion a rollout can resume), a
stream closed with its finish_reason and [DONE]. Left to uvicorn, its grace period would end by cancelling them:
a bare 500, which the openai client retries into a closing port, or a stream cut mid-body.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

from ..errors import EngineError

ANSWER_S = 5.0  # after the abort, for the aborted requests' answers to be written before uvicorn cancels them
log = logging.getLogger("uvicorn.error")


def draining_server(app, engine, shutdown_timeout: float, **config) -> "DrainingServer":
    """uvicorn.run's Server for `app` (whose engine is `engine`), with uvicorn.Config's keyword arguments."""
    config = uvicorn.Config(app, timeout_graceful_shutdown=shutdown_timeout + ANSWER_S, **config)
    return DrainingServer(config, engine, shutdown_timeout)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine, shutdown_timeout: float):
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        ending = asyncio.ensure_future(self._abort_after(self.shutdown_timeout))  # runs once listening has stopped
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()

    async def _abort_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        if self.server_state.tasks:
            log.info("Ending %d request(s) still running after %g s as 'abort'", len(self.server_state.tasks), seconds)
        with contextlib.suppress(EngineError):  # an engine already gone has ended them (503)
            await self.engine.pause_generation("abort")
