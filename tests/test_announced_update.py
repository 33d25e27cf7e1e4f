"""An announced update: the sender names every tensor of a whole model in 'begin' (WeightSender.send's manifest,
which sync_weights passes), and the receiver refuses, before any copy, tensors that do not fit the engine or that
leave some of its weights old, and refuses the end of a stream that stops short of what it announced."""
import threading

import pytest
import torch
import zmq
from helpers import GREEDY, assert_serves, config_twin, make_prompts, tied_twin

from rollout_kernels import copies
from rollout_engine import Engine, EngineAsleepError, WeightsNotReadyError
from rollout_engine.transport import WeightReceiver, WeightSender, WeightUpdateRejected
from trainer_adapters import sync_weights


EXTRA = ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))  # a buffer the engine takes and ignores


@pytest.fixture
def pair(hf_checkpoint, tmp_path):
    """An untied llama engine at version 0, its model, the next model's weights, a receiver and a sender of
    small buckets (an update takes many)."""
    path_a, model_a = hf_checkpoint("llama3", seed=0)
    _, model_b = hf_checkpoint("llama3", seed=1)
    engine = Engine(path_a, device="cpu", kv_cache_memory=32 << 20)
    receiver = WeightReceiver(engine, f"ipc://{tmp_path}/weights", timeout_s=60)
    sender = WeightSender(receiver.endpoint, bucket_bytes=64 << 10, timeout_s=60)
    yield engine, model_a, model_b, receiver, sender
    sender.close()
    receiver.close()


def received(receiver, send):
    """Run `send()` against `receiver.receive()` in this thread; (what receive returned or raised, what send did)."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(sent=attempt(send)))
    thread.start()
    got = attempt(receiver.receive)
    thread.join(60)
    return got, out["sent"]


def attempt(call):
    try:
        return call()
    except Exception as err:  # the test looks at which error each side saw
        return err


def test_sync_weights_through_a_sender_refuses_a_tied_model_for_an_untied_engine(pair):
    """The untied engine holds an lm_head.weight that a tied model never sends: refused at 'begin', so the old
    head never serves with the new model, and the engine serves on at version 0."""
    engine, model_a, model_b, receiver, sender = pair
    twin = tied_twin(model_b)
    got, sent = received(receiver, lambda: sync_weights(None, twin, sender=sender))
    assert isinstance(got, ValueError) and isinstance(sent, WeightUpdateRejected)
    assert "tie_word_embeddings True, the engine's checkpoint False" in str(sent)  # its config says so
    params = list(twin.named_parameters())  # without the config, the announcement's cover finds it
    got, sent = received(receiver, lambda: sender.send(params, manifest=params))
    assert isinstance(got, ValueError) and "lm_head.weight" in str(sent) and "tie_word_embeddings differs" in str(sent)
    assert engine.weight_version == 0 and engine.weight_history == []
    assert_serves(engine, model_a, make_prompts()[0], version=0)
    assert received(receiver, lambda: sync_weights(None, model_b, sender=sender)) == (1, 1)
    assert_serves(engine, model_b, make_prompts()[0], version=1)


def test_sync_weights_through_a_sender_refuses_an_untied_model_for_a_tied_engine(hf_checkpoint, tmp_path):
    """The tied engine holds one tensor for the embedding and lm_head; an untied model sends both, with different
    values. The model's config says so at 'begin', before a bucket is copied (found at the last bucket, it left
    every weight stale)."""
    path, model = hf_checkpoint("qwen2", seed=0)
    engine = Engine(path, device="cpu", kv_cache_memory=32 << 20)
    untied = config_twin(model, tie_word_embeddings=False)
    receiver = WeightReceiver(engine, f"ipc://{tmp_path}/weights", timeout_s=60)
    with WeightSender(receiver.endpoint, bucket_bytes=64 << 10, timeout_s=60) as sender:
        got, sent = received(receiver, lambda: sync_weights(None, untied, sender=sender))
    receiver.close()
    assert isinstance(got, ValueError) and "tie_word_embeddings False" in str(sent)
    assert_serves(engine, model, make_prompts()[0], version=0)


@pytest.mark.parametrize("change", [{"rope_theta": 5000.0}, {"rms_norm_eps": 1e-2},
                                    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}],
                         ids=["rope_theta", "rms_norm_eps", "rope_scaling"])
def test_sync_weights_through_a_sender_refuses_a_model_that_computes_another_function(pair, change):
    """The same names and shapes under another rotary base, scaling or RMSNorm epsilon would serve another policy
    than the trainer's: the model's config goes in 'begin', and the engine refuses it before any copy."""
    engine, model_a, model_b, receiver, sender = pair
    raw = model_b.config.to_dict()
    if "rope_theta" in change and raw.get("rope_parameters"):  # transformers 5 reads the theta from there
        change = {"rope_parameters": {**raw["rope_parameters"], **change}}
    twin = type(model_b)(type(model_b.config)(**{**raw, **change}))
    got, sent = received(receiver, lambda: sync_weights(None, twin, sender=sender))
    assert isinstance(got, ValueError) and isinstance(sent, WeightUpdateRejected)
    assert "would compute another function" in str(sent) and ("rope" in str(sent) or "rms_norm_eps" in str(sent))
    assert engine.weight_version == 0
    assert_serves(engine, model_a, make_prompts()[0], version=0)


@pytest.mark.parametrize("level", [1, 2])
def test_an_announced_update_into_sleeping_weights_is_told_they_sleep(pair, level):
    """The engine's own refusal comes first: the announcement is checked only once the engine takes the update."""
    engine, _, model_b, receiver, sender = pair
    engine.sleep(level=level)
    got, sent = received(receiver, lambda: sync_weights(None, model_b, sender=sender))
    assert isinstance(got, EngineAsleepError) and "wake(tags=['weights'])" in str(sent)
    engine.wake()
    assert received(receiver, lambda: sync_weights(None, model_b, sender=sender)) == (1, 1)
    assert_serves(engine, model_b, make_prompts()[0], version=1)


