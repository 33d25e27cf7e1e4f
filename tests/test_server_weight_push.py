"""`serve --weight-receiver`: a trainer process pushes weights into a running server with a WeightSender, and the
server's replies come from them, with the requests in flight carried across the update."""
import threading
import time

import httpx
import pytest
import torch

from rollout_engine import Engine, SamplingParams
from rollout_engine.transport import WeightSender, WeightUpdateRejected

from server_fixtures import AUTH, ENGINE, checkpoint, running_server  # noqa: F401 - a fixture

PROMPT = [5, 6, 7, 8, 9]


def greedy(url, max_tokens: int = 8) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", headers=AUTH, json=body, timeout=60).json()["choices"][0]


def moved_weights(checkpoint) -> dict:
    """The checkpoint's tensors with every projection moved far enough to change greedy tokens."""
    from safetensors.torch import load_file

    state = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        state |= load_file(f)
    g = torch.Generator().manual_seed(0)
    return {name: t + 0.5 * t.float().std() * torch.randn(t.shape, generator=g).to(t.dtype)
            if name.endswith("proj.weight") else t for name, t in state.items()}


@pytest.fixture(scope="module")
def pushing_server(checkpoint, tmp_path_factory):
    with running_server(checkpoint, tmp_path_factory.mktemp("log") / "server.log", "--weight-receiver") as (_, url):
        yield url


def test_pushed_weights_are_served(pushing_server, checkpoint):
    url = pushing_server
    info = httpx.get(f"{url}/weight_receiver", headers=AUTH, timeout=10).json()
    assert info["endpoint"].startswith("ipc://") and info["weight_version"] == 0
    assert httpx.get(f"{url}/weight_receiver", timeout=10).status_code == 401  # behind the key, as every path
    before = greedy(url)
    weights = moved_weights(checkpoint)
    with WeightSender(info["endpoint"]) as sender:
        assert sender.send(weights) == 1
    health = httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()
    assert health["weight_version"] == 1 and health["weights_ready"]
    after = greedy(url)
    reference = Engine(checkpoint, **ENGINE)
    reference.update_weights(weights.items())
    want = reference.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8,
                                                                           ignore_eos=True), use_tqdm=False)[0]
    assert after["token_ids"] == want.outputs[0].token_ids != before["token_ids"]
    assert after["weight_versions"] == [1] * 8


def test_a_refused_push_leaves_the_server_serving(pushing_server, checkpoint):
    url = pushing_server
    endpoint = httpx.get(f"{url}/weight_receiver", headers=AUTH, timeout=10).json()["endpoint"]
    served = greedy(url)
    version = httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()["weight_version"]
    weights = moved_weights(checkpoint)
    name = next(n for n in weights if n.endswith("proj.weight"))
    weights[name] = weights[name].clone()
    weights[name][0, 0] = float("nan")
    with WeightSender(endpoint) as sender:
        with pytest.raises(WeightUpdateRejected, match="NaN|finite"):
            sender.send(weights)
    health = httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()
    assert health["weight_version"] == version and health["weights_ready"]
    assert greedy(url)["token_ids"] == served["token_ids"]


def test_a_push_while_paused_carries_the_request_in_flight_across(pushing_server, checkpoint):
    """pause_generation("keep"), push, continue: a request running across it has old tokens, then new ones."""
    url = pushing_server
    endpoint = httpx.get(f"{url}/weight_receiver", headers=AUTH, timeout=10).json()["endpoint"]
    version = httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()["weight_version"]
    result = {}
    long = threading.Thread(target=lambda: result.update(greedy(url, max_tokens=200)))
    long.start()
    try:
        while "rollout_engine_num_seqs_running 1.0" not in httpx.get(f"{url}/metrics", headers=AUTH,
                                                                      timeout=10).text:
            assert not result, "the request finished before it was seen running"
        post = dict(headers=AUTH, timeout=30)
        assert httpx.post(f"{url}/pause_generation", json={"mode": "keep"}, **post).status_code == 200
        with WeightSender(endpoint) as sender:
            new = sender.send(moved_weights(checkpoint))
        assert httpx.post(f"{url}/continue_generation", **post).status_code == 200
    finally:
        long.join(60)
    versions = result["weight_versions"]
    switch = versions.index(new)
    assert new == version + 1 and 0 < switch < 200
    assert versions == [version] * switch + [new] * (200 - switch)


