"""Errors the engine raises on purpose. Bad arguments are ValueErrors; engine-state refusals are EngineErrors."""


class EngineError(RuntimeError):
    """The engine refuses a call in its current state (asleep, weights incomplete, no room)."""


class WeightsNotReadyError(EngineError):
    """Weights were discarded or partly updated; a complete update or reload must arrive first."""


class EngineAsleepError(EngineError):
    """The engine is asleep; wake it first."""


class NoRoomError(EngineError):
    """The device has no room for what wake needs."""


class EngineBusyError(EngineError):
    """A public call came while another was running (from another thread): Engine serves one thread at a time."""


class NonFiniteLogitsError(EngineError):
    """The model produced NaN or inf logits for a request (its weights or inputs are broken)."""


class WeightSyncTimeout(EngineError):
    """A weight-sync peer did not answer in time."""


class WeightUpdateRejected(EngineError):
    """The receiving engine answered a weight-sync message with an error (it has ended the update on its side)."""

    def __init__(self, error: str, retry: bool = False):
        super().__init__(f"the engine rejected the weight update: {error}")
        self.retry = retry


class WeightUpdateAborted(EngineError):
    """A weight update ended before its 'end': the sender sent 'abort', or a new 'begin' superseded it."""


class EngineDeadError(EngineError):
    """An engine's process is gone (an EnginePool actor killed or crashed): calls to it cannot be answered."""


def add_note(err: BaseException, note: str) -> None:
    """err.add_note(note), on Python 3.10 too (no add_note there: the note is kept in __notes__, unshown)."""
    if hasattr(err, "add_note"):
        err.add_note(note)
    else:
        err.__notes__ = [*getattr(err, "__notes__", []), note]
