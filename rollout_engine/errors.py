"""Errors the engine raises on purpose. Bad arguments are ValueErrors; engine-state refusals are EngineErrors."""


class EngineError(RuntimeError):
    """The engine refuses a call in its current state (asleep, weights incomplete, no room)."""


class WeightsNotReadyError(EngineError):
    """Weights were discarded or partly updated; a complete update or reload must arrive first."""


class EngineAsleepError(EngineError):
    """The engine is asleep; wake it first."""


class NoRoomError(EngineError):
    """The device has no room for what wake needs."""
