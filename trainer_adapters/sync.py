"""Push a trainer's transformers model into the engine after an optimizer step."""
from __future__ import annotations

import torch

# The dotted name parts that wrappers insert: DDP and FSDP's `.module`, torch.compile, activation checkpointing's
# checkpoint_wrapper, FSDP1. Only a whole part is one of these: `my_module` or `submodule` is a name of the model.
WRAPPER_PARTS = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP / FSDP-style `.module` and torch.compile `._orig_mod` wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def hf_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, object]]:
    """(Hugging Face name, parameter, LoRA layer or None) for every weight the engine holds of a (possibly wrapped)
    transformers model. A PEFT model's names are its base model's: its adapters' own parameters (lora_*) are
    not weights of the base model, a LoRA layer's base weight comes with its layer (whose delta the sync adds:
    lora_delta), and a modules_to_save copy of the active adapter stands for the module (the original is
    skipped)."""
    model = unwrap(model)
    if not (hasattr(model, "peft_config") and hasattr(model, "get_base_model")):
        return [(hf_name(name), param, None) for name, param in model.named_parameters()]
    out = []
    for name, param in model.named_parameters():
        parts = name.split(".")
        owner = lambda part: model.get_submodule(".".join(parts[: parts.index(part)]))  # noqa: E731
        if any(p.startswith("lora_") for p in parts) or "original_module" in parts:
            continue
        kept = [p for p in parts if p != "base_layer"]
        if "modules_to_save" in parts:
            at = kept.index("modules_to_save")
            if kept[at + 1] != owner("modules_to_save").active_adapter:
                continue
            del kept[at : at + 2]
        layer = owner("base_layer") if "base_layer" in parts and parts[-1] == "weight" else None
        out.append((hf_name(".".join(kept[2:] if kept[:2] == ["base_model", "model"] else kept)), param, layer))
    return out


def lora_delta(layer) -> torch.Tensor | int:
    """What a PEFT LoRA layer adds to its base weight: the sum of its active, unmerged adapters' deltas (0 when
    merged into the base already or disabled). The trainer's base weight is left as it is (no merge, no unmerge:
    those round it). Adapter variants (DoRA) and LoRA biases merge differently: refused."""
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return 0
    delta = 0
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A and adapter not in getattr(layer, "lora_embedding_A", {}):
            continue
        if getattr(layer, "lora_variant", {}).get(adapter) is not None or getattr(layer, "lora_bias", {}).get(adapter):
            raise ValueError(f"adapter {adapter!r} is a LoRA variant (DoRA) or has a LoRA bias, which the sync cannot "
                             "add to the base weight: merge it first (model.merge_and_unload()) and sync that model")
        delta = delta + layer.get_delta_weight(adapter)
    return delta


def hf_named_parameters(model: torch.nn.Module):
    """(Hugging Face name, detached full tensor) for every parameter of a (possibly wrapped) transformers model.

    A sharded parameter (a DTensor: FSDP2's fully_shard, torch tensor parallelism) is gathered with its
    .full_tensor(), one parameter at a time. That is a collective over the parameter's device mesh: every rank of
    the mesh must iterate the same parameters in the same order (call sync_weights on each of them, or iterate this
    generator to the end on each), else the ranks that do wait for the others forever. A parameter of any other
    tensor subclass, which the engine cannot copy from, is refused here, before anything is gathered or yielded
    (so before sync_weights calls the engine)."""
    named = hf_parameters(model)
    for name, param, _ in named:
        if not callable(getattr(param, "full_tensor", None)) and type(param.detach()) is not torch.Tensor:
            raise ValueError(f"parameter {name!r} is of type {type(param.detach()).__name__}, not a torch.Tensor or a "
                             "DTensor; hand the engine full tensors (gather or convert the model's weights first)")
    return ((name, full_tensor(param.detach()) if layer is None else full_tensor(param.detach()) + lora_delta(layer))
            for name, param, layer in named)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's gathered whole (a collective over its mesh); any other tensor as it is."""
    gather = getattr(tensor, "full_tensor", None)
    return gather() if callable(gather) else tensor


def hf_name(name: str) -> str:
    """A parameter's name without the wrapper parts (WRAPPER_PARTS) anywhere in it: the Hugging Face name."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def check_model_fits(engine, model: torch.nn.Module) -> None:
    """ValueError unless every parameter of the (possibly wrapped) model has a weight of the same shape in the
    engine, and both tie lm_head to the embedding or neither does: what sync_weights would refuse (a value head, a
    resized vocabulary, an untied lm_head into a tied engine) or leave stale (a tied model sends no lm_head.weight,
    which an untied engine holds), found before anything sleeps. Names and shapes only: a sharded parameter's
    shape is its whole tensor's, so nothing is gathered."""
    table, names = engine.weights, set()
    for name, param, _ in hf_parameters(model):  # a tied lm_head is the embedding: listed once
        slot = table.canonical(name)  # the engine's own rule: ValueError naming an unknown name
        names.add(name)
        if slot is not None and tuple(param.shape) != tuple(table.full_shape(slot)):
            raise ValueError(f"the model's parameter {name!r} has shape {tuple(param.shape)}; the engine's "
                             f"weight is {tuple(table.full_shape(slot))}")
    head, tied_engine = "lm_head.weight" in names, "lm_head.weight" in table.aliases
    if "model.embed_tokens.weight" in names and head == tied_engine:
        what = ("an lm_head.weight of its own, which the engine ties to its embedding" if head else "its lm_head tied "
                "to its embedding, and the engine an lm_head.weight of its own, which no sync would update")
        raise ValueError(f"the model has {what} (tie_word_embeddings differs): load the engine from a checkpoint "
                         "of the model's config")


def weights_sleep_level(engine) -> int:
    """The sleep level for a step whose weights come back from the trainer: 2 (discarded), unless the engine holds
    a speculative draft model, whose weights no trainer pushes back: then 1 (kept on the host)."""
    return 1 if "draft" in engine.models else 2


def sync_weights(engine, model: torch.nn.Module, version: int | None = None, sender=None) -> int:
    """Copy the model's current weights into the engine (in place, one tensor at a time) and return the new version.

    With `sender` (a rollout_engine.transport.WeightSender) the tensors go to an engine in
    another process, packed in buckets of bounded size; otherwise straight into `engine`.
    A sharded (DTensor) model is gathered one parameter at a time, a collective: every rank of its mesh calls
    sync_weights (hf_named_parameters says why)."""
    named = hf_named_parameters(model)
    with torch.no_grad():
        if sender is not None:
            return sender.send(named, version)
        return engine.update_weights(named, version)
