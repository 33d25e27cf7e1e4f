"""Triton kernels and their torch reference twins; `get_ops(device)` picks one set."""
import types

import torch

from . import activation, attention, copies, finite, fp8, norm, rotary, sampling

_NAMES = {
    "paged_attention": attention, "rms_norm": norm, "rope_store": rotary, "silu_and_mul": activation,
    "sample": sampling, "token_logprobs": sampling, "processed_probs": sampling, "rejection_sample": sampling,
    "copy_many": copies, "copy_plan": copies, "nonfinite": finite, "quantize_fp8": fp8, "fp8_linear": fp8,
}


def get_ops(device) -> types.SimpleNamespace:
    """The kernel set for `device`: Triton on CUDA, the torch references elsewhere."""
    suffix = "_triton" if torch.device(device).type == "cuda" else "_ref"
    return types.SimpleNamespace(**{name: getattr(mod, name + suffix) for name, mod in _NAMES.items()})
