"""Regression tests of the hardening (issue "Hardening"): one public call at a time, NaN/inf weights and
logits, strictly increasing weight versions, non-finite and mutated SamplingParams, errors that name their
file or argument (also through the CLI), counters that survive sleep/wake and a pool re-sized by wake.

Each test fails on the tree before the fixes (39c9fc6). Errors the fixes added are looked up by name, so
these tests run there too and fail on the behaviour rather than at import.
"""
import contextlib
import json
import shutil
import signal
import threading
import time

import numpy as np
import pytest
import torch
from helpers import make_prompts
from safetensors.torch import load_file, save_file

import rollout_engine
import rollout_engine.engine as engine_module
import rollout_engine.kv_cache as kv_cache_module
from rollout_engine import Engine, EngineError, SamplingParams
from rollout_engine.cli import main as cli_main


def _added_error(name):
    """An error class the hardening added, or (on an older tree) a stand-in that nothing raises."""
    return getattr(rollout_engine, name, None) or type(name, (EngineError,), {})


EngineBusyError = _added_error("EngineBusyError")
NonFiniteLogitsError = _added_error("NonFiniteLogitsError")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
KV_BYTES = 32 << 20


@pytest.fixture
def qwen3(hf_checkpoint):
    return hf_checkpoint("qwen3")


def make_engine(path, **kwargs):
    return Engine(path, device="cpu", **{"kv_cache_memory": KV_BYTES, **kwargs})


def greedy(engine, prompts=None):
    outs = engine.generate(make_prompts() if prompts is None else prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def hf_pairs(model, **replace):
    """The HF model's (name, tensor) pairs, with some tensors replaced."""
    return [(n, replace.get(n, t.detach().clone())) for n, t in model.state_dict().items()]


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


@contextlib.contextmanager
def deadline(seconds):
    """Raise TimeoutError in the main thread if the block runs longer than `seconds` (a hang fails, not blocks)."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------------------------------------- 5. one thread


class SignallingTokenizer:
    """The engine's tokenizer, setting `started` when generate() tokenizes its first prompt (the call is then
    running, holding the engine)."""

    def __init__(self, inner, started):
        self.inner, self.started = inner, started

    def __call__(self, *args, **kwargs):
        self.started.set()
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


BUSY_PROMPTS = [f"{i}+{i * 7 % 100}= the model sample reward" for i in range(200)]
BUSY_PARAMS = SamplingParams(temperature=1.0, seed=7, max_tokens=64, ignore_eos=True)


def summary(outs):
    return [(o.weight_version, [(c.token_ids, c.finish_reason) for c in o.outputs]) for o in outs]


@pytest.fixture(scope="module")
def busy_reference(tiny_checkpoint):
    """The long generate's outputs, run alone (one thread)."""
    return summary(make_engine(tiny_checkpoint).generate(BUSY_PROMPTS, BUSY_PARAMS, use_tqdm=False))


