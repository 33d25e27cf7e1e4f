"""Push a trainer's transformers model into the engine after an optimizer step."""
from __future__ import annotations

import torch

WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP, torch.compile


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP / FSDP-style `.module` and torch.compile `._orig_mod` wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def hf_named_parameters(model: torch.nn.Module):
    """(Hugging Face name, detached tensor) for every parameter of a (possibly wrapped) transformers model."""
    for name, param in unwrap(model).named_parameters():
        for prefix in WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        yield name, param.detach()


def sync_weights(engine, model: torch.nn.Module, version: int | None = None, sender=None) -> int:
    """Copy the model's current weights into the engine (in place, one tensor at a time) and return the new version.

    With `sender` (a rollout_engine.transport.WeightSender) the tensors go to an engine in
    another process, packed in buckets of bounded size; otherwise straight into `engine`."""
    named = hf_named_parameters(model)
    with torch.no_grad():
        if sender is not None:
            return sender.send(named, version)
        return engine.update_weights(named, version)
