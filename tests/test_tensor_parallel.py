"""Tensor parallelism: Engine(tensor_parallel_size=2) drives a worker process over gloo (CPU, float32).

TP=2 computes what TP=1 computes, except the order of two sums per layer (the all-reduced o_proj and
down_proj partial sums) and nothing else, so float32 logprobs agree to ~1e-6; 1e-4 is the repo's logprob
tolerance against transformers. The tiny models' logits are spread apart (conftest's initializer_range), so
greedy and seeded tokens are the same tokens.
"""
import asyncio
import functools
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from conftest import FAMILIES, build_hf_model
from helpers import make_prompts

from rollout_engine import AsyncEngine, Engine, EngineDeadError, EngineError, SamplingParams
from rollout_engine.parallel import driver

FOUR = ("llama3", "mistral", "qwen2", "qwen3", "llama-linear-bias")  # the last: o_proj and down_proj biases
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True, seed=7)
SCORED = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
KV = 8 << 20


def build(family: str, seed: int = 0):
    """conftest's tiny `family` model with 2 KV heads (4 query heads), so each of 2 ranks holds one, and
    random biases (transformers starts them at zero, where a bias added on both ranks would hide)."""
    config_cls, model_cls, extra = FAMILIES[family]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(FAMILIES, family, (config_cls, model_cls, extra | {"num_key_value_heads": 2}))
        model = build_hf_model(family, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(family, seed) -> (path, HF model), each saved once."""
    @functools.cache
    def get(family: str, seed: int = 0):
        model, path = build(family, seed), tmp_path_factory.mktemp(f"tp-{family}-{seed}")
        model.save_pretrained(path, safe_serialization=True)
        return path, model

    return get


def engine(path, tp=1, **kw):
    return Engine(path, device="cpu", kv_cache_memory=KV, tensor_parallel_size=tp, **kw)


def run(e, prompts, params):
    return [[(o.token_ids, o.logprobs) for o in out.outputs] for out in e.generate(prompts, params, use_tqdm=False)]


def assert_same(got, want):
    """Same tokens; logprobs within 1e-4."""
    for g_req, w_req in zip(got, want, strict=True):
        for (g_tok, g_lp), (w_tok, w_lp) in zip(g_req, w_req, strict=True):
            assert g_tok == w_tok
            torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(w_lp), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FOUR)
def test_tp2_equals_tp1(checkpoint, family):
    path, _ = checkpoint(family)
    prompts = make_prompts((5, 17, 40))
    one = engine(path)
    want = {name: run(one, prompts, p) for name, p in (("greedy", GREEDY), ("sampled", SAMPLED))}
    want_scored = one.generate(prompts[:2], SCORED, use_tqdm=False)
    del one
    two = engine(path, tp=2)
    try:
        assert two.kv.pools["target"].num_kv_heads == 1  # each rank's pool holds its own KV head only
        assert_same(run(two, prompts, GREEDY), want["greedy"])
        # n=3 samples fork the prompt's last partial block: the block copies reach the worker's pool too
        assert_same(run(two, prompts, SAMPLED), want["sampled"])
        # prompt logprobs and top-k alternatives: eager steps whose LM-head calls the worker joins
        got_scored = two.generate(prompts[:2], SCORED, use_tqdm=False)
        for g, w in zip(got_scored, want_scored):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            for g_pos, w_pos in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
                assert g_pos.keys() == w_pos.keys()
                torch.testing.assert_close(torch.tensor(list(g_pos.values())), torch.tensor(list(w_pos.values())),
                                           atol=1e-4, rtol=0)
    finally:
        two.shutdown()


def test_lifecycle_on_both_ranks(checkpoint, monkeypatch):
    path, _ = checkpoint("qwen3")
    new_path, new_model = checkpoint("qwen3", seed=1)
    prompts = make_prompts((6, 23))
    reference = engine(new_path)
    want_new = run(reference, prompts, GREEDY)
    del reference
    two = engine(path, tp=2)
    procs = list(two.tp.procs)
    try:
        before = run(two, prompts, GREEDY)
        two.sleep(level=1)
        two.wake()
        assert run(two, prompts, GREEDY) == before  # bitwise: the same ranks, the same sums
        # level 2: weights discarded on both ranks; staged wake, a full update, then the pool
        two.sleep(level=2)
        two.wake(tags=["weights"])
        assert two.update_weights(new_model.state_dict().items()) == 1
        two.wake(tags=["kv_cache"])
        assert_same(run(two, prompts, GREEDY), want_new)
        # from disk: each rank reads its slices itself
        assert two.update_weights_from_disk(path) == 2
        assert run(two, prompts, GREEDY) == before
        # a transport's buckets, group by group (each taken whole before the next)
        pairs = list(new_model.state_dict().items())
        assert two.update_weights_from_buckets([pairs[:5], pairs[5:]]) == 3
        assert_same(run(two, prompts, GREEDY), want_new)
        two.flush_cache()
        assert_same(run(two, prompts, GREEDY), want_new)
        # a relative path is the caller's: the worker, started in another directory, reads the same checkpoint
        monkeypatch.chdir(path.parent)
        assert two.update_weights_from_disk(path.name) == 4
        assert run(two, prompts, GREEDY) == before
    finally:
        two.shutdown()
    assert all(p.poll() is not None for p in procs)  # shutdown stopped the worker


def _listening_sockets() -> set[str]:
    """Inodes of the TCP sockets this process holds open in the LISTEN state (Linux /proc)."""
    mine = {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")}
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A":  # LISTEN
                        listening.add(fields[9])
    return {inode for inode in listening if f"socket:[{inode}]" in mine}


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="reads Linux /proc")
def test_shutdown_closes_the_groups_listening_socket(checkpoint):
    """The driver's collective group listens on loopback while the engine runs; shutdown closes it then, not
    whenever the garbage collector drops the last reference to the group."""
    path, _ = checkpoint("mistral")
    before = _listening_sockets()
    two = engine(path, tp=2)
    try:
        opened = _listening_sockets() - before
        assert opened, "the group listens while the engine runs"
    finally:
        two.shutdown()
    assert not _listening_sockets() & opened


def test_async_engine_over_tp(checkpoint):
    path, _ = checkpoint("mistral")
    prompts = make_prompts((7, 12))
    want = run(engine(path), prompts, GREEDY)
    async_engine = AsyncEngine(path, device="cpu", kv_cache_memory=KV, tensor_parallel_size=2)
    procs = list(async_engine.engine.tp.procs)

    async def both():
        return await asyncio.gather(*(async_engine.generate(p, GREEDY) for p in prompts))

    with async_engine:  # leaving it shuts the engine down: the worker exits
        got = asyncio.run(both())
        assert_same([[(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in got], want)
    assert all(p.poll() is not None for p in procs)


def test_bad_updates_leave_both_ranks_serving(checkpoint):
    path, model = checkpoint("llama3")
    prompts = make_prompts((9,))
    two = engine(path, tp=2)
    try:
        before = run(two, prompts, GREEDY)
        named = dict(model.state_dict())
        q = "model.layers.0.self_attn.q_proj.weight"
        with pytest.raises(ValueError, match="has shape"):
            two.update_weights([(q, named[q][:, :10])])
        with pytest.raises(ValueError, match="unknown weight name"):
            two.update_weights([("model.layers.0.nope.weight", named[q])])
        bad = named[q].clone()
        bad[0, 0] = float("nan")
        with pytest.raises(ValueError, match="NaN"):
            two.update_weights([(q, bad)])
        for update in (lambda: two.update_weights(named.items(), sharded=True),  # the driver holds no slices
                       lambda: two.update_weights_from_buckets([list(named.items())], sharded=True)):
            with pytest.raises(ValueError, match="sharded=True is not allowed with tensor_parallel_size"):
                update()
        assert two.weight_version == 0
        assert run(two, prompts, GREEDY) == before  # nothing was copied on either rank
        # a complete update of the same values goes through on both ranks
        assert two.update_weights(named.items()) == 1
        assert run(two, prompts, GREEDY) == before
    finally:
        two.shutdown()


def test_killed_worker_raises_engine_error_within_seconds(checkpoint):
    path, _ = checkpoint("qwen2")
    prompts = make_prompts((8,))
    two = engine(path, tp=2)
    try:
        run(two, prompts, GREEDY)
        two.tp.procs[0].kill()
        two.tp.procs[0].wait()
        start = time.monotonic()
        with pytest.raises(EngineError, match="rank 1"):
            two.generate(prompts, GREEDY, use_tqdm=False)
        with pytest.raises(EngineError, match="rank 1"):  # and every later call, at once
            two.sleep()
        assert time.monotonic() - start < 5
    finally:
        two.shutdown()


def test_worker_killed_mid_generate(checkpoint):
    path, _ = checkpoint("qwen2")
    two = engine(path, tp=2)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    try:
        killer = threading.Timer(1.0, two.tp.procs[0].kill)
        killer.start()
        start = time.monotonic()
        with pytest.raises(EngineError):
            for _ in range(20):  # each call runs a few seconds; the kill lands inside one
                two.generate(make_prompts((8, 8, 8, 8)), long, use_tqdm=False)
        assert time.monotonic() - start < 1.0 + 10
    finally:
        two.shutdown()


def test_a_step_stopped_half_way_on_the_driver_fails_the_next_call_at_once(checkpoint, monkeypatch):
    """Ctrl-C inside the driver's forward leaves the worker waiting in that step's collectives: the next call
    raises EngineDeadError at once, not after the collective timeout."""
    path, _ = checkpoint("qwen3")
    two = engine(path, tp=2)
    try:
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(two.model, "forward", interrupted)
        with pytest.raises(KeyboardInterrupt):
            two.generate(make_prompts((6,)), GREEDY, use_tqdm=False)
        monkeypatch.undo()
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="stopped half way"):
            two.generate(make_prompts((6,)), GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 5
        start = time.monotonic()
        two.shutdown()  # the worker waits in the broken step's collective and reads no "shutdown": killed at once
        assert time.monotonic() - start < driver.EXIT_GRACE_S
    finally:
        two.shutdown()


def test_workers_exit_when_the_driver_dies(checkpoint, tmp_path):
    path, _ = checkpoint("qwen3")
    script = (f"import json, torch; from rollout_engine import Engine\n"
              f"e = Engine({str(path)!r}, device='cpu', kv_cache_memory={KV}, tensor_parallel_size=2)\n"
              f"print(json.dumps([[p.pid for p in e.tp.procs], e.tp.dir]), flush=True)\n"
              f"import time; time.sleep(120)\n")
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids, private_dir = json.loads(driver.stdout.readline())
        assert os.path.isdir(private_dir)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
        assert not os.path.exists(private_dir)  # the killed driver's rendezvous directory, removed by its workers
    finally:
        driver.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_dropped_engine_stops_its_workers(checkpoint):
    path, _ = checkpoint("qwen3")
    two = engine(path, tp=2)
    procs = list(two.tp.procs)
    del two
    gc.collect()
    assert all(p.poll() is not None for p in procs)


def test_benchmark_ops_run_on_every_rank(checkpoint):
    """decode_roofline.py's ops: the worker's pool is filled too (the mean square of N standard normal values
    is 1 within sqrt(2 / N), ~1e-3 for these pools, so 0.02 fails only for a pool not filled), and the collectives
    timing leaves both ranks in step: the same tokens after as before (the fill is flushed from the prefix cache)."""
    path, _ = checkpoint("qwen3")
    prompts = make_prompts((6, 23))
    two = engine(path, tp=2)
    try:
        before = run(two, prompts, GREEDY)
        squares = two.tp.fill_kv_random(two.kv)
        assert len(squares) == 2 and all(abs(s - 1) < 0.02 for s in squares), squares
        seconds = two.tp.time_collectives(4, two.cfg, two.dtype)
        assert 0 < seconds < 10
        two.flush_cache()
        assert run(two, prompts, GREEDY) == before
    finally:
        two.shutdown()


@pytest.mark.parametrize("size, match", [(0, "positive int"), (True, "positive int"), ("2", "positive int"),
                                         (3, "does not divide the model's num_key_value_heads")])
def test_bad_tensor_parallel_size_refused(checkpoint, size, match):
    path, _ = checkpoint("qwen3")
    with pytest.raises(ValueError, match=match):
        engine(path, tp=size)


@pytest.mark.parametrize("kw", [dict(quantization="fp8"), dict(batch_invariant=True),
                                dict(draft_model="[ngram]", num_speculative_tokens=2)])
def test_modes_not_run_with_tp_refused(checkpoint, kw):
    path, _ = checkpoint("qwen3")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 cannot be combined"):
        engine(path, tp=2, **kw)


GPU_GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
GPU_PROMPTS = [list(range(3, 40)), list(range(100, 108)), list(range(500, 517))]


def gpu_reference(path) -> list:
    """Save a Llama checkpoint of 2 ranks' shape (8 heads, 4 KV heads) at `path`; TP=1's greedy outputs on cuda:0."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                                      initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).float().save_pretrained(path, safe_serialization=True)
    one = Engine(path, device="cuda", kv_cache_memory=1 << 30)
    want = run(one, GPU_PROMPTS, GPU_GREEDY)
    del one
    gc.collect()
    torch.cuda.empty_cache()
    return want


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("enforce_eager", [False, True])  # False: decode graphs with NCCL collectives inside
def test_gpu_tp2_greedy_equals_tp1(tmp_path, enforce_eager):
    want = gpu_reference(tmp_path)
    params, prompts = GPU_GREEDY, GPU_PROMPTS
    two = Engine(tmp_path, device="cuda", kv_cache_memory=1 << 30, tensor_parallel_size=2, enforce_eager=enforce_eager)
    try:
        assert_same(run(two, prompts, params), want)
        two.sleep(level=1)
        two.wake()
        assert_same(run(two, prompts, params), want)
    finally:
        two.shutdown()
    with pytest.raises(ValueError, match="one per rank"):
        Engine(tmp_path, device="cuda", tensor_parallel_size=torch.cuda.device_count() * 2)


def test_a_worker_ignores_ctrl_c_sent_to_the_terminals_process_group(checkpoint):
    """A terminal sends Ctrl-C to its whole foreground process group, the workers included; a driver that
    survives it (a REPL, an app that handles SIGINT) keeps a working engine: the workers leave it to the driver."""
    path, _ = checkpoint("qwen3")
    prompts = make_prompts((6,))
    two = engine(path, tp=2)
    try:
        before = run(two, prompts, GREEDY)
        os.kill(two.tp.procs[0].pid, signal.SIGINT)
        time.sleep(0.5)
        assert two.tp.procs[0].poll() is None
        assert_same(run(two, prompts, GREEDY), before)
    finally:
        two.shutdown()


def test_after_a_worker_dies_every_call_names_it(checkpoint):
    """Killed during a step, the worker makes that step's collective fail; every later call names the worker
    that exited (not the driver's half-done step, which only followed from it)."""
    path, _ = checkpoint("qwen3")
    two = engine(path, tp=2)
    long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    try:
        threading.Timer(0.5, two.tp.procs[0].kill).start()
        with pytest.raises(EngineDeadError):
            for _ in range(20):
                two.generate(make_prompts((8, 8, 8)), long, use_tqdm=False)
        two.tp.procs[0].wait(10)
        for call in (lambda: two.generate(make_prompts((4,)), GREEDY, use_tqdm=False), two.sleep):
            with pytest.raises(EngineDeadError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
                call()
    finally:
        two.shutdown()


@pytest.fixture
def package_copy(tmp_path):
    """A copy of the packages an engine imports, whose worker records which copy it imported (TP_MARKER) and
    fails to import when told (TP_FAIL_IMPORT; only in a worker, which runs `python -c`)."""
    import shutil

    import rollout_engine
    root = os.path.dirname(os.path.dirname(rollout_engine.__file__))
    copy = tmp_path / "copy"
    for package in ("rollout_engine", "rollout_kernels", "pool_layout"):
        shutil.copytree(os.path.join(root, package), copy / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    worker = copy / "rollout_engine" / "parallel" / "worker.py"
    worker.write_text(worker.read_text() + (
        "\nimport sys as _sys\n"
        "if _sys.argv[0] == '-c' and os.environ.get('TP_FAIL_IMPORT'):\n"
        "    raise ImportError('this worker cannot import its engine')\n"
        "if _sys.argv[0] == '-c':\n"
        "    open(os.environ['TP_MARKER'], 'w').write(__file__)\n"))
    return copy


@pytest.mark.parametrize("fail", [False, True])
def test_workers_import_the_rollout_engine_the_driver_imported(checkpoint, package_copy, tmp_path, fail):
    """A driver that found rollout_engine on a sys.path of its own (a checkout beside an installed copy) starts
    workers that import the same one, as multiprocessing's spawn would; a worker that cannot import it makes the
    build raise that error."""
    path, _ = checkpoint("qwen3")
    marker = tmp_path / "imported"
    script = (f"import sys; sys.path.insert(0, {str(package_copy)!r})\n"
              f"import rollout_engine; assert rollout_engine.__file__.startswith({str(package_copy)!r})\n"
              f"from rollout_engine import Engine\n"
              f"try:\n"
              f"    Engine({str(path)!r}, device='cpu', kv_cache_memory={KV}, tensor_parallel_size=2).shutdown()\n"
              f"except Exception as err:\n"
              f"    print(type(err).__name__, err)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TP_MARKER": str(marker)}
    if fail:
        env["TP_FAIL_IMPORT"] = "1"
    (tmp_path / "driver.py").write_text(script)  # a file: only the workers run `python -c`
    done = subprocess.run([sys.executable, "driver.py"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    if fail:
        assert "importing rollout_engine failed" in done.stdout and "cannot import its engine" in done.stdout
    else:
        assert done.stdout == "" and marker.read_text().startswith(str(package_copy))


def in_workers(module, code: str) -> None:
    """`code` appended to a package copy's `module` file, run there in worker processes only (they run
    `python -c`), with os as _os."""
    module.write_text(module.read_text() + "\nimport os as _os, sys as _sys\nif _sys.argv[0] == '-c':\n"
                      + textwrap.indent(textwrap.dedent(code).strip() + "\n", "    "))


def run_driver(tmp_path, script: str, **env) -> list[str]:
    """`script` run as a file in `tmp_path` (only the workers run `python -c`, so only they take a copy's
    injected failures), with `env` added; its stdout's lines."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TP_MARKER": str(tmp_path / "imported")} | env
    (tmp_path / "driver.py").write_text(script)
    done = subprocess.run([sys.executable, "driver.py"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_an_update_that_only_a_worker_fails_takes_no_version(checkpoint, package_copy, tmp_path):
    """The driver copied the update whole (its version and history moved) and a worker refused it: the weights were
    marked incomplete but the version stayed taken, so the next update skipped a number and a trainer's explicit
    version was refused. Now the driver takes its version and history entry back, as an SPMD rank does when
    another fails. The failure is injected in the copy's workers only (they run `python -c`), when a file exists."""
    path, _ = checkpoint("llama3")
    store = package_copy / "rollout_engine" / "weight_store.py"
    in_workers(store, """
        _checked = WeightStore._check_finite
        def _failing(self, group):
            if _os.path.exists(_os.environ['TP_FAIL_UPDATE']):
                raise ValueError('this worker refuses the update')
            return _checked(self, group)
        WeightStore._check_finite = _failing
    """)
    flag = tmp_path / "fail"
    script = (f"import glob, os, sys; sys.path.insert(0, {str(package_copy)!r})\n"
              f"from safetensors.torch import load_file\n"
              f"from rollout_engine import Engine, EngineError, WeightsNotReadyError\n"
              f"weights = [t for f in glob.glob({str(path)!r} + '/*.safetensors') for t in load_file(f).items()]\n"
              f"e = Engine({str(path)!r}, device='cpu', kv_cache_memory={KV}, tensor_parallel_size=2)\n"
              f"open({str(flag)!r}, 'w').close()\n"
              f"try:\n"
              f"    e.update_weights(weights)\n"
              f"except EngineError as err:\n"
              f"    print('refused:', 'this worker refuses the update' in str(err))\n"
              f"print('after:', e.weight_version, e.weight_history)\n"
              f"try:\n"
              f"    e.generate([[1, 2, 3]], use_tqdm=False)\n"
              f"except WeightsNotReadyError:\n"
              f"    print('generate refused')\n"
              f"os.remove({str(flag)!r})\n"
              f"print('next:', e.update_weights(weights), [(h['version'], h['complete']) for h in e.weight_history])\n"
              f"e.shutdown()\n")
    assert run_driver(tmp_path, script, TP_FAIL_UPDATE=str(flag)) == [
        "refused: True", "after: 0 []", "generate refused", "next: 1 [(1, True)]"]


def test_a_wake_takes_the_room_of_every_rank_not_the_drivers_alone(checkpoint, package_copy, tmp_path):
    """A trainer holding memory on one rank's device: wake() refuses with NoRoomError naming that rank (it was an
    EngineError from the worker's failed carve), wake(allow_resize=True) carves what fits on every rank (it failed
    the same way), and once the memory is back the pool grows to its first size. The worker processes of a copy of
    the packages see 40 KiB free while a flag file exists (only they run `python -c`)."""
    path, _ = checkpoint("llama3")
    kv = package_copy / "rollout_engine" / "kv_cache.py"
    in_workers(kv, """
        _free = available_bytes
        def available_bytes(device):
            return 40 << 10 if _os.path.exists(_os.environ['TP_LITTLE_ROOM']) else _free(device)
    """)
    flag = tmp_path / "little-room"
    script = (f"import sys; sys.path.insert(0, {str(package_copy)!r})\n"
              f"from rollout_engine import Engine, NoRoomError, SamplingParams\n"
              f"e = Engine({str(path)!r}, device='cpu', kv_cache_memory=1 << 17, tensor_parallel_size=2)\n"
              f"first = e.block_manager.num_blocks\n"
              f"greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)\n"
              f"want = e.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].outputs[0].token_ids\n"
              f"e.sleep(level=1)\n"
              f"open({str(flag)!r}, 'w').close()\n"
              f"try:\n"
              f"    e.wake()\n"
              f"except NoRoomError as err:\n"
              f"    print('refused:', 'ranks [1]' in str(err), e.memory_stats()['asleep'])\n"
              f"e.wake(allow_resize=True)\n"
              f"fewer = e.block_manager.num_blocks\n"
              f"print('resized:', 0 < fewer < first, e.generate([[1, 2, 3]], greedy, use_tqdm=False)[0]"
              f".outputs[0].token_ids == want)\n"
              f"e.sleep(level=1)\n"
              f"import os; os.remove({str(flag)!r})\n"
              f"e.wake(allow_resize=True)\n"
              f"print('grown back:', e.block_manager.num_blocks == first)\n"
              f"e.shutdown()\n")
    assert run_driver(tmp_path, script, TP_LITTLE_ROOM=str(flag)) == [
        "refused: True ['kv_cache']", "resized: True True", "grown back: True"]


def test_the_first_pool_is_what_every_ranks_budget_buys_not_the_drivers_alone(checkpoint, package_copy, tmp_path):
    """kv_cache_memory as a fraction is a share of each rank's own free memory: a worker with less room than the
    driver gets a pool its budget buys, and every rank carves that many blocks (the driver's count alone was
    carved on every rank, past the worker's budget, or out of memory on a GPU). The worker processes of a copy
    of the packages see 96 KiB free while a flag file exists (only they run `python -c`)."""
    path, _ = checkpoint("llama3")
    in_workers(package_copy / "rollout_engine" / "kv_cache.py", """
        _free = available_bytes
        def available_bytes(device):
            return 96 << 10 if _os.path.exists(_os.environ['TP_LITTLE_ROOM']) else _free(device)
    """)
    flag = tmp_path / "little-room"
    flag.touch()
    script = (f"import os, sys; sys.path.insert(0, {str(package_copy)!r})\n"
              f"from rollout_engine import Engine, SamplingParams\n"
              f"greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)\n"
              f"def build():\n"
              f"    e = Engine({str(path)!r}, device='cpu', kv_cache_memory=0.5, max_num_seqs=4,\n"
              f"               tensor_parallel_size=2)\n"
              f"    out = e.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].outputs[0].token_ids\n"
              f"    found = (e.block_manager.num_blocks, e.memory_stats()['kv_cache_bytes'], out)\n"
              f"    e.shutdown()\n"
              f"    return found\n"
              f"little = build()\n"
              f"os.remove({str(flag)!r})\n"
              f"roomy = build()\n"
              f"print('within the worker budget:', little[1] <= 48 << 10, 0 < little[0] < roomy[0])\n"
              f"print('same tokens:', little[2] == roomy[2])\n")
    assert run_driver(tmp_path, script, TP_LITTLE_ROOM=str(flag)) == [
        "within the worker budget: True True", "same tokens: True"]


def test_a_worker_failing_to_read_its_room_fails_the_wake_at_once_and_the_engine_serves_on(checkpoint, package_copy,
                                                                                           tmp_path):
    """The driver gathers every rank's room for a wake: a worker whose read fails still joins the gather (it would
    hang there until the collective's timeout, the engine dead after), so the wake fails at once with its error,
    the pool sleeps on, and the next wake serves."""
    path, _ = checkpoint("llama3")
    kv = package_copy / "rollout_engine" / "kv_cache.py"
    in_workers(kv, """
        _fitting = KVCache.blocks_fitting
        def _failing(self, blocks, free=None):
            if _os.path.exists(_os.environ['TP_ROOM_FAILS']):
                _os.remove(_os.environ['TP_ROOM_FAILS'])
                raise RuntimeError('this worker cannot read its free memory')
            return _fitting(self, blocks, free)
        KVCache.blocks_fitting = _failing
    """)
    flag = tmp_path / "room-fails"
    script = (f"import sys, time; sys.path.insert(0, {str(package_copy)!r})\n"
              f"from rollout_engine import Engine, EngineError\n"
              f"e = Engine({str(path)!r}, device='cpu', kv_cache_memory={KV}, tensor_parallel_size=2)\n"
              f"e.sleep(level=1)\n"
              f"open({str(flag)!r}, 'w').close()\n"
              f"start = time.monotonic()\n"
              f"try:\n"
              f"    e.wake()\n"
              f"except EngineError as err:\n"
              f"    print('failed:', 'cannot read its free memory' in str(err), time.monotonic() - start < 20)\n"
              f"print('asleep:', e.memory_stats()['asleep'])\n"
              f"e.wake()\n"
              f"print('served:', len(e.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids) > 0)\n"
              f"e.shutdown()\n")
    assert run_driver(tmp_path, script, TP_ROOM_FAILS=str(flag)) == ["failed: True True", "asleep: ['kv_cache']",
                                                                      "served: True"]


def test_a_path_object_on_sys_path_reaches_the_workers(checkpoint, tmp_path, monkeypatch):
    """sys.path may hold pathlib.Path entries (the import system takes them): the workers get them as strings."""
    import pathlib

    monkeypatch.setattr(sys, "path", [*sys.path, pathlib.Path(tmp_path)])
    path, _ = checkpoint("qwen3")
    two = engine(path, tp=2)
    try:
        assert_same(run(two, make_prompts((5,)), GREEDY), run(engine(path), make_prompts((5,)), GREEDY))
    finally:
        two.shutdown()


def test_a_collective_timeout_names_the_groups_own_timeout():
    """SPMD runs on the caller's process group, whose timeout is the caller's: the error does not claim the
    engine's own groups' timeout."""
    from rollout_engine.parallel import COLLECTIVE_TIMEOUT_S, TPGroup

    class Stuck:
        def wait(self):
            raise RuntimeError("Timed out waiting 15000ms")

    class CallersGroup:
        def rank(self):
            return 0

        def size(self):
            return 2

        def allreduce(self, tensors):
            return Stuck()

    group = TPGroup.of(CallersGroup(), torch.device("cpu"))
    with pytest.raises(EngineDeadError, match="within the process group's timeout") as raised:
        group.all_reduce(torch.zeros(2))
    assert f"{COLLECTIVE_TIMEOUT_S} s" not in str(raised.value) and group.failed
