"""An OpenAI-compatible HTTP server over AsyncEngine (`rollout-engine serve`; needs the `[server]` extra)."""
from .app import create_app

__all__ = ["create_app"]
