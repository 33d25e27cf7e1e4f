"""An OpenAI-compatible HTTP server (`rollout-engine serve`; needs the `[server]` extra): the HTTP front in one
process, the engine in another (engine_process.py), talking over ZeroMQ (engine_client.py, engine_link.py, wire.py)."""
from .app import create_app
from .engine_client import EngineClient

__all__ = ["EngineClient", "create_app"]
