"""ModelConfig: the facts of a Hugging Face Llama-family checkpoint the engine needs, from config.json."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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

    @classmethod
    def from_dir(cls, path, need_weights: bool = True) -> "ModelConfig":
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {str(path)!r} has no config.json (expected a Hugging Face checkpoint directory)")
        if need_weights and not list(path.glob("*.safetensors")):
            raise ValueError(f"model_path {str(path)!r} has no *.safetensors weights")
        raw = json.loads((path / "config.json").read_text())
        gen = path / "generation_config.json"
        return cls.from_dict(raw, json.loads(gen.read_text()) if gen.is_file() else {})

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"architectures={archs} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}")
        heads = raw["num_attention_heads"]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
        window = raw.get("sliding_window") if raw.get("use_sliding_window", arch == "MistralForCausalLM") else None
        attention_bias = raw.get("attention_bias", False)
        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        eos = [(generation or {}).get("eos_token_id"), raw.get("eos_token_id")]
        eos_ids = {i for e in eos if e is not None for i in (e if isinstance(e, list) else [e])}
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            dtype=getattr(torch, dtype_name) if isinstance(dtype_name, str) else torch.float32,
            eos_token_ids=tuple(sorted(eos_ids)),
            sliding_window=window,
        )

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
