"""Weight sync: the engine serves exactly the weights it was given, or refuses."""
import copy

import pytest
import torch
from helpers import GREEDY, assert_serves, hf_greedy, make_prompts

import rollout_engine.weight_store
from kernels import copies
from rollout_engine import Engine, WeightsNotReadyError


@pytest.fixture
def models(hf_checkpoint):
    """An engine built from random model A, and random model B (another seed) to update it with."""
    path_a, model_a = hf_checkpoint("llama3", seed=0)
    path_b, model_b = hf_checkpoint("llama3", seed=1)
    return Engine(path_a, device="cpu", kv_cache_memory=32 << 20), model_a, model_b, path_b


@pytest.mark.parametrize("source", ["named_parameters", "state_dict_fp16", "disk"])
def test_update_then_equals_transformers_with_the_new_weights(models, source):
    engine, model_a, model_b, path_b = models
    ids = make_prompts()[2]
    assert_serves(engine, model_a, ids)
    if source == "named_parameters":
        version = engine.update_weights((n, p.detach()) for n, p in model_b.named_parameters())
    elif source == "state_dict_fp16":  # cast on the way in; compare against B rounded the same way
        half = {n: t.half() for n, t in model_b.state_dict().items()}
        version = engine.update_weights(half.items())
        model_b = type(model_b)(model_b.config).eval()
        model_b.load_state_dict({n: t.float() for n, t in half.items()})
    else:
        version = engine.update_weights_from_disk(path_b)
    assert version == 1 == engine.weight_version
    assert engine.weight_history[-1] == {"version": 1, "tensors": len(engine.weights.names()), "complete": True}
    assert_serves(engine, model_b, ids)
    assert engine.generate([ids], GREEDY)[0].weight_version == 1


def test_rejected_before_any_copy_keeps_the_old_weights(models):
    engine, model_a, model_b, _ = models
    ids = make_prompts()[0]
    named = list(model_b.state_dict().items())
    with pytest.raises(ValueError, match=r"unknown weight name 'model.layers.0.self_attn.q_prj.weight'.*q_proj"):
        engine.update_weights([("model.layers.0.self_attn.q_prj.weight", named[0][1])] + named)
    with pytest.raises(ValueError, match=r"shape \(3, 3\), expected"):
        engine.update_weights([(named[1][0], torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="floating-point"):
        engine.update_weights([(named[1][0], named[1][1].long())])
    with pytest.raises(ValueError, match="shape"):  # late in the (one) group: checked before any of it is copied
        engine.update_weights(named[:5] + [(named[5][0], torch.zeros(2))] + named[6:])
    assert engine.weight_version == 0
    assert_serves(engine, model_a, ids)


def test_failure_part_way_refuses_until_a_complete_update(models, monkeypatch):
    engine, model_a, model_b, _ = models
    monkeypatch.setattr(rollout_engine.weight_store, "GROUP_BYTES", 64 << 10)  # groups: [embed], [q k v o], [gate up] ...
    ids = make_prompts()[1]
    named = list(model_b.state_dict().items())
    assert named[3][0] == "model.layers.0.self_attn.v_proj.weight"
    broken = named[:3] + [(named[3][0], torch.zeros(2))] + named[4:]
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(broken)
    weights = engine.weights
    assert torch.equal(weights.destination("model.embed_tokens.weight"), named[0][1])  # the first group landed
    q_proj = "model.layers.0.self_attn.q_proj.weight"  # the second group was checked whole, so never copied
    assert torch.equal(weights.destination(q_proj), model_a.state_dict()[q_proj])
    with pytest.raises(WeightsNotReadyError):
        engine.generate([ids], GREEDY)
    engine.update_weights(named[:10])  # a partial update does not make a mix servable
    with pytest.raises(WeightsNotReadyError):
        engine.generate([ids], GREEDY)
    engine.update_weights(named)
    assert_serves(engine, model_b, ids)


def test_a_name_given_twice_copies_the_last_tensor(models):
    engine, _, model_b, _ = models
    norm = model_b.state_dict()["model.norm.weight"]
    engine.update_weights([("model.norm.weight", norm * 2), ("model.norm.weight", norm)])
    assert torch.equal(engine.weights.destination("model.norm.weight"), norm)


def test_partial_update_is_recorded_and_served(models):
    engine, model_a, model_b, _ = models
    ids = make_prompts()[0]
    norm = {n: t for n, t in model_b.state_dict().items() if n == "model.norm.weight"}
    engine.update_weights(norm.items(), version=7)
    assert engine.weight_history[-1] == {"version": 7, "tensors": 1, "complete": False}
    expected = copy.deepcopy(model_a)  # A with B's final norm
    expected.load_state_dict(norm, strict=False)
    assert_serves(engine, expected, ids)


def test_prefix_cache_never_serves_old_kv(models):
    engine, model_a, model_b, _ = models
    ids = make_prompts([48], seed=9)[0]
    engine.generate([ids], GREEDY)
    assert engine.generate([ids], GREEDY)[0].metrics["num_cached_tokens"] == 32  # cached under A
    engine.update_weights(model_b.state_dict().items())
    out = engine.generate([ids], GREEDY)[0]
    assert out.metrics["num_cached_tokens"] == 0
    assert out.outputs[0].token_ids == hf_greedy(model_b, ids, GREEDY.max_tokens)[0]


def test_steady_updates_replay_their_copy_plans(models, monkeypatch):
    """A trainer sends the same parameters after every step, updated in place: from the second update on
    each group's copy plan runs again unchecked and copies what the tensors hold now. A tensor at a new
    address, or a sleep that moves the engine's weights, plans that group afresh; a cast is never planned
    ahead (the reference's plan would keep the caller's tensors alive)."""
    engine, _, model_b, _ = models
    monkeypatch.setattr(engine.ops, "copy_plan", copies.copy_plan_triton)  # CUDA's plan, in Triton's interpreter
    checked = []
    resolve = engine.weights.resolve
    monkeypatch.setattr(engine.weights, "resolve", lambda group, *rest: (checked.extend(group), resolve(group, *rest))[1])
    trainer = {n: t.clone() for n, t in model_b.state_dict().items()}

    def update_and_check(tensors):
        engine.update_weights(tensors.items())
        for name, tensor in tensors.items():
            assert torch.equal(engine.weights.destination(engine.weights.canonical(name)), tensor.float()), name

    update_and_check(trainer)
    assert len(checked) == len(trainer)
    for t in trainer.values():
        t.neg_()  # an optimizer step, in place
    update_and_check(trainer)
    assert len(checked) == len(trainer)  # replayed, not checked again
    first = next(iter(trainer))
    trainer[first] = trainer[first] * 2  # a new tensor: its group is checked and planned again
    update_and_check(trainer)
    assert len(checked) > len(trainer)
    engine.sleep(level=1)
    engine.wake()  # on the CPU the weights now live elsewhere
    before = len(checked)
    update_and_check(trainer)
    assert len(checked) == before + len(trainer)
    half = {n: t.half() for n, t in trainer.items()}  # cast on the way in: checked every time
    update_and_check(half)
    update_and_check(half)
    assert len(checked) == before + 3 * len(trainer)
