"""Weight updates from another process: ZeroMQ control messages, buckets in shared memory (CPU), CUDA
IPC handles (one GPU), or broadcast over a weight-update group (gloo on the CPU, NCCL across two GPUs)."""
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import zmq
from helpers import GREEDY, assert_serves, hf_greedy, make_prompts

from rollout_kernels import copies
from rollout_engine import Engine, EngineAsleepError, WeightsNotReadyError
from rollout_engine.transport import (
    WeightReceiver,
    WeightSender,
    check_endpoint,
    init_weight_update_group,
)
from rollout_engine.weights import buckets
from trainer_adapters import sync_weights

SENDER = textwrap.dedent("""
    import sys, torch
    from transformers import AutoModelForCausalLM
    from rollout_engine.transport import WeightSender, init_weight_update_group
    path, endpoint, mode, backend, port = sys.argv[1:6]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    group = None
    if backend == "cuda-ipc":  # the engine's GPU: tensors go as IPC handles of their own storage
        model.to("cuda")
    elif backend != "shm":  # rank 0 of a weight-update group; with nccl on the second GPU
        if backend == "nccl":
            torch.cuda.set_device(1)
            model.to("cuda")
        group = init_weight_update_group("127.0.0.1", int(port), rank=0, world_size=2, backend=backend, timeout_s=120)
    named = list(model.state_dict().items())
    if mode == "bad_shape":
        named[7] = (named[7][0], torch.zeros(3))
    sender = WeightSender(endpoint, bucket_bytes=64 << 10, group=group)  # small buckets: many round trips
    try:
        print("version", sender.send(named, version=42 if mode == "ok" else None))
    except RuntimeError as err:
        print("rejected", err)
    finally:
        sender.close()
        if group is not None:
            group.close()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_update(engine, path, tmp_path, mode, backend="shm"):
    """A process sending checkpoint `path` (`mode`: "ok" or "bad_shape") over `backend` ("shm", "cuda-ipc",
    or a group's "gloo" / "nccl"), and this process's receiver for `engine`."""
    endpoint, port = f"ipc://{tmp_path}/weights", free_port()
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(path), endpoint, mode, backend, str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    group = None
    if backend in ("gloo", "nccl"):
        group = init_weight_update_group("127.0.0.1", port, rank=1, world_size=2, backend=backend, timeout_s=120)
    return WeightReceiver(engine, endpoint, timeout_s=120, group=group), sender


def close(receiver):
    receiver.close()
    if receiver.group is not None:
        receiver.group.close()


@pytest.fixture
def engine_and_models(hf_checkpoint):
    path_a, model_a = hf_checkpoint("qwen2", seed=0)
    path_b, model_b = hf_checkpoint("qwen2", seed=1)
    return Engine(path_a, device="cpu", kv_cache_memory=32 << 20), model_a, path_b, model_b


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_update_from_another_process(engine_and_models, tmp_path, backend):
    engine, _, path_b, model_b = engine_and_models
    receiver, sender = start_update(engine, path_b, tmp_path, "ok", backend)
    assert receiver.receive() == 42
    out, err = sender.communicate(timeout=120)
    assert sender.returncode == 0 and "version 42" in out, err
    assert_serves(engine, model_b, make_prompts()[2], version=42)
    close(receiver)


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_rejected_remote_update_never_serves_a_mix(engine_and_models, tmp_path, backend):
    engine, _, path_b, _ = engine_and_models
    receiver, sender = start_update(engine, path_b, tmp_path, "bad_shape", backend)
    with pytest.raises(ValueError, match="shape"):
        receiver.receive()
    out, _ = sender.communicate(timeout=120)
    assert "rejected" in out and "shape" in out
    with pytest.raises(WeightsNotReadyError):  # buckets before the bad one were copied: refuse, never mix
        engine.generate(make_prompts()[:1], GREEDY)
    close(receiver)


def test_an_update_the_engine_refuses_at_once_is_rejected_at_begin(engine_and_models, tmp_path):
    engine, model_a, path_b, _ = engine_and_models
    engine.sleep(level=1, tags=["weights"])
    receiver, sender = start_update(engine, path_b, tmp_path, "ok")
    with pytest.raises(EngineAsleepError):
        receiver.receive()
    out, _ = sender.communicate(timeout=120)
    assert "rejected" in out and "asleep" in out
    engine.wake()
    assert_serves(engine, model_a, make_prompts()[2], version=0)
    close(receiver)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [
    pytest.param("cuda-ipc", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    pytest.param("nccl", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")),
])
def test_update_on_gpus(hf_checkpoint, tmp_path, backend):
    """CUDA IPC from another process on the engine's GPU, or NCCL from a second GPU."""
    path_a, _ = hf_checkpoint("qwen2", seed=0)
    path_b, model_b = hf_checkpoint("qwen2", seed=1)
    engine = Engine(path_a, device="cuda", dtype="float32", kv_cache_memory=64 << 20)  # GPU 0
    receiver, sender = start_update(engine, path_b, tmp_path, "ok", backend)
    assert receiver.receive() == 42
    close(receiver)  # before waiting for the sender: an NCCL group's close returns once every rank closes
    out, err = sender.communicate(timeout=120)
    assert sender.returncode == 0 and "version 42" in out, err
    for name, tensor in model_b.state_dict().items():  # the transport moves bytes: equal, not close
        assert torch.equal(engine.weights.destination(engine.weights.canonical(name)).cpu(), tensor), name
    ids = make_prompts()[2]
    with torch.no_grad():
        hf = model_b.to("cuda").generate(torch.tensor([ids], device="cuda"), do_sample=False,
                                         max_new_tokens=GREEDY.max_tokens, min_new_tokens=GREEDY.max_tokens)
    model_b.to("cpu")
    assert engine.generate([ids], GREEDY)[0].outputs[0].token_ids == hf[0, len(ids):].tolist()


REPEATED_SENDER = textwrap.dedent("""
    import sys, torch
    from transformers import AutoModelForCausalLM
    from rollout_engine.transport import WeightSender
    path, endpoint = sys.argv[1:3]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda")
    sender = WeightSender(endpoint, bucket_bytes=64 << 10, timeout_s=120)
    names = list(model.state_dict())
    with torch.no_grad():
        print(sender.send(model.state_dict().items()))                       # 1: B
        for p in model.parameters():
            p.neg_()                                                          # optimizer-style, in place
        print(sender.send(model.state_dict().items()))                       # 2: -B
        for p in model.parameters():
            p.neg_()
        print(sender.send(model.state_dict().items()))                       # 2b: B, the same bytes as 2
        half = {n: t for n, t in model.state_dict().items() if n in names[: len(names) // 2]}
        print(sender.send(half.items()))                                      # 3: a partial update
        layer = model.model.layers[0].mlp.down_proj
        layer.weight = torch.nn.Parameter(layer.weight * 2)                   # a new storage
        print(sender.send(model.state_dict().items()))                       # 4: B, down_proj[0] 2B
        sys.stdin.readline()  # once the engine's new receiver listens (a request sent before is lost)
        try:
            sender.send(model.state_dict().items())                           # 5: to a new receiver
        except RuntimeError as err:
            print("rejected", err)
        print(sender.send(model.state_dict().items()))                       # 6: shared afresh
    sender.close()
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_keeps_shares_across_updates(hf_checkpoint, tmp_path):
    """Storages stay shared and mapped across updates (in-place changes arrive), an unchanged update reuses
    its copy plans (across a sleep that keeps addresses), an update that skips some lets go of them on both
    sides, a new storage is shared afresh, and a receiver that never mapped a share rejects it, after which
    the sender shares everything again."""
    path_a, _ = hf_checkpoint("qwen2", seed=0)
    path_b, model_b = hf_checkpoint("qwen2", seed=1)
    engine = Engine(path_a, device="cuda", dtype="float32", kv_cache_memory=64 << 20)
    endpoint = f"ipc://{tmp_path}/weights"
    sender = subprocess.Popen([sys.executable, "-c", REPEATED_SENDER, str(path_b), endpoint],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        receiver = WeightReceiver(engine, endpoint, timeout_s=120)
        b = model_b.state_dict()
        down = "model.layers.0.mlp.down_proj.weight"

        def served(expected):
            for name, tensor in expected.items():
                assert torch.equal(engine.weights.destination(engine.weights.canonical(name)).cpu(), tensor), name

        receiver.receive()
        served(b)
        receiver.receive()
        served({n: -t for n, t in b.items()})
        plans = [group.copy for group in receiver.kept_groups]
        engine.sleep(level=1)
        engine.wake()  # addresses kept (torch_memory_saver): the copy plans of update 2 still hold
        receiver.receive()
        served(b)
        assert plans and [group.copy for group in receiver.kept_groups] == plans  # reused, not rebuilt
        receiver.receive()
        assert receiver.mapped_storages < len({t.untyped_storage().data_ptr() for t in b.values()})
        receiver.receive()
        served({n: t * 2 if n == down else t for n, t in b.items()})  # the old storage, if read, holds B
        receiver.close()
        receiver = WeightReceiver(engine, endpoint, timeout_s=120)
        sender.stdin.write("go\n")
        sender.stdin.flush()
        with pytest.raises(ValueError, match="no longer maps"):
            receiver.receive()
        receiver.receive()
        served({n: t * 2 if n == down else t for n, t in b.items()})
        out, err = sender.communicate(timeout=120)
        assert sender.returncode == 0 and "rejected" in out, err
        receiver.close()
    finally:
        if sender.poll() is None:  # a failure above leaves it waiting for replies
            sender.kill()


def test_sync_weights_from_a_wrapped_model(engine_and_models):
    engine, _, _, model_b = engine_and_models
    wrapped = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    torch.nn.Module.__init__(wrapped)
    wrapped.module = model_b  # what DDP looks like from outside, without a process group
    assert sync_weights(engine, wrapped) == 1
    ids = make_prompts()[0]
    assert engine.generate([ids], GREEDY)[0].outputs[0].token_ids == hf_greedy(model_b, ids, 12)[0]


def test_in_process_sender_and_receiver_over_tcp_loopback(engine_and_models):
    engine, _, _, model_b = engine_and_models
    receiver = WeightReceiver(engine, "tcp://127.0.0.1:0", timeout_s=60)
    endpoint = receiver.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    result = {}
    thread = threading.Thread(target=lambda: result.update(v=receiver.receive()))
    thread.start()
    sender = WeightSender(endpoint, bucket_bytes=1 << 20, timeout_s=60)
    assert sync_weights(None, model_b, version=5, sender=sender) == 5
    thread.join(60)
    sender.close()
    receiver.close()
    assert result["v"] == 5 == engine.weight_version


def test_a_steady_shared_bucket_is_parsed_and_planned_once(engine_and_models, tmp_path, monkeypatch):
    """A shared bucket whose bytes equal the last update's is neither parsed nor checked again (the engine
    reuses its copy plan) and still copies what the trainer's tensors hold now; a changed bucket, or a move
    of the engine's weights (on the CPU a sleep re-allocates them), plans afresh; a plan that holds tensors
    (the reference's) is not kept. Real CUDA IPC needs a GPU (test_cuda_ipc_keeps_shares_across_updates);
    here the sender's storages are this process's tensors."""
    engine, _, _, model_b = engine_and_models
    trainer = {n: t.clone() for n, t in model_b.state_dict().items()}
    endpoint = f"ipc://{tmp_path}/weights"
    receiver = WeightReceiver(engine, endpoint, timeout_s=60)
    looked_up, planned = [], []
    monkeypatch.setattr(receiver, "_shared_tensor", lambda item: (looked_up.append(item) or item["name"],
                                                                  trainer[item["name"]]))
    plan = copies.copy_plan_triton  # CUDA's plan (in Triton's interpreter): the reference's holds tensors
    monkeypatch.setattr(engine.ops, "copy_plan", lambda d, s: (planned.append(len(d)), plan(d, s))[1])

    def update(names):
        items = [{"name": n, "dtype": "float32", "shape": list(trainer[n].shape), "stride": list(trainer[n].stride()),
                  "storage_offset": 0, "storage": [i, trainer[n].nbytes]} for i, n in enumerate(names)]
        messages = [{"op": "begin", "version": None}, {"op": "bucket", "tensors": items[:half]},
                    {"op": "bucket", "tensors": items[half:]}, {"op": "end"}]
        replies = []

        def send():
            sock = zmq.Context.instance().socket(zmq.REQ)
            sock.connect(endpoint)
            for message in messages:
                sock.send_json(message)
                replies.append(sock.recv_json())
            sock.close()
        thread = threading.Thread(target=send)
        thread.start()
        receiver.receive()
        thread.join(60)
        assert all(r["ok"] for r in replies)
        for n in names:
            assert torch.equal(engine.weights.destination(engine.weights.canonical(n)), trainer[n]), n

    names = list(trainer)
    half = len(names) // 2
    update(names)
    assert (len(looked_up), len(planned)) == (len(names), 2)
    for t in trainer.values():
        t.neg_()  # an optimizer step, in place
    update(names)
    assert (len(looked_up), len(planned)) == (len(names), 2)  # nothing parsed, looked up or checked again
    engine.sleep(level=1)
    engine.wake()  # the CPU engine's weights now live elsewhere
    for t in trainer.values():
        t.mul_(2)
    update(names)
    assert (len(looked_up), len(planned)) == (len(names), 4)  # the same bytes, planned again
    update(names[:-1])  # the second bucket changed: only it is parsed and planned again
    assert (len(looked_up), len(planned)) == (2 * len(names) - 1 - half, 5)
    monkeypatch.setattr(engine.ops, "copy_plan", lambda d, s: (planned.append(len(d)), copies.copy_plan_ref(d, s))[1])
    engine.sleep(level=1)
    engine.wake()  # every plan is made again, now by the reference, whose plans hold the tensors
    update(names)
    looked = len(looked_up)
    update(names)  # such plans are not kept: parsed and planned again
    assert (len(looked_up), len(planned)) == (looked + len(names), 5 + 4)
    receiver.close()


def test_endpoints_and_buckets():
    for bad in ["tcp://0.0.0.0:5555", "tcp://10.0.0.1:5555", "inproc://x", 5]:
        with pytest.raises(ValueError, match="endpoint"):
            check_endpoint(bad)
    tensors = [(f"t{i}", torch.zeros(100)) for i in range(10)] + [("big", torch.zeros(10_000))]
    groups = list(buckets(tensors, bucket_bytes=1024))
    assert [len(g) for g in groups] == [2, 2, 2, 2, 2, 1]  # 400 B each, padded to 512; the big one alone
    assert [n for g in groups for n, _ in g] == [n for n, _ in tensors]