def test_the_rl_cycle_sleep_push_wake(pushing_server, checkpoint):
    """What a trainer beside the server does each step: sleep at level 2 (weights discarded), wake the weights,
    push them, wake the KV cache; generation is refused until the push completes them, then serves them."""
    url = pushing_server
    post = dict(headers=AUTH, timeout=30)
    endpoint = httpx.get(f"{url}/weight_receiver", headers=AUTH, timeout=10).json()["endpoint"]
    weights = {name: -t for name, t in moved_weights(checkpoint).items()}  # unlike any pushed before
    assert httpx.post(f"{url}/sleep", json={"level": 2}, **post).status_code == 200
    assert httpx.post(f"{url}/wake", json={"tags": ["weights"]}, **post).status_code == 200
    assert httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()["weights_ready"] is False
    with WeightSender(endpoint) as sender:
        version = sender.send(weights)
    assert httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()["weights_ready"] is True
    assert httpx.post(f"{url}/wake", json={"tags": ["kv_cache"]}, **post).json()["sleeping"] is False
    reference = Engine(checkpoint, **ENGINE)
    reference.update_weights(weights.items())
    want = reference.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8,
                                                                           ignore_eos=True), use_tqdm=False)[0]
    got = greedy(url)
    assert got["token_ids"] == want.outputs[0].token_ids and got["weight_versions"] == [version] * 8


def one_norm(checkpoint) -> dict:
    from safetensors.torch import load_file

    state = load_file(sorted(checkpoint.glob("*.safetensors"))[0])
    name = next(n for n in state if n.endswith("norm.weight"))
    return {name: state[name]}


def health(url) -> dict:
    return httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()


def test_health_sees_a_push_into_a_server_that_has_served_nothing(checkpoint, tmp_path):
    """A trainer's first act is often a push: /health says so before any request reached the server."""
    with running_server(checkpoint, tmp_path / "server.log", "--weight-receiver") as (_, url):
        endpoint = httpx.get(f"{url}/weight_receiver", headers=AUTH, timeout=10).json()["endpoint"]
        with WeightSender(endpoint) as sender:
            assert sender.send(one_norm(checkpoint)) == 1
        deadline = time.monotonic() + 3  # not a race: without the fix the front never reads the engine's status
        while health(url)["weight_version"] != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert health(url)["weight_version"] == 1
        assert httpx.get(f"{url}/weight_receiver", headers=AUTH, timeout=10).json()["weight_version"] == 1


def test_health_is_current_once_send_returns(pushing_server, checkpoint):
    """The engine tells the front before it answers the sender: /health after send() has its version."""
    endpoint = httpx.get(f"{pushing_server}/weight_receiver", headers=AUTH, timeout=10).json()["endpoint"]
    seen = []
    with WeightSender(endpoint) as sender:
        for _ in range(20):
            version = sender.send(one_norm(checkpoint))
            seen.append((version, health(pushing_server)["weight_version"]))
    assert [v for v, h in seen if v != h] == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_server_takes_cuda_tensors_by_ipc_and_host_tensors(checkpoint, tmp_path):
    """A server on the GPU: a trainer's CUDA tensors arrive as IPC handles of their storage, twice (the second
    update reuses the shares), and host tensors by copy; each push is what the replies are computed from."""
    gpu = dict(ENGINE, device="cuda", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = Engine(checkpoint, **gpu)

    def want(weights) -> list[int]:
        reference.update_weights(weights.items())
        return reference.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].token_ids

    with running_server(checkpoint, tmp_path / "server.log", "--weight-receiver", "--device", "cuda",
                        "--dtype", "float32") as (_, url):
        endpoint = httpx.get(f"{url}/weight_receiver", headers=AUTH, timeout=10).json()["endpoint"]
        first = {n: t.cuda() for n, t in moved_weights(checkpoint).items()}
        with WeightSender(endpoint) as sender:
            assert sender.send(first) == 1
            assert greedy(url)["token_ids"] == want(first)
            for t in first.values():
                t.neg_()  # in place: the shared storages carry the new values
            assert sender.send(first) == 2
            assert greedy(url)["token_ids"] == want(first) != want({n: -t for n, t in first.items()})
            host = {n: t.cpu() * 0.5 for n, t in first.items()}
            assert sender.send(host) == 3
            got = greedy(url)
        assert got["token_ids"] == want(host) and got["weight_versions"] == [3] * 8
