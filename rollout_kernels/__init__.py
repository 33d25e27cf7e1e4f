"""Triton kernels and their torch reference twins; `get_ops(device)` picks one set."""
import functools
import types

import torch
import torch.nn.functional as F

from . import activation, attention, copies, decode_attention, finite, fp8, gemv, norm, rotary, sampling
from . import batch_invariant as invariant_matmul

_NAMES = {
    "paged_attention": attention, "rms_norm": norm, "rms_norm_fp8": norm, "rope_store": rotary,
    "silu_and_mul": activation, "silu_and_mul_fp8": activation,
    "sample": sampling, "token_logprobs": sampling, "processed_probs": sampling, "rejection_sample": sampling,
    "copy_many": copies, "copy_plan": copies, "nonfinite": finite, "quantize_fp8": fp8, "fp8_scale": fp8,
    "quantize_fp8_scaled": fp8, "fp8_linear": fp8, "quantize_shards_plan": fp8,
}
# The Triton sampling kernels that split a row's vocabulary across programs (rollout_kernels/sampling.py).
_VOCAB_SPLIT = ("sample", "token_logprobs", "processed_probs", "rejection_sample")


def get_ops(device, batch_invariant: bool = False) -> types.SimpleNamespace:
    """The kernel set for `device`: Triton on CUDA, the torch references elsewhere, and `linear` (y = x W^T + b).

    batch_invariant: every op's result for one row (token, sequence) has the same bits whatever else the
    launch holds (rollout_kernels/batch_invariant.py audits each op): `linear` is the batch-invariant matmul,
    attention takes its fixed key split, and the Triton sampling kernels split the vocabulary by the
    vocabulary alone. The other ops are per-row already."""
    triton_ops = torch.device(device).type == "cuda"
    suffix = "_triton" if triton_ops else "_ref"
    ops = {name: getattr(mod, name + suffix) for name, mod in _NAMES.items()} | {"linear": F.linear}
    ops = gemv.with_batch1_path(ops, triton_ops)
    if batch_invariant:
        ops["linear"] = getattr(invariant_matmul, "batch_invariant_linear" + suffix)
        ops["paged_attention"] = functools.partial(ops["paged_attention"], fixed_split=True)
        if triton_ops:
            ops |= {name: functools.partial(ops[name], splits=sampling.FIXED_VOCAB_SPLITS) for name in _VOCAB_SPLIT}
    ops = gemv.with_fused_ops(ops, fused=triton_ops and not batch_invariant)
    ops = decode_attention.with_fused_attention(ops, fused=triton_ops and not batch_invariant)
    return types.SimpleNamespace(**ops)
