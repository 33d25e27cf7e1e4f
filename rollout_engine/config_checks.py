"""The checks of the engine's device, dtype, tensor-parallel, batch-invariant, quantization and speculation
arguments, and the values they allow. Each refuses a bad value with a ValueError that names it; the resolve_*
ones return the value to use. EngineConfig.from_args (config.py) calls them in the order it checks. Below them,
the readers of config.json values that ModelConfig.from_dict uses: each reads a key as transformers does and
refuses a value transformers would not build a model from with a ValueError that names the key."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pool_layout import KV_DTYPES, positive_int, resolve_dtype

from .sampling_params import is_finite_number, is_int

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
# The step buffers (per row and per token) and the decode graphs (one per 16 rows) are sized by these; past them
# an engine only fails to allocate, far beyond a running set any KV pool holds (each running sequence holds a block)
MAX_NUM_SEQS = 1 << 16
MAX_NUM_BATCHED_TOKENS = 1 << 22


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


def check_tensor_parallel_modes(tp: int, spmd: bool, draft_model, quantization, batch_invariant) -> None:
    """Modes the tensor-parallel path does not run (yet): each refused by name. A process_group, even one of a
    single rank, takes that path, so the refusal names it."""
    by, instead = ((f"process_group (a group of {tp} rank{'s' if tp > 1 else ''})", "process_group=None") if spmd
                   else (f"tensor_parallel_size={tp}", "tensor_parallel_size=1"))
    for name, value, off in (("draft_model", draft_model, None), ("quantization", quantization, None),
                             ("batch_invariant", batch_invariant, False)):
        if value != off:
            raise ValueError(f"{by} cannot be combined with {name}={value!r}; use {name}={off!r} or {instead}")


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


def int_in(value, name: str, upper: int) -> int:
    """`value` if it is an int in [1, upper]."""
    if not is_int(value) or not 1 <= value <= upper:
        raise ValueError(f"{name}={value!r} is not allowed; an int in [1, {upper}]")
    return value


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


def resolve_kv_cache_dtype(value) -> torch.dtype:
    """The KV cache's dtype of a kv_cache_dtype other than None / "auto" (the engine's dtype)."""
    try:
        return resolve_dtype(value, "kv_cache_dtype")
    except ValueError:
        raise ValueError(f"kv_cache_dtype={value!r} is not supported; allowed: None or 'auto' (the engine's dtype), "
                         f"{', '.join(map(repr, sorted(KV_DTYPES)))} or those torch dtypes") from None


FP8_CAPABILITY = (8, 9)  # e4m3 tensor cores (cuBLASLt's fp8 matmul) and Triton's fp8 casts: Ada, Hopper and later


def check_fp8_device(device: torch.device, **uses) -> None:
    """Refuse fp8 (weights or KV cache: each keyword names its argument, a falsy value unused) on a CUDA GPU older
    than FP8_CAPABILITY, where its kernels would fail at the first step, with no word of the argument."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    for name, value in uses.items():
        if value and capability < FP8_CAPABILITY:
            raise ValueError(f"{name}={value!r} needs a GPU of compute capability {FP8_CAPABILITY[0]}."
                             f"{FP8_CAPABILITY[1]} or later (fp8 tensor cores); {device} is {capability[0]}."
                             f"{capability[1]}")


def resolve_engine_dtype(dtype, name: str, auto: torch.dtype) -> torch.dtype:
    if isinstance(dtype, str) and dtype == "auto":
        return auto
    resolved = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in DTYPES.values():
        raise ValueError(f"{name}={dtype!r} is not supported; allowed: 'auto', {sorted(DTYPES)} or those torch dtypes")
    return resolved


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ROPE_KEYS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings")}
# transformers' class default of each key a config.json may leave out, per model_type: an absent key takes the
# class's value, so the engine builds the model transformers builds. None: derived (heads, hidden / heads).
CLASS_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None, "head_dim": None},
    "mistral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "head_dim": None},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": None},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
}
# Mistral's sliding_window default; Qwen2's and Qwen3's under use_sliding_window (their max_window_layers: 28).
DEFAULT_WINDOW, DEFAULT_WINDOW_LAYERS = 4096, 28
LAYER_TYPES = ("full_attention", "sliding_attention")


def config_size(raw: dict, key: str, default) -> int | None:
    """config.json's `key` (`default` when absent): a positive int, or None (null: the caller derives it)."""
    value = raw.get(key, default)
    return None if value is None else positive_int(value, key)


