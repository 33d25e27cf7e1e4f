"""Hugging Face parameter names -> the engine's (fused) parameters: ONE table for loading and weight sync."""
from __future__ import annotations

import difflib
from pathlib import Path

import torch
from safetensors import safe_open

from .model import CausalLM, Linear

# (engine module, shard) that each Hugging Face projection fills.
FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
HF_NAME_OF_SHARD = {dst: hf for hf, dst in FUSED.items()}
IGNORED = ("rotary_emb.inv_freq",)


class WeightTable:
    """Every Hugging Face name the model takes, and the engine tensor view it lands in."""

    def __init__(self, model: CausalLM):
        modules = dict(model.named_modules())
        self.views: dict[str, tuple[torch.nn.Module, str, object]] = {}
        for param_name, _ in model.named_parameters():
            module_name, _, attr = param_name.rpartition(".")
            module = modules[module_name]
            head, _, leaf = module_name.rpartition(".")
            for shard in getattr(module, "shards", {None: None}):
                hf_leaf = HF_NAME_OF_SHARD.get((leaf, shard), leaf)
                self.views[f"{head}.{hf_leaf}.{attr}" if head else f"{hf_leaf}.{attr}"] = (module, attr, shard)
        # Tied embeddings: a trainer's state dict may carry lm_head.weight as well; it is the same tensor.
        self.aliases = {"lm_head.weight": "model.embed_tokens.weight"} if model.cfg.tie_word_embeddings else {}

    def names(self) -> set[str]:
        return set(self.views)

    def canonical(self, hf_name: str) -> str | None:
        """The table key for `hf_name`, or None for names that carry nothing to load."""
        if hf_name.endswith(IGNORED):
            return None
        name = self.aliases.get(hf_name, hf_name)
        if name not in self.views:
            near = difflib.get_close_matches(name, list(self.views), n=3, cutoff=0.6)
            raise ValueError(f"unknown weight name {hf_name!r}; nearest known names: {near}")
        return name

    def destination(self, name: str) -> torch.Tensor:
        module, attr, shard = self.views[name]
        param = getattr(module, attr)
        return module.shard_view(param, shard) if isinstance(module, Linear) else param

    def check(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Validate one incoming tensor against its destination, which is returned."""
        dst = self.destination(name)
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"weight {name!r} must be a floating-point tensor, got {kind}")
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        return dst


def iter_safetensors(path):
    """(name, tensor) for every tensor of every *.safetensors file in `path`, one file open at a time."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"path {str(path)!r} has no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