def test_an_announced_tensor_the_engine_lacks_is_refused_before_any_copy(pair):
    """A value head last in the update: unannounced, it is found only after the earlier buckets were copied, and
    the engine refuses to generate until a complete update; announced, nothing is copied."""
    engine, model_a, _, receiver, sender = pair
    pairs = [(n, t + 1) for n, t in model_a.state_dict().items()] + [("v_head.weight", torch.zeros(1, 64))]
    got, sent = received(receiver, lambda: sender.send(pairs, manifest=pairs))
    assert isinstance(sent, WeightUpdateRejected) and "unknown weight name 'v_head.weight'" in str(sent)
    assert isinstance(got, ValueError) and engine.weight_version == 0
    assert_serves(engine, model_a, make_prompts()[1], version=0)


@pytest.mark.parametrize("cut", ["short", "unannounced"])
def test_a_stream_that_departs_from_its_announcement_is_never_served(pair, cut):
    """"short": 'end' after half the announced tensors; "unannounced": the last bucket names a tensor 'begin' did
    not. Each is refused, and the engine, partly updated, refuses to generate until a whole update arrives."""
    engine, _, model_b, receiver, sender = pair
    pairs = list(model_b.state_dict().items())
    sent_pairs = pairs[: len(pairs) // 2] if cut == "short" else pairs + [EXTRA]
    got, sent = received(receiver, lambda: sender.send(sent_pairs, manifest=pairs))
    wanted = "'end' came before" if cut == "short" else "was not announced in 'begin'"
    assert isinstance(got, ValueError) and wanted in str(got) and wanted in str(sent)
    assert_refuses_until_whole(pair)


def assert_refuses_until_whole(pair):
    engine, _, model_b, receiver, sender = pair
    assert engine.weight_version == 0
    with pytest.raises(WeightsNotReadyError):
        engine.generate([make_prompts()[0]], GREEDY)
    assert received(receiver, lambda: sync_weights(None, model_b, sender=sender)) == (1, 1)
    assert_serves(engine, model_b, make_prompts()[0], version=1)


def raw_update(endpoint, manifest, groups):
    """An announced update of shared buckets whose storages are this process's tensors (receiver._shared_tensor is
    patched by the caller to look them up): the replies."""
    def item(i, name, t):
        return {"name": name, "dtype": "float32", "shape": list(t.shape), "stride": list(t.stride()),
                "storage_offset": 0, "storage": [i, t.nbytes]}
    announced = [{"name": n, "dtype": "float32", "shape": list(t.shape)} for n, t in manifest]
    messages = [{"op": "begin", "version": None, "tensors": announced}]
    messages += [{"op": "bucket", "tensors": [item(i, n, t) for i, (n, t) in enumerate(g)]} for g in groups]
    sock, replies = zmq.Context.instance().socket(zmq.REQ), []
    sock.connect(endpoint)
    for message in messages + [{"op": "end"}]:
        sock.send_json(message)
        replies.append(sock.recv_json())
        if not replies[-1]["ok"]:
            break
    sock.close()
    return replies


@pytest.fixture
def shared(pair, monkeypatch):
    """`pair` whose receiver takes shared buckets from this process's tensors (what CUDA IPC gives on a GPU), and
    plans copies as on CUDA (plans that hold no tensor are kept: a steady bucket is neither parsed nor checked)."""
    engine, _, model_b, receiver, _ = pair
    trainer = {n: t.clone() for n, t in model_b.state_dict().items()} | dict([EXTRA])
    monkeypatch.setattr(receiver, "_shared_tensor", lambda item: (item["name"], trainer[item["name"]]))
    monkeypatch.setattr(engine.ops, "copy_plan", copies.copy_plan_triton)
    return pair, list(trainer.items())[:-1]


def test_a_steady_bucket_that_skips_its_checks_still_counts_against_the_announcement(shared):
    """The second update's buckets are the first's bytes (kept, not parsed), yet a name its 'begin' did not
    announce is refused."""
    (engine, _, _, receiver, _), pairs = shared
    groups = [pairs[: len(pairs) // 2], pairs[len(pairs) // 2 :] + [EXTRA]]
    got, replies = received(receiver, lambda: raw_update(receiver.endpoint, pairs + [EXTRA], groups))
    assert got == 1 and all(r["ok"] for r in replies) and len(receiver.kept_groups) == 2
    got, replies = received(receiver, lambda: raw_update(receiver.endpoint, pairs, groups))
    assert isinstance(got, ValueError) and "was not announced in 'begin'" in replies[-1]["error"]
    got, replies = received(receiver, lambda: raw_update(receiver.endpoint, pairs + [EXTRA], groups))
    assert got == 2 and all(r["ok"] for r in replies) and engine.weight_history[-1]["complete"]


def test_a_tensor_in_two_buckets_of_an_announced_update_is_refused(shared):
    """The sender refuses a name given twice itself; a raw peer's second copy is refused on arrival."""
    pair, pairs = shared
    receiver = pair[3]
    got, replies = received(receiver, lambda: raw_update(receiver.endpoint, pairs, [pairs, pairs[:1]]))
    assert isinstance(got, ValueError) and "came twice in this update" in replies[-1]["error"]
    assert_refuses_until_whole(pair)


def test_begin_checks_its_announcement(pair):
    """A malformed announcement or config is refused with the field named; the receiver serves the next update."""
    engine, model_a, model_b, receiver, sender = pair
    for tensors, wanted in (([], "field 'tensors' must be a list of 1 to"),
                            ([{"name": "x", "dtype": "int8", "shape": [1]}], "field 'tensors[0].dtype'"),
                            ([{"name": "model.norm.weight", "dtype": "float32"}], "lacks field 'shape'"),
                            ({"config": {"hidden_size": 8}}, "field 'config' has unknown field 'hidden_size'"),
                            ({"config": {"rope_theta": "x"}}, "rope_theta must be a finite number"),
                            ({"config": [1]}, "field 'config' must be an object")):
        def send():
            sock = zmq.Context.instance().socket(zmq.REQ)
            sock.connect(receiver.endpoint)
            fields = tensors if isinstance(tensors, dict) else {"tensors": tensors}
            sock.send_json({"op": "begin", "version": None} | fields)
            reply = sock.recv_json()
            sock.close()
            return reply
        got, reply = received(receiver, send)
        assert isinstance(got, ValueError) and not reply["ok"] and wanted in reply["error"]
    with pytest.raises(ValueError, match="manifest must yield"):
        sender.send(list(model_b.state_dict().items()), manifest=[torch.zeros(2)])
    huge = [("m" * 250 + str(i), torch.zeros(1)) for i in range(16_000)]  # within MAX_ANNOUNCED, past the bytes
    with pytest.raises(ValueError, match="exceeds the protocol's .* announce fewer"):
        sender.send(huge, manifest=huge)
    assert received(receiver, lambda: sync_weights(None, model_b, sender=sender)) == (1, 1)
    assert_serves(engine, model_b, make_prompts()[2], version=1)
