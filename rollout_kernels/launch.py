"""Where a Triton launch runs: Triton's interpreter on the host (TRITON_INTERPRET=1, read by triton at its
first import) or a CUDA device, and how many SMs a launch has to fill there."""
import functools
import os

import torch

INTERPRETER_SMS = 4  # off CUDA: a stand-in SM count, so small launches take the parallel paths too


def interpreted() -> bool:
    """Whether Triton kernels run in the interpreter, on host tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """Streaming multiprocessors of `device`; INTERPRETER_SMS off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
