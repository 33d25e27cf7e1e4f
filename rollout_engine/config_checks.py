"""The checks of the engine's device, dtype, tensor-parallel, batch-invariant, quantization and speculation
arguments, and the values they allow. Each refuses a bad value with a ValueError that names it; the resolve_*
ones return the value to use. EngineConfig.from_args (config.py) calls them in the order it checks."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pool_layout import positive_int

if TYPE_CHECKING:
    from .config import ModelConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# "fp8": the decoder's projections (qkv, o, gate_up, down) in float8_e4m3fn; "fp8_lm_head": those and an
# untied LM head. The embedding and the norms stay in the engine's dtype.
QUANTIZATIONS = ("fp8", "fp8_lm_head")
# The most tokens one speculative step may propose. A step keeps proposals only up to the first rejection, so
# the chance that proposal j is kept falls geometrically with j (a^j at acceptance rate a): tokens per step
# level off near 1 / (1 - a) while every proposal costs a draft pass, so long proposals never pay. The proposal
# buffers grow with k x vocabulary (SPEC_MAX_BATCH x k x vocab floats: 1.25 GB at 64 with a 152k vocabulary).
MAX_SPECULATIVE_TOKENS = 64


def resolve_device(device) -> torch.device:
    try:
        resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a device; allowed: None, 'cpu', 'cuda', 'cuda:N'") from err
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; allowed: None, 'cpu', 'cuda', 'cuda:N'")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available on this machine; use device='cpu'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    return resolved


def resolve_tensor_parallel_size(size, group) -> int:
    """None: 1, or the process group's size; an explicit size must be the group's."""
    if group is None:
        return 1 if size is None else positive_int(size, "tensor_parallel_size")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"process_group must be a torch.distributed ProcessGroup (dist.new_group(...) or "
                         f"dist.group.WORLD), got {type(group).__name__}")
    if size is not None and positive_int(size, "tensor_parallel_size") != group.size():
        raise ValueError(f"tensor_parallel_size={size} differs from the process_group's size ({group.size()}); "
                         "every rank of the group holds a shard: leave tensor_parallel_size None or pass "
                         f"{group.size()}")
    return group.size()


def resolve_group_device(group, device: torch.device) -> torch.device:
    """SPMD: this rank's device, which the group's backend must reach (NCCL for CUDA, gloo for the CPU);
    'cuda' without an index is the current CUDA device (torch.cuda.set_device(local_rank) picks it)."""
    try:
        backend = str(dist.get_backend(group))
    except (ValueError, RuntimeError) as err:
        raise ValueError(f"process_group is not a group of an initialised torch.distributed job: {err}") from None
    need = "nccl" if device.type == "cuda" else "gloo"
    if need not in backend:
        raise ValueError(f"process_group's backend {backend!r} does not run on device={str(device)!r}; "
                         f"a process_group on {device.type} needs the {need} backend")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_tensor_parallel_modes(tp: int, draft_model, quantization, batch_invariant) -> None:
    """Modes the tensor-parallel path does not run (yet): each refused by name."""
    for name, value, off in (("draft_model", draft_model, None), ("quantization", quantization, None),
                             ("batch_invariant", batch_invariant, False)):
        if value != off:
            raise ValueError(f"tensor_parallel_size={tp} cannot be combined with {name}={value!r}; "
                             f"use {name}={off!r} or tensor_parallel_size=1")


def check_tensor_parallel_shapes(tp: int, model: ModelConfig, device: torch.device, spmd: bool) -> None:
    """Every rank holds an equal share of the heads, KV heads, MLP columns and vocabulary, on a device of its own
    (SPMD: the caller's rank picks its device; one process: devices device..device + tp - 1)."""
    if device.type == "cuda" and not spmd:
        first, count = device.index or 0, torch.cuda.device_count()
        if first + tp > count:
            raise ValueError(f"tensor_parallel_size={tp} needs CUDA devices {first}..{first + tp - 1}, one per rank; "
                             f"this machine has {count}")
    for name, count in (("num_key_value_heads", model.num_kv_heads), ("num_attention_heads", model.num_heads),
                        ("intermediate_size", model.intermediate_size), ("vocab_size", model.vocab_size)):
        if count % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name} ({count}); each rank "
                             f"holds an equal share: use a tensor_parallel_size that divides {count}")


def flag(value, name: str) -> bool:
    """`value` if it is a bool: bool("false") is True, so anything else is refused."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not allowed; True or False")
    return value


def check_batch_invariant(value, quantization, draft_model) -> None:
    """batch_invariant is a bool, and True runs only where every op can be made batch-invariant: fp8
    projections scale each activation tensor by its max over the whole batch, and speculative decoding's
    verification splits the vocabulary by the batch (rollout_kernels/batch_invariant.py audits every op)."""
    flag(value, "batch_invariant")
    if value and quantization is not None:
        raise ValueError(f"batch_invariant=True cannot be combined with quantization={quantization!r} (fp8 scales "
                         "each activation by its batch's max); use quantization=None")
    if value and draft_model is not None:
        raise ValueError(f"batch_invariant=True cannot be combined with speculative decoding (draft_model="
                         f"{draft_model!r}); use draft_model=None")


def check_batch_invariant_cache(batch_invariant: bool, kv_dtype: torch.dtype, kv_cache_dtype) -> None:
    """batch_invariant=True needs a 2- or 4-byte KV cache: an e4m3 cache's attention factors each key tile's
    largest value scale out, and a prefill tile also loads the keys after a row's own, so its bits would hang
    on how the queries are cut."""
    if batch_invariant and kv_dtype.itemsize == 1:
        raise ValueError(f"batch_invariant=True cannot be combined with kv_cache_dtype={kv_cache_dtype!r} (an "
                         "fp8 KV cache's attention rounds by the scales of the keys its tile loads, which move "
                         "with how the prompt is chunked); use a 2- or 4-byte kv_cache_dtype")


def check_speculative_tokens(k: int, max_model_len: int) -> None:
    """A step proposes k tokens after a sequence's last one, all within max_model_len: a k that cannot fit
    never speculates, yet its proposal buffers would be allocated."""
    most = min(MAX_SPECULATIVE_TOKENS, max_model_len - 1)
    if most < 1:
        raise ValueError(f"num_speculative_tokens={k} is not allowed with max_model_len={max_model_len}: "
                         "speculative decoding needs max_model_len >= 2; raise max_model_len or use draft_model=None")
    if k > most:
        raise ValueError(f"num_speculative_tokens={k} is not allowed; 1..{most} (at most "
                         f"{MAX_SPECULATIVE_TOKENS}, and below max_model_len={max_model_len})")


def check_quantization(value, name: str) -> None:
    if value is not None and (not isinstance(value, str) or value not in QUANTIZATIONS):
        raise ValueError(f"{name}={value!r} is not supported; allowed: None, {', '.join(map(repr, QUANTIZATIONS))}"
                         + (", 'auto' (as quantization)" if name == "draft_quantization" else ""))


def resolve_engine_dtype(dtype, name: str, auto: torch.dtype) -> torch.dtype:
    if isinstance(dtype, str) and dtype == "auto":
        return auto
    resolved = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in DTYPES.values():
        raise ValueError(f"{name}={dtype!r} is not supported; allowed: 'auto', {sorted(DTYPES)} or those torch dtypes")
    return resolved
