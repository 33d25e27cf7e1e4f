"""ModelConfig: the facts of a Hugging Face Llama-family checkpoint the engine needs, from config.json."""
from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from pool_layout import positive_int

from .config_checks import (CLASS_DEFAULTS, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, check_batch_invariant,
                            check_batch_invariant_cache, check_fp8_device, check_not_prequantized, check_quantization,
                            check_speculative_tokens, check_tensor_parallel_modes, check_tensor_parallel_shapes,
                            config_flag, config_number, eos_ids, flag, int_in, read_heads, read_rope, resolve_device,
                            resolve_engine_dtype, resolve_group_device, resolve_kv_cache_dtype,
                            resolve_tensor_parallel_size, sliding_window)
from .sampling_params import SEED_RANGE, is_int, is_seed

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# The MLP computes act(gate) * up with SiLU, which transformers names "silu" or "swish".
SUPPORTED_ACTIVATIONS = ("silu", "swish")
# transformers' model_type of each architecture: it builds the model from model_type, so the two must agree.
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _biases(arch: str, raw: dict) -> tuple[bool, bool, bool]:
    """(qkv, o, mlp) biases as transformers builds each architecture: Llama's from attention_bias and mlp_bias,
    Qwen3's qkv and o from attention_bias, Qwen2's qkv always, Mistral none."""
    attention = bool(raw.get("attention_bias", False))
    if arch == "LlamaForCausalLM":
        return attention, attention, bool(raw.get("mlp_bias", False))
    if arch == "Qwen3ForCausalLM":
        return attention, attention, False
    return arch == "Qwen2ForCausalLM", False, False