def read_heads(raw: dict, defaults: dict) -> tuple[int, int, int]:
    """(attention heads, KV heads, head_dim), each KV head serving an equal group of query heads."""
    heads = raw["num_attention_heads"]
    kv_heads = config_size(raw, "num_key_value_heads", defaults["num_key_value_heads"]) or heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads}); "
                         "each KV head serves an equal group of query heads")
    return heads, kv_heads, config_size(raw, "head_dim", defaults["head_dim"]) or raw["hidden_size"] // heads


def config_number(value, key: str, low: float, inclusive: bool = False) -> float:
    """A finite number above `low` (or equal to it, if `inclusive`): a string, NaN or bool is refused."""
    if not is_finite_number(value) or value < low or (value == low and not inclusive):
        raise ValueError(f"{key} must be a finite number {'>=' if inclusive else '>'} {low}, got {value!r}")
    return float(value)


def eos_ids(values: dict, vocab_size: int) -> tuple[int, ...]:
    """The EOS ids of `values` (where each was read -> its eos_token_id): each an int, a list of ints or null, every
    id a token of the vocabulary (one past it is never sampled: the samples would run to max_tokens unannounced)."""
    ids = set()
    for where, value in values.items():
        listed = value if isinstance(value, list) else [] if value is None else [value]
        if not all(is_int(i) for i in listed):
            raise ValueError(f"{where} eos_token_id must be an int or a list of ints, got {value!r}")
        if any(not 0 <= i < vocab_size for i in listed):
            raise ValueError(f"{where} eos_token_id {value!r} is not a token of the model: ids are in [0, "
                             f"{vocab_size}) (vocab_size)")
        ids.update(listed)
    return tuple(sorted(ids))


def config_flag(raw: dict, key: str, default: bool) -> bool:
    """config.json's `key`, a JSON boolean: bool("false") is True."""
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"config.json's {key} must be true or false, got {value!r}")
    return value


def check_not_prequantized(raw: dict) -> None:
    """A quantization_config means stored weights the engine would read as plain floats."""
    if raw.get("quantization_config"):
        block = raw["quantization_config"]
        method = block.get("quant_method") if isinstance(block, dict) else None
        raise ValueError(f"quantization_config (quant_method={method!r}) is not supported: pre-quantized checkpoints "
                         "cannot be loaded; load the bfloat16/float16/float32 checkpoint, and pass quantization='fp8' "
                         "to quantize its linear weights at load")


def read_rope(raw: dict, max_positions: int) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None for plain rope) as transformers resolves them: rope_scaling wins over
    rope_parameters; the chosen dict's rope_theta over a top-level one (else 10000); for llama3 a top-level
    original_max_position_embeddings wins over the dict's (else max_position_embeddings)."""
    name = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    rope = raw.get(name) or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{name} must be one dict of rope parameters (per-layer rope is not supported), got {rope!r}")
    rope = dict(rope)
    theta = config_number(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta", 0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "llama3":
        original = "original_max_position_embeddings"
        rope[original] = raw[original] if original in raw else rope.get(original, max_positions)
    absent = [k for k in ROPE_KEYS.get(rope_type, ()) if not is_finite_number(rope.get(k))]
    if absent:
        raise ValueError(f"rope type {rope_type!r} needs {list(ROPE_KEYS[rope_type])}; {absent} missing or not "
                         "numbers")
    for key in ("factor", "original_max_position_embeddings"):
        if key in ROPE_KEYS.get(rope_type, ()):
            config_number(rope[key], f"{name}[{key!r}]", 0)
    return theta, rope if rope_type != "default" else None


def sliding_window(arch: str, raw: dict, layers: int) -> int | None:
    """The sliding window transformers applies: Mistral's on every layer (None: full attention), Qwen2's and
    Qwen3's on the layers layer_types names sliding (by default those from max_window_layers on) when
    use_sliding_window is set, Llama's never. The engine caps sequences at the window, so attention stays exact
    on every layer, sliding or not."""
    if arch == "MistralForCausalLM":
        window = raw.get("sliding_window", DEFAULT_WINDOW)
        return None if window is None else positive_int(window, "sliding_window")
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return None
    window = raw.get("sliding_window", DEFAULT_WINDOW) if raw.get("use_sliding_window", False) else None
    window = None if window is None else positive_int(window, "sliding_window")
    first = raw.get("max_window_layers", DEFAULT_WINDOW_LAYERS)
    if not is_int(first):
        raise ValueError(f"max_window_layers must be an int, got {first!r}")
    types = raw.get("layer_types")
    if types is None:
        types = [LAYER_TYPES[window is not None and i >= first] for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must list {layers} (num_hidden_layers) of {list(LAYER_TYPES)}, got {types!r}")
    # Within the window a sliding layer attends as a full one does, so one cap serves a mix of the two as well.
    return window if "sliding_attention" in types else None
