"""rollout-engine: generation for RL rollouts, beside the trainer on the same GPUs."""
from .async_engine import AsyncEngine
from .engine import Engine
from .errors import (
    EngineAsleepError,
    EngineBusyError,
    EngineDeadError,
    EngineError,
    NoRoomError,
    NonFiniteLogitsError,
    WeightsNotReadyError,
    WeightSyncTimeout,
    WeightUpdateAborted,
    WeightUpdateRejected,
)
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams, processed_logprobs

__version__ = "0.1.0"
__all__ = ["AsyncEngine", "CompletionOutput", "Engine", "EngineAsleepError", "EngineBusyError", "EngineDeadError", "EngineError", "NoRoomError",
           "NonFiniteLogitsError", "RequestOutput", "SamplingParams", "WeightSyncTimeout", "WeightUpdateAborted",
           "WeightUpdateRejected", "WeightsNotReadyError",
           "__version__", "processed_logprobs"]