def _read_json(path: Path) -> dict:
    """A JSON object from `path`; a malformed file is a ValueError that names it."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not readable JSON: {err}") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None
    quantization: str | None = None  # how the engine stores this model's linear weights (config_checks.QUANTIZATIONS)

    @classmethod
    def from_dir(cls, path, need_weights: bool = True, arg: str = "model_path") -> "ModelConfig":
        """`arg`: the argument that named `path` (model_path, draft_model), so an error names it."""
        if isinstance(path, str) and not path.strip():  # Path("") is ".": the working directory, silently
            raise ValueError(f"{arg}={path!r} is not allowed; a Hugging Face checkpoint directory")
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"{arg} {str(path)!r} has no config.json (expected a Hugging Face checkpoint directory)")
        if need_weights and not list(path.glob("*.safetensors")):
            raise ValueError(f"{arg} {str(path)!r} has no *.safetensors weights")
        raw = _read_json(path / "config.json")
        gen = path / "generation_config.json"
        try:
            return cls.from_dict(raw, _read_json(gen) if gen.is_file() else {})
        except ValueError as err:
            raise ValueError(f"{path / 'config.json'}: {err}") from err

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> "ModelConfig":
        missing = [k for k in REQUIRED_KEYS if not isinstance(raw.get(k), int) or isinstance(raw.get(k), bool)
                   or raw[k] < 1]
        if missing:
            raise ValueError(f"config keys {missing} are missing or not positive ints; a Llama-family config "
                             f"needs {list(REQUIRED_KEYS)}")
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"architectures={archs} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}")
        if raw.get("model_type", MODEL_TYPES[arch]) != MODEL_TYPES[arch]:
            raise ValueError(f"model_type={raw['model_type']!r} does not match architectures={archs} (expected "
                             f"{MODEL_TYPES[arch]!r}): transformers builds the model from model_type")
        activation = raw.get("hidden_act", "silu")
        if activation not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act={activation!r} is not supported; allowed: {list(SUPPORTED_ACTIVATIONS)} "
                             "(the MLP computes silu(gate) * up)")
        check_not_prequantized(raw)
        defaults = CLASS_DEFAULTS[MODEL_TYPES[arch]]
        heads, kv_heads, head_dim = read_heads(raw, defaults)
        max_positions = positive_int(raw.get("max_position_embeddings", defaults["max_position_embeddings"]),
                                     "max_position_embeddings")
        rope_theta, rope = read_rope(raw, max_positions)
        qkv_bias, o_bias, mlp_bias = _biases(arch, raw)
        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        if dtype_name not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"torch_dtype={dtype_name!r} is not supported; allowed: float32, float16, bfloat16")
        eos = eos_ids({"generation_config.json's": (generation or {}).get("eos_token_id"),
                       "config.json's": raw.get("eos_token_id")}, raw["vocab_size"])
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=config_number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", 0, inclusive=True),
            rope_theta=rope_theta,
            rope_scaling=rope,
            max_position_embeddings=max_positions,
            tie_word_embeddings=config_flag(raw, "tie_word_embeddings", False),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            dtype=getattr(torch, dtype_name),
            eos_token_ids=eos,
            sliding_window=sliding_window(arch, raw, raw["num_hidden_layers"]),
        )

    def check_same_function(self, raw: dict) -> None:
        """ValueError where a transformers config dict `raw`, read as a checkpoint's is read, makes weights of
        this config's shapes compute another function: its embedding tie, its rotary frequencies (rope_theta and
        rope scaling, compared as frequencies: transformers writes a legacy "type" key again as "rope_type") or its
        RMSNorm epsilon; or where it holds values no checkpoint could."""
        positions = positive_int(raw.get("max_position_embeddings", self.max_position_embeddings),
                                 "max_position_embeddings")
        theta, scaling = read_rope(raw, positions)
        eps = config_number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", 0, inclusive=True)
        tied = config_flag(raw, "tie_word_embeddings", self.tie_word_embeddings)
        if tied != self.tie_word_embeddings:  # one side's lm_head would be the other's embedding
            what = f"tie_word_embeddings {tied}, the engine's checkpoint {self.tie_word_embeddings}"
        elif not torch.equal(replace(self, rope_theta=theta, rope_scaling=scaling).inv_freq(), self.inv_freq()):
            what = f"rope_theta and rope scaling {(theta, scaling)!r}, the engine's checkpoint " \
                   f"{(self.rope_theta, self.rope_scaling)!r}"
        elif eps != self.rms_norm_eps:
            what = f"rms_norm_eps {eps!r}, the engine's checkpoint {self.rms_norm_eps!r}"
        else:
            return
        raise ValueError(f"the model's config has {what}: the same weights would compute another function; load "
                         "the engine from a checkpoint of the model's config")

    def inv_freq(self) -> torch.Tensor:
        """Rotary inverse frequencies, with linear or Llama-3 scaling applied (as transformers does)."""
        inv = 1.0 / self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim)
        s = self.rope_scaling
        if s is None:
            return inv
        kind = s.get("rope_type", s.get("type"))
        factor = float(s["factor"])
        if kind == "linear":
            return inv / factor
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_len = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)


LOAD_FORMATS = ("safetensors", "dummy")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's arguments, validated, with the limits derived from them and the checkpoints."""

    model_path: Path
    model: ModelConfig
    draft_path: Path | None      # a draft checkpoint, or None (no draft, or prompt lookup)
    draft: ModelConfig | None
    speculation: str | None      # None, "model" or "ngram"
    num_speculative_tokens: int
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    kv_cache_memory: int | float
    max_num_seqs: int
    max_model_len: int           # before the pool is sized; the engine may only lower it, once, at start
    max_num_batched_tokens: int
    block_size: int
    enable_prefix_caching: bool
    use_graphs: bool
    load_format: str
    check_finite: bool
    seed: int
    batch_invariant: bool
    quantization: str | None
    tensor_parallel_size: int = 1
    process_group: object = None  # SPMD: the caller's torch.distributed group, whose every rank builds an engine
    max_model_len_given: bool = False  # the caller chose max_model_len (else it is the model's own limit)

    def pool_max_model_len(self, pool_tokens: int) -> int:
        """max_model_len as a KV pool of `pool_tokens` allows: one sequence must always fit, or preemption could
        never make room for it. A length the caller chose that the pool cuts is warned about: samples would end
        ("length") sooner than asked, with nothing else to say why."""
        if self.max_model_len_given and pool_tokens < self.max_model_len:
            warnings.warn(f"max_model_len={self.max_model_len} is more than the KV pool holds ({pool_tokens} tokens, "
                          "a draft model's cache included): sequences end at that length; give the pool more memory "
                          "(kv_cache_memory) or ask for less", UserWarning, stacklevel=3)
        return min(self.max_model_len, pool_tokens)

    def rank_settings(self) -> tuple:
        """What every SPMD rank's engine must share: every field but the paths (each rank may read its own copy),
        the device, the KV budget (the ranks take the least block count) and the process group."""
        own = {"model_path", "draft_path", "device", "kv_cache_memory", "process_group"}
        return tuple((f.name, getattr(self, f.name)) for f in fields(self) if f.name not in own)

    @classmethod
    def from_args(cls, model_path, device=None, dtype="auto", kv_cache_memory=0.3, max_num_seqs=256,
                  max_model_len=None, block_size=16, enable_prefix_caching=True, draft_model=None,
                  num_speculative_tokens=0, tensor_parallel_size=None, seed=0, max_num_batched_tokens=None,
                  kv_cache_dtype=None, enforce_eager=False, load_format="safetensors",
                  check_finite=True, batch_invariant=False, quantization=None,
                  draft_quantization="auto", process_group=None) -> "EngineConfig":
        from .spec import NGRAM

        check_quantization(quantization, "quantization")  # a bad value named as such, before any combination
        tp = resolve_tensor_parallel_size(tensor_parallel_size, process_group)
        if tp > 1 or process_group is not None:
            check_tensor_parallel_modes(tp, process_group is not None, draft_model, quantization, batch_invariant)
        check_batch_invariant(batch_invariant, quantization, draft_model)
        if draft_quantization != "auto":
            check_quantization(draft_quantization, "draft_quantization")
            if draft_model is None or draft_model == NGRAM:
                raise ValueError(f"draft_quantization={draft_quantization!r} needs a draft_model checkpoint")
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={load_format!r} is not allowed; 'safetensors' or 'dummy' (random weights)")
        if draft_model is None and not (is_int(num_speculative_tokens) and num_speculative_tokens == 0):
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} needs a draft_model; without one, 0")
        if draft_model is not None:
            positive_int(num_speculative_tokens, "num_speculative_tokens (with a draft_model)")
        if not isinstance(model_path, (str, Path)):
            raise ValueError("model_path must be a checkpoint directory (str or Path), got "
                             f"{type(model_path).__name__}")
        need_weights = load_format == "safetensors"
        model = replace(ModelConfig.from_dir(model_path, need_weights), quantization=quantization)
        draft_path = draft = None
        if draft_model is not None and draft_model != NGRAM:
            if not isinstance(draft_model, (str, Path)):
                raise ValueError(f"draft_model must be a checkpoint directory or {NGRAM!r}, got {draft_model!r}")
            draft_path, draft = Path(draft_model), replace(
                _draft_config(draft_model, need_weights),
                quantization=quantization if draft_quantization == "auto" else draft_quantization)
            if draft.vocab_size != model.vocab_size:
                raise ValueError(f"draft_model vocabulary ({draft.vocab_size}) differs from the target's "
                                 f"({model.vocab_size}); a draft must share the target's vocabulary")
        device = resolve_device(device)
        if process_group is not None:
            device = resolve_group_device(process_group, device)
        for arg, shape in (("model_path", model), ("draft_model", draft)):
            if device.type == "cuda" and shape is not None and shape.head_dim & (shape.head_dim - 1):
                raise ValueError(f"{arg}'s head_dim={shape.head_dim} is not supported on CUDA: the attention kernels "
                                 "take a power-of-two head dimension (64, 128, 256)")
        if tp > 1:
            check_tensor_parallel_shapes(tp, model, device, spmd=process_group is not None)
        dtype = resolve_engine_dtype(dtype, "dtype", model.dtype if device.type == "cuda" else torch.float32)
        limit = min(model.max_position_embeddings, model.sliding_window or model.max_position_embeddings)
        given = max_model_len is not None
        max_model_len = limit if max_model_len is None else positive_int(max_model_len, "max_model_len")
        if max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds what the model supports ({limit})")
        if draft_model is not None:
            check_speculative_tokens(num_speculative_tokens, max_model_len)
        batched = 8192 if device.type == "cuda" else 2048
        if not is_seed(seed):
            raise ValueError(f"seed={seed!r} is not allowed; {SEED_RANGE} (SamplingParams' seeds' range)")
        kv_dtype = dtype if kv_cache_dtype in (None, "auto") else resolve_kv_cache_dtype(kv_cache_dtype)
        check_batch_invariant_cache(batch_invariant, kv_dtype, kv_cache_dtype)
        check_fp8_device(device, quantization=quantization, draft_quantization=draft and draft.quantization,
                         kv_cache_dtype=kv_cache_dtype if kv_dtype.itemsize == 1 else None)
        return cls(
            model_path=Path(model_path), model=model, draft_path=draft_path, draft=draft,
            speculation=None if draft_model is None else "ngram" if draft_model == NGRAM else "model",
            num_speculative_tokens=int(num_speculative_tokens), device=device, dtype=dtype,
            kv_dtype=kv_dtype, kv_cache_memory=kv_cache_memory,
            max_num_seqs=int_in(max_num_seqs, "max_num_seqs", MAX_NUM_SEQS), max_model_len=max_model_len,
            max_model_len_given=given,
            max_num_batched_tokens=batched if max_num_batched_tokens is None
            else int_in(max_num_batched_tokens, "max_num_batched_tokens", MAX_NUM_BATCHED_TOKENS),
            block_size=positive_int(block_size, "block_size"),
            enable_prefix_caching=flag(enable_prefix_caching, "enable_prefix_caching"),
            use_graphs=not flag(enforce_eager, "enforce_eager") and device.type == "cuda", load_format=load_format,
            check_finite=flag(check_finite, "check_finite"), seed=seed, batch_invariant=batch_invariant,
            quantization=quantization,
            tensor_parallel_size=tp, process_group=process_group)

    def checkpoints(self) -> dict[str, Path]:
        """Model kind -> checkpoint directory: the target, and the draft model if there is one."""
        return {"target": self.model_path} | ({"draft": self.draft_path} if self.draft_path is not None else {})

    def model_configs(self) -> dict[str, ModelConfig]:
        return {"target": self.model} | ({"draft": self.draft} if self.draft is not None else {})


def _draft_config(draft_model, need_weights: bool) -> ModelConfig:
    """The draft checkpoint's ModelConfig; a missing path spelled like prompt lookup gets the right spelling."""
    from .spec import NGRAM

    try:
        return ModelConfig.from_dir(draft_model, need_weights, "draft_model")
    except ValueError as err:
        if re.sub(r"[^a-z]", "", str(draft_model).lower()) == "ngram" and not Path(draft_model).is_dir():
            raise ValueError(f"{err}; use {NGRAM!r} for prompt lookup") from None
        raise
