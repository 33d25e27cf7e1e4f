"""trainer_adapters.sync hands the engine full tensors: an FSDP2 (fully_shard) model's DTensor parameters are gathered
on every rank, and a parameter of any other tensor subclass is refused before the engine is called.

The FSDP2 test starts two processes (gloo, CPU); each shards a model over both, syncs it into its own engine and
pickles what it saw, and the test compares with the unsharded model."""
import os
import pickle
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import build_hf_model
from test_tensor_parallel_spmd import COLLECTIVE_S, _spawn, outcome

from rollout_engine import Engine, SamplingParams
from trainer_adapters import hf_named_parameters, sync_weights


def _fsdp_rank_main(rank: int, work: str, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=rank, world_size=2,
                            timeout=timedelta(seconds=COLLECTIVE_S))
    try:
        model = build_hf_model("llama3", seed=1)  # the engine below holds the seed-0 checkpoint
        full = {name: p.detach().clone() for name, p in model.named_parameters()}
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        seen = {"sharded": sum(type(p).__name__ == "DTensor" for p in model.parameters())}
        engine = Engine(path, device="cpu", kv_cache_memory=4 << 20)
        seen["sync"] = outcome(lambda: sync_weights(engine, model))
        weights = engine.weights
        seen["equal"] = {name: torch.equal(weights.destination(name), full[name])
                         for name in weights.names() if name in full}
        seen["serves"] = outcome(lambda: len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2),
                                                             use_tqdm=False)[0].outputs[0].token_ids))
        with open(os.path.join(work, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(seen, f)
    finally:
        dist.destroy_process_group()


def test_sync_weights_gathers_an_fsdp2_models_dtensors_on_every_rank(hf_checkpoint, tmp_path):
    """Each rank holds half of every weight (DTensors of the global shape): sync_weights gathers each with
    full_tensor() on both ranks, and both engines then hold exactly the unsharded model's weights and serve them
    (the DTensors went to the engine as they were: its shape check passed and the copy failed part way with a
    torch-internal error, leaving the engine refusing to generate)."""
    path, _ = hf_checkpoint("llama3")
    _spawn(_fsdp_rank_main, (str(tmp_path), str(path)))
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            seen = pickle.load(f)
        assert seen["sharded"] > 0, "fully_shard made no DTensor parameters: the test tests nothing"
        assert seen["sync"] == ("ok", 1), (rank, seen["sync"])
        assert seen["equal"] and all(seen["equal"].values()), (rank, seen["equal"])
        assert seen["serves"] == ("ok", 2), (rank, seen["serves"])


class Untouchable:
    """Fails the test on any use: a refused model must be refused before the engine is called."""

    def __getattr__(self, name):
        raise AssertionError(f"engine.{name} was used before the model's parameters were checked")


class OddTensor(torch.Tensor):
    """A tensor subclass the engine cannot copy from (neither a plain tensor nor a DTensor)."""


def test_a_parameter_of_another_tensor_subclass_is_refused_before_the_engine_is_called():
    model = build_hf_model("llama3")
    norm = model.model.norm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone().as_subclass(OddTensor))
    with pytest.raises(ValueError, match=r"parameter 'model.norm.weight' is of type OddTensor, not a torch.Tensor or a "
                                         r"DTensor"):
        sync_weights(Untouchable(), model)
    with pytest.raises(ValueError, match="model.norm.weight"):
        hf_named_parameters(model)  # at the call, not at the first next()


def test_plain_parameters_pass_through_unchanged():
    model = build_hf_model("llama3")
    named = dict(hf_named_parameters(model))
    assert named.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        assert type(named[name]) is torch.Tensor and named[name].data_ptr() == p.data_ptr()