@contextlib.contextmanager
def generating_in_background(engine):
    """Run the long generate in a thread; yield once it holds the engine; then wait for it.

    Yields a dict that receives "outs" (or "error") when the thread ends."""
    started, result = threading.Event(), {}
    engine.tokenizer = SignallingTokenizer(engine.tokenizer, started)

    def run():
        try:
            result["outs"] = engine.generate(BUSY_PROMPTS, BUSY_PARAMS, use_tqdm=False)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            result["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30), "generate() never started tokenizing"
    try:
        yield result, thread
    finally:
        thread.join(120)
        assert not thread.is_alive(), "the first generate() did not finish"
        engine.tokenizer = engine.tokenizer.inner


def refused_at_once(label, call, thread):
    """`call` raises EngineBusyError (an EngineError) naming generate(), within a fraction of a second."""
    t0 = time.monotonic()
    with pytest.raises(EngineBusyError, match=r"generate\(\)") as info:
        call()
    assert time.monotonic() - t0 < 0.5, label
    assert thread.is_alive(), f"the first generate() had finished before {label}: the calls did not overlap"
    assert isinstance(info.value, EngineError)


def test_second_generate_from_another_thread_is_refused_and_the_first_completes(tiny_checkpoint, busy_reference):
    engine = make_engine(tiny_checkpoint)
    with generating_in_background(engine) as (result, thread):
        refused_at_once("generate", lambda: engine.generate(["1+1="], GREEDY, use_tqdm=False), thread)
    assert "error" not in result, result.get("error")
    assert summary(result["outs"]) == busy_reference  # complete, and as if run alone
    assert engine.generate(["1+1="], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_chat_from_another_thread_is_refused_before_it_renders(tiny_checkpoint, busy_reference):
    """chat() is refused by its own name before the conversation is checked or rendered with the engine's
    tokenizer: a malformed conversation still gets EngineBusyError, as a well-formed one does."""
    engine = make_engine(tiny_checkpoint)
    with generating_in_background(engine) as (result, thread):
        for conversation in ([{"role": "user", "content": "1+1="}], [{"role": "user"}]):
            refused_at_once("chat", lambda: engine.chat([conversation], GREEDY, use_tqdm=False), thread)
        with pytest.raises(EngineBusyError, match=r"Engine\.chat\(\) was called while Engine\.generate\(\) runs"):
            engine.chat([[{"role": "user"}]], GREEDY, use_tqdm=False)
    assert "error" not in result, result.get("error")
    assert summary(result["outs"]) == busy_reference
    engine.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the tiny one has none
    assert engine.chat([[{"role": "user", "content": "1+1="}]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_state_changing_calls_during_generate_are_refused_and_change_nothing(tiny_checkpoint, busy_reference):
    engine = make_engine(tiny_checkpoint)
    weights = [(n, torch.zeros_like(engine.weights.destination(n))) for n in sorted(engine.weights.names())]
    calls = {
        "flush_cache": engine.flush_cache,
        "memory_stats": engine.memory_stats,
        "stats": engine.stats,
        "update_weights": lambda: engine.update_weights(weights),
        "update_weights_from_disk": lambda: engine.update_weights_from_disk(tiny_checkpoint),
        "sleep": lambda: engine.sleep(level=2),
        "wake": engine.wake,
    }
    with generating_in_background(engine) as (result, thread):
        for label, call in calls.items():
            refused_at_once(label, call, thread)
    assert "error" not in result, result.get("error")
    assert summary(result["outs"]) == busy_reference  # every output tagged with the old version (0)
    assert engine.weight_version == 0 and engine.weight_history == []
    assert not engine.is_sleeping and engine.memory_stats()["asleep"] == []
    assert engine.update_weights_from_disk(tiny_checkpoint) == 1  # the engine is usable from any thread now


# ---------------------------------------------------------------------------------------------- 10. NaN / inf


BAD_NAME = "model.layers.1.mlp.down_proj.weight"


def test_nan_weight_update_is_refused_and_the_old_weights_serve(qwen3):
    path, model = qwen3
    engine = make_engine(path)
    before = greedy(engine)
    bad = model.state_dict()[BAD_NAME].detach().clone()
    bad[3, 5] = float("nan")
    zeros = {n: torch.zeros_like(t) for n, t in model.state_dict().items() if n != BAD_NAME}
    with pytest.raises(ValueError, match=BAD_NAME):
        engine.update_weights(hf_pairs(model, **zeros, **{BAD_NAME: bad}))  # one group: nothing copied
    assert engine.weight_version == 0
    assert greedy(engine) == before


def test_a_finite_weight_the_engine_dtype_cannot_hold_is_refused(qwen3):
    """1e300 in float64 is finite, but inf once cast to the float32 engine: refused before any copy, by name."""
    path, model = qwen3
    engine = make_engine(path)
    before = greedy(engine)
    bad = model.state_dict()[BAD_NAME].detach().double()
    bad[0, 0] = 1e300
    with pytest.raises(ValueError, match=f"{BAD_NAME}.*beyond the engine's dtype"):
        engine.update_weights([(BAD_NAME, bad)])
    assert engine.weight_version == 0 and greedy(engine) == before
    engine.update_weights([(BAD_NAME, bad.clamp(-1, 1))])  # in range, float64 is fine
    assert engine.weight_version == 1


@pytest.mark.parametrize("value", [1e5, 65536.0])
def test_a_bfloat16_weight_beyond_float16_is_refused_by_a_float16_engine(qwen3, value):
    """bfloat16 reaches as far as float32: a finite bfloat16 weight can be inf in a float16 engine. 65536 is
    float16's largest finite value (65504) rounded to bfloat16, and already inf in float16."""
    path, model = qwen3
    engine = make_engine(path, dtype="float16")
    before = greedy(engine)
    bad = model.state_dict()[BAD_NAME].detach().bfloat16()
    bad[0, 0] = value
    with pytest.raises(ValueError, match=f"{BAD_NAME}.*beyond the engine's dtype"):
        engine.update_weights([(BAD_NAME, bad)])
    assert engine.weight_version == 0 and greedy(engine) == before
    engine.update_weights([(BAD_NAME, bad.clamp(-1, 1))])  # in range, bfloat16 is fine
    assert engine.weight_version == 1


def test_an_update_from_parameters_that_require_grad_joins_no_graph(qwen3):
    """update_weights(model.named_parameters()) straight from a trainer: the engine's weights stay plain
    tensors (no grad_fn, no requires_grad), so no autograd graph ties them to the trainer's parameters."""
    path, model = qwen3
    engine = make_engine(path)
    for _ in range(2):
        engine.update_weights(model.named_parameters())
    held = [p for p in engine.model.parameters()] + [b for b in engine.model.buffers()]
    assert not any(t.requires_grad or t.grad_fn is not None for t in held)


def test_inf_weight_from_disk_is_refused_and_the_old_weights_serve(qwen3, tmp_path):
    path, model = qwen3
    engine = make_engine(path)
    before = greedy(engine)
    bad_dir = copy_checkpoint(path, tmp_path / "inf")
    tensors = {n: torch.zeros_like(t) for n, t in load_file(bad_dir / "model.safetensors").items()}
    tensors[BAD_NAME][-1, -1] = float("inf")
    save_file(tensors, bad_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=BAD_NAME):
        engine.update_weights_from_disk(bad_dir)
    assert engine.weight_version == 0
    assert greedy(engine) == before


def test_check_finite_false_serves_nan_weights_and_generate_raises_naming_the_request(qwen3):
    path, model = qwen3
    engine = make_engine(path, check_finite=False)
    before = greedy(engine)
    nan_norm = torch.full_like(model.state_dict()["model.norm.weight"], float("nan"))
    assert engine.update_weights([("model.norm.weight", nan_norm)]) == 1  # accepted: the check is off
    with pytest.raises(NonFiniteLogitsError, match=r"request \d+") as info:
        engine.generate(make_prompts(), GREEDY, use_tqdm=False)
    assert isinstance(info.value, EngineError)
    assert engine.update_weights(hf_pairs(model)) == 2
    assert greedy(engine) == before


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_single_nan_in_a_projection_reaches_the_logits(qwen3, batch_invariant):
    """One NaN in q_proj (check_finite=False) makes one head's queries NaN: the attention must carry it to the
    logits, so sampling refuses them, not serve tokens from the other heads (the CPU attention zeroed NaN
    probabilities, which it meant for rows with no key, and the fixed-split fold skipped NaN chunks)."""
    path, model = qwen3
    engine = make_engine(path, check_finite=False, batch_invariant=batch_invariant)
    name = "model.layers.0.self_attn.q_proj.weight"
    weight = model.state_dict()[name].clone()
    weight[3, 3] = float("nan")
    engine.update_weights([(name, weight)])
    with pytest.raises(NonFiniteLogitsError):
        engine.generate(make_prompts(), GREEDY, use_tqdm=False)


def _nonfinite_cases(dtype, device):
    """(label, tensor, whether it holds a non-finite value): clean, and NaN/+inf/-inf at the first, second,
    middle, next-to-last and last element, at odd and even sizes, also in views that start at element 1 or 2
    of a larger tensor whose elements just outside the view are NaN (they must not be seen)."""
    g = torch.Generator().manual_seed(0)
    info = torch.finfo(dtype)
    cases = []
    for size in (1, 2, 3, 7, 64, 2047, 4099, 4100):
        for offset in (0, 1, 2):
            base = torch.randn(size + offset + 1, generator=g).to(dtype)
            base[0] = float("nan") if offset else 0.0
            base[-1] = float("nan")
            base[offset + size // 2] = info.max  # large but finite
            if size > 2:
                base[offset + 1] = info.tiny / 4  # subnormal
            view = base.to(device).clone()[offset : offset + size]
            cases.append((f"{dtype} size {size} offset {offset} clean", view, False))
            for pos in sorted({0, 1, size // 2, size - 2, size - 1} & set(range(size))):
                for value in (float("nan"), float("inf"), float("-inf")):
                    bad = base.to(device).clone()[offset : offset + size]
                    bad[pos] = value
                    cases.append((f"{dtype} size {size} offset {offset} {value} at {pos}", bad, True))
    return cases


def _check_nonfinite_kernel(dtypes, device):
    from rollout_kernels.finite import nonfinite_ref, nonfinite_triton

    cases = [case for dtype in dtypes for case in _nonfinite_cases(dtype, device)]
    assert [flag for _, _, flag in cases] == nonfinite_ref([t for _, t, _ in cases])
    for label, tensor, flag in cases:  # one tensor per launch (the interpreter runs every program over every tensor)
        assert nonfinite_triton([tensor]) == [flag], label
    # several tensors of several dtypes in one call: each flag lands on its own tensor
    mixed = [(t, flag) for i, (_, t, flag) in enumerate(cases) if i % 23 in (0, 5)]
    assert nonfinite_triton([t for t, _ in mixed]) == [flag for _, flag in mixed]


def test_nonfinite_kernel_matches_the_reference():
    """Through Triton's interpreter on the CPU (conftest sets TRITON_INTERPRET=1), or on the GPU."""
    _check_nonfinite_kernel((torch.float32, torch.float16), "cuda" if torch.cuda.is_available() else "cpu")
    _check_values_that_become_inf((torch.float32,), "cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nonfinite_kernel_matches_the_reference_on_gpu_with_bfloat16():
    _check_nonfinite_kernel((torch.float32, torch.float16, torch.bfloat16), "cuda")
    _check_values_that_become_inf((torch.float32, torch.bfloat16), "cuda")


# (source dtype, destination, the largest source value still finite there, the least that is not)
INTO_BOUNDARIES = [(torch.float32, torch.bfloat16, 0x7F7F7FFF, 0x7F7F8000),  # 3.3961e38 rounds (half to even) to inf
                   (torch.float32, torch.float16, 0x477FEFFF, 0x477FF000),  # 65520 likewise
                   (torch.bfloat16, torch.float16, 0x477F, 0x4780)]  # 65280 stays, 65536 is inf


def _check_values_that_become_inf(dtypes, device):
    """A finite value that becomes inf in the dtype it is copied into counts as non-finite, by the reference and
    the kernel alike, from exactly the least such value; into None or a wider dtype, it does not."""
    from rollout_kernels.finite import nonfinite_ref, nonfinite_triton

    for dtype, into, fine, over in [b for b in INTO_BOUNDARIES if b[0] in dtypes]:
        bits = torch.int32 if dtype.itemsize == 4 else torch.int16
        for pattern, flag in ((fine, False), (over, True)):
            for sign in (1, -1):
                t = torch.zeros(6, dtype=dtype)
                t[3] = sign * torch.tensor([pattern], dtype=bits).view(dtype)[0]
                t = t.to(device)
                for check in (nonfinite_ref, nonfinite_triton):
                    assert check([t], [into]) == [flag], (check.__name__, dtype, into, hex(pattern), sign)
                    assert check([t], [None]) == [False] and check([t], [torch.float64]) == [False]


def test_a_float32_weight_that_rounds_to_inf_in_bfloat16_is_refused(qwen3):
    """float32 and bfloat16 share an exponent range, but float32's values from 3.3961e38 round to inf in
    bfloat16 (half to even): refused before any copy, by name; bfloat16's own largest finite value is taken."""
    path, model = qwen3
    engine = make_engine(path, dtype="bfloat16")
    before = greedy(engine)
    bad = model.state_dict()[BAD_NAME].detach().float().clone()
    bad[0, 0] = 3.3999e38
    with pytest.raises(ValueError, match=f"{BAD_NAME}.*beyond the engine's dtype"):
        engine.update_weights([(BAD_NAME, bad)])
    assert engine.weight_version == 0 and greedy(engine) == before
    bad[0, 0] = torch.finfo(torch.bfloat16).max
    engine.update_weights([(BAD_NAME, bad)])
    assert engine.weight_version == 1


# ---------------------------------------------------------------------------------------------- 11. versions


def test_weight_version_strictly_increases(qwen3):
    path, model = qwen3
    engine = make_engine(path)
    assert engine.update_weights(hf_pairs(model), version=100) == 100
    with pytest.raises(ValueError, match="version"):
        engine.update_weights(hf_pairs(model), version=5)
    assert engine.weight_version == 100
    assert engine.update_weights(hf_pairs(model)) == 101
    with pytest.raises(ValueError, match="version"):
        engine.update_weights(hf_pairs(model), version=101)
    assert engine.weight_version == 101
    assert engine.generate(make_prompts(), GREEDY, use_tqdm=False)[0].weight_version == 101


# ---------------------------------------------------------------------------------------------- 12. params


@pytest.mark.parametrize("field,value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("top_p", float("nan")),
    ("top_p", float("inf")), ("min_p", float("nan")), ("min_p", float("-inf")),
], ids=lambda v: str(v))
def test_non_finite_sampling_params_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_vllm_sampling_fields_are_taken_at_their_neutral_values_and_refused_otherwise():
    """Code written for vLLM passes its fields at the values that ask for nothing: taken, as the server takes them;
    any other value would be silently ignored, so it is refused naming the field. An unknown keyword names the
    fields there are."""
    sp = SamplingParams(n=2, presence_penalty=0.0, frequency_penalty=0, repetition_penalty=1.0, min_tokens=0,
                        skip_special_tokens=True, logit_bias={}, best_of=None, include_stop_str_in_output=False,
                        detokenize=True)
    assert sp == SamplingParams(n=2) == SamplingParams(n=2, presence_penalty=np.float64(0.0), min_tokens=np.int64(0))
    # best_of equal to n draws n and returns n: what the engine does (vLLM's clients send it so)
    assert SamplingParams(n=3, best_of=3) == SamplingParams(n=3)
    with pytest.raises(ValueError, match="best_of=4 is not supported"):
        SamplingParams(n=3, best_of=4)
    for name, value in [("repetition_penalty", 1.1), ("presence_penalty", 0.5), ("min_tokens", 1),
                        ("skip_special_tokens", False), ("logit_bias", {5: -100}), ("best_of", 4),
                        ("truncate_prompt_tokens", 8), ("repetition_penalty", True),
                        ("include_stop_str_in_output", True), ("detokenize", False)]:
        with pytest.raises(ValueError, match=f"{name}={value!r} is not supported"):
            SamplingParams(**{name: value})
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['bogus'\]; it takes \['n', 'temperature'"):
        SamplingParams(bogus=1)
    # set afterwards, as vLLM's params are: a field, or a neutral value; nothing else is kept to be ignored
    sp.repetition_penalty, sp.temperature, sp.best_of = 1.0, 0.5, 2
    assert sp == SamplingParams(n=2, temperature=0.5)
    with pytest.raises(ValueError, match="repetition_penalty=1.3 is not supported"):
        sp.repetition_penalty = 1.3
    with pytest.raises(AttributeError, match="no field 'max_new_tokens'; it has \\['n', 'temperature'"):
        sp.max_new_tokens = 5
    assert sp == SamplingParams(n=2, temperature=0.5)


def test_numpy_scalars_are_numbers_in_sampling_params(tiny_checkpoint):
    """A numpy scalar (a config value, a sweep's grid point) is a number: accepted, stored as a Python one."""
    sp = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), top_k=np.int32(3), max_tokens=np.int64(4),
                        seed=np.uint8(9), stop_token_ids=[np.int64(7)])
    assert (sp.n, sp.temperature, sp.top_k, sp.max_tokens, sp.seed, sp.stop_token_ids) == (2, 0.5, 3, 4, 9, [7])
    assert all(type(v) in (int, float) for v in (sp.n, sp.temperature, sp.top_k, sp.max_tokens, sp.seed))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=np.float64("nan"))
    with pytest.raises(ValueError, match=r"\bn="):
        SamplingParams(n=np.bool_(True))
    outs = make_engine(tiny_checkpoint).generate(["1+1="], sp, use_tqdm=False)
    assert len(outs[0].outputs) == 2 and all(1 <= len(c.token_ids) <= 4 for c in outs[0].outputs)


def test_a_numpy_integer_is_a_weight_version(qwen3):
    """A trainer's step counter as a numpy integer names the version as an int would; the engine and its outputs
    carry a Python int. A numpy bool is not one."""
    path, model = qwen3
    engine = make_engine(path)
    assert engine.update_weights(model.state_dict().items(), version=np.int64(7)) == 7
    assert type(engine.weight_version) is int
    assert type(engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].weight_version) is int
    with pytest.raises(ValueError, match="version"):
        engine.update_weights(model.state_dict().items(), version=np.bool_(True))


def test_fields_changed_after_construction_are_checked_by_generate(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    sp.n = 0
    with pytest.raises(ValueError, match=r"\bn\b"):
        engine.generate("model sample", sp, use_tqdm=False)
    sp.n, sp.temperature = 1, float("nan")
    with pytest.raises(ValueError, match="temperature"):
        engine.generate("model sample", sp, use_tqdm=False)
    sp.temperature = 0
    plain = engine.generate("model sample", sp, use_tqdm=False)[0].outputs[0]
    assert "s" in plain.text  # a letter of the stop string below comes, the string itself does not
    sp.stop = "zqs"  # one stop string, not the letters z, q, s
    got = engine.generate("model sample", sp, use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.finish_reason) == (plain.token_ids, "length")


def test_sleep_level_true_or_a_float_is_refused(tiny_checkpoint):
    """level is an int, as every other int argument: 1.0 slept, and SPMD ranks that pass 1 and 1.0 disagree."""
    engine = make_engine(tiny_checkpoint)
    for bad in (True, 1.0, 2.0):
        with pytest.raises(ValueError, match=rf"level={bad!r} is not allowed"):
            engine.sleep(level=bad)
        assert not engine.is_sleeping


@pytest.mark.parametrize("arg", ["max_num_batched_tokens", "max_model_len"])
def test_zero_limits_are_refused(tiny_checkpoint, arg):
    with pytest.raises(ValueError, match=arg):
        make_engine(tiny_checkpoint, **{arg: 0})


# ---------------------------------------------------------------------------------------------- 13. clear errors


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_broken_safetensors_file_is_named(qwen3, tmp_path, damage):
    path, model = qwen3
    bad_dir = copy_checkpoint(path, tmp_path / damage)
    file = bad_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x07garbage" * 100)
    with pytest.raises(ValueError, match=str(file)):
        make_engine(bad_dir)
    engine = make_engine(path)
    before = greedy(engine)
    with pytest.raises(ValueError, match=str(file)):
        engine.update_weights_from_disk(bad_dir)
    assert engine.weight_version == 0 and greedy(engine) == before


def test_malformed_config_json_is_named(qwen3, tmp_path):
    bad_dir = copy_checkpoint(qwen3[0], tmp_path / "cfg")
    (bad_dir / "config.json").write_text('{"vocab_size": 256,')
    with pytest.raises(ValueError, match="config.json"):
        make_engine(bad_dir)


def test_config_missing_hidden_size_is_named(qwen3, tmp_path):
    bad_dir = copy_checkpoint(qwen3[0], tmp_path / "cfg")
    config = json.loads((bad_dir / "config.json").read_text())
    del config["hidden_size"]
    (bad_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_size"):
        make_engine(bad_dir)


@pytest.mark.parametrize("content", ["{not json", '{"model": {"type": "Bogus"}, "added_tokens": []}'],
                         ids=["syntax", "schema"])
def test_malformed_tokenizer_json_is_named(tiny_checkpoint, tmp_path, content):
    bad_dir = copy_checkpoint(tiny_checkpoint, tmp_path / "tok")
    (bad_dir / "tokenizer.json").write_text(content)
    with pytest.raises(ValueError, match="tokenizer.json"):
        make_engine(bad_dir)


def test_unknown_dtype_is_named(tiny_checkpoint):
    with pytest.raises(ValueError, match="dtype"):
        make_engine(tiny_checkpoint, dtype="float99")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_device_without_cuda_is_named(tiny_checkpoint):
    with pytest.raises(ValueError, match="device"):
        Engine(tiny_checkpoint, device="cuda", kv_cache_memory=KV_BYTES)


def test_array_and_dict_prompts_give_the_same_tokens_as_lists(qwen3):
    engine = make_engine(qwen3[0])
    prompts = make_prompts()
    want = greedy(engine, prompts)
    forms = {
        "numpy int64": [np.array(p, dtype=np.int64) for p in prompts],
        "numpy int32": [np.array(p, dtype=np.int32) for p in prompts],
        "torch int64": [torch.tensor(p) for p in prompts],
        "torch int32": [torch.tensor(p, dtype=torch.int32) for p in prompts],
        "dict": [{"prompt_token_ids": p} for p in prompts],
        "tuples": [tuple(p) for p in prompts],
    }
    for label, form in forms.items():
        assert greedy(engine, form) == want, label
    assert greedy(engine, torch.tensor(prompts[0])) == want[:1]  # one array: one prompt
    assert greedy(engine, {"prompt_token_ids": prompts[0]}) == want[:1]


def test_meta_tensor_is_refused_before_any_copy(qwen3):
    path, model = qwen3
    engine = make_engine(path)
    before = greedy(engine)
    meta = torch.empty(model.state_dict()[BAD_NAME].shape, device="meta")
    zeros = {n: torch.zeros_like(t) for n, t in model.state_dict().items() if n != BAD_NAME}
    with pytest.raises(ValueError, match=BAD_NAME):
        engine.update_weights(hf_pairs(model, **zeros, **{BAD_NAME: meta}))
    assert engine.weight_version == 0 and greedy(engine) == before  # the zeros were not copied


def test_bare_tensors_instead_of_pairs_are_refused(qwen3):
    path, model = qwen3
    engine = make_engine(path)
    before = greedy(engine)
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for bad in (tensors[0], tensors):
        with pytest.raises(ValueError, match="pairs"):
            engine.update_weights(bad)
    assert engine.weight_version == 0 and greedy(engine) == before


def test_an_update_without_pairs_is_refused_and_changes_nothing(qwen3):
    """An update that holds no pairs (most often a generator an earlier update used up) would leave the old
    weights serving while the trainer believes they are new: it is refused, and the engine serves on."""
    path, model = qwen3
    engine = make_engine(path)
    before = greedy(engine)
    pairs = ((n, t.detach().clone()) for n, t in model.state_dict().items())
    assert engine.update_weights(pairs) == 1
    for empty in (pairs, [], {}):
        with pytest.raises(ValueError, match="no \\(name, tensor\\) pairs.*weight_version stays 1"):
            engine.update_weights(empty)
    with pytest.raises(ValueError, match="no \\(name, tensor\\) pairs"):
        engine.update_weights_from_buckets([[], []], version=5)
    # a pair whose name carries nothing to load (a rotary buffer) is skipped: the message says so too
    with pytest.raises(ValueError, match="or only names that carry nothing to load \\(rotary_emb.inv_freq"):
        engine.update_weights([("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))])
    assert engine.weight_version == 1 and greedy(engine) == before
    assert engine.update_weights(hf_pairs(model), version=5) == 5


def _run_cli(capsys, argv):
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err
    return err


def test_cli_reports_a_bad_checkpoint_without_a_traceback(qwen3, tmp_path, capsys):
    bad_dir = copy_checkpoint(qwen3[0], tmp_path / "cfg")
    (bad_dir / "config.json").write_text("{")
    err = _run_cli(capsys, ["generate", "--model", str(bad_dir), "--prompt", "hi", "--device", "cpu"])
    assert "config.json" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_reports_a_missing_cuda_device(tiny_checkpoint, capsys):
    err = _run_cli(capsys, ["generate", "--model", str(tiny_checkpoint), "--prompt", "hi", "--device", "cuda"])
    assert "device" in err


def test_cli_reports_an_engine_error_without_a_traceback(tiny_checkpoint, tmp_path, capsys):
    """Finite weights whose logits overflow: generate refuses with NonFiniteLogitsError, an EngineError."""
    bad_dir = copy_checkpoint(tiny_checkpoint, tmp_path / "overflow")
    tensors = load_file(bad_dir / "model.safetensors")
    tensors["model.norm.weight"].fill_(3e38)
    save_file(tensors, bad_dir / "model.safetensors", metadata={"format": "pt"})
    err = _run_cli(capsys, ["generate", "--model", str(bad_dir), "--prompt", "hi", "--max-tokens", "3",
                            "--device", "cpu"])
    assert "request 0" in err and "finite" in err


# ---------------------------------------------------------------------------------------------- sleep and wake


def test_stats_survive_sleep_and_wake(qwen3):
    block = make_engine(qwen3[0]).kv.planner.total_bytes(1)
    engine = make_engine(qwen3[0], kv_cache_memory=12 * block)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    engine.generate(make_prompts(lens=(5, 6, 7, 8)), params, use_tqdm=False)  # 4 x 108 tokens, 192 in the pool
    preemptions = engine.stats()["preemptions"]
    assert preemptions > 0
    engine.sleep()
    engine.wake()
    assert engine.stats()["preemptions"] == preemptions


def test_wake_to_a_smaller_pool_keeps_max_model_len_and_ends_long_requests_by_length(qwen3, monkeypatch):
    engine = make_engine(qwen3[0], max_model_len=512)
    assert engine.max_model_len == 512
    engine.sleep()
    small = engine.kv.planner.total_bytes(8)
    monkeypatch.setattr(kv_cache_module, "available_bytes", lambda device: small)
    monkeypatch.setattr(engine_module, "available_bytes", lambda device: small, raising=False)  # older trees
    engine.wake(allow_resize=True)
    monkeypatch.undo()
    assert engine.memory_stats()["kv_blocks"] == 8  # 128 tokens
    assert engine.max_model_len == 512
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with deadline(60):
        out = engine.generate([make_prompts(lens=(10,))[0]], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 8 * 16 - 10


def test_a_max_model_len_the_pool_cannot_hold_is_warned_about(qwen3):
    """A max_model_len the caller chose that the KV pool cannot hold is cut to the pool (one sequence must fit), and
    said so: otherwise samples end with "length" sooner than asked, with nothing to say why. The model's own limit,
    not chosen, is cut without a word (a small pool for a model whose limit is long is ordinary)."""
    import warnings

    with pytest.warns(UserWarning, match="max_model_len=256 is more than the KV pool holds") as caught:
        engine = make_engine(qwen3[0], max_model_len=256, kv_cache_memory=1 << 15)
    assert engine.max_model_len < 256 and str(engine.max_model_len) in str(caught[0].message)
    out = engine.generate([[5] * 8], SamplingParams(max_tokens=4096, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and 8 + len(out.outputs[0].token_ids) == engine.max_model_len
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_engine(qwen3[0], kv_cache_memory=1 << 15).max_model_len == engine.max_model_len
        make_engine(qwen3[0], max_model_len=engine.max_model_len, kv_cache_memory=1 << 15)
