"""Bad inputs and misuses of the public Engine API, table-driven.

Each case makes one call that must raise the expected ValueError or EngineError subclass with a message that
names the argument, field, weight or file at fault; the call must change nothing (weight_version, sleep
state); and then the engine's greedy tokens are those of a reference computed once. Some cases put the
engine in a state first (asleep, weights discarded) and restore it after. Constructor cases build their own
engine. The weight transport's misuses are in tests/test_transport_adversarial.py.
"""
import json
import math
import shutil
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest
import torch
from helpers import make_prompts
from safetensors.torch import load_file, save_file

from rollout_engine import (
    Engine,
    EngineAsleepError,
    EngineError,
    SamplingParams,
    WeightsNotReadyError,
)
from rollout_engine.tiny_model import char_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KV_BYTES = 16 << 20
MAX_LEN = 512  # the qwen3 test checkpoint's max_position_embeddings
VOCAB = 256
NAME = "model.layers.1.mlp.down_proj.weight"
NORM = "model.norm.weight"


def greedy(engine):
    return [o.outputs[0].token_ids for o in engine.generate(make_prompts(), GREEDY, use_tqdm=False)]


def _write_variant(src, dst, edit):
    """A copy of checkpoint `src` in `dst` with `edit(dir)` applied."""
    shutil.copytree(src, dst)
    edit(dst)
    return str(dst)


def _edit_tensors(**changes):
    """An edit of model.safetensors: name -> a function of the tensors dict returning the new tensor (None drops)."""
    def edit(path):
        tensors = load_file(path / "model.safetensors")
        for name, change in changes.items():
            value = change(tensors)
            if value is None:
                tensors.pop(name)
            else:
                tensors[name] = value
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return edit


def _edit_config(**changes):
    def edit(path):
        config = json.loads((path / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                config.pop(key)
            else:
                config[key] = value
        (path / "config.json").write_text(json.dumps(config))
    return edit


def _write(name, data):
    def edit(path):
        (path / name).write_bytes(data)
    return edit


def _stale_beside(path):
    tensors = load_file(path / "model.safetensors")
    save_file({NORM: torch.zeros_like(tensors[NORM])}, path / "model-old.safetensors", metadata={"format": "pt"})


class _Subclass(torch.Tensor):
    """A torch.Tensor subclass (a DTensor, say) whose copy the engine cannot take."""


def _freed(tensor):
    """`tensor` with its storage freed and its shape kept, as FSDP leaves a parameter it gathered and freed."""
    tensor = tensor.clone()
    tensor.untyped_storage().resize_(0)
    return tensor


def _truncate(path):
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:1000])


def _with_inf(tensors):
    t = tensors[NAME].clone()
    t[0, 0] = math.inf
    return t


@pytest.fixture(scope="module")
def env(hf_checkpoint, tmp_path_factory):
    """The engine under test, its reference greedy tokens, a complete set of its weights, and broken
    checkpoints to point it at."""
    src, model = hf_checkpoint("qwen3")
    root = tmp_path_factory.mktemp("adversarial")
    ckpt = root / "ckpt"
    shutil.copytree(src, ckpt)  # the qwen3 weights (well-spread logits) with a small character tokenizer
    char_tokenizer("0123456789+= abcdefghijklmnopqrstuvwxyz").save_pretrained(ckpt)
    variants = {
        "empty": lambda p: (p / "model.safetensors").unlink(),
        "garbage": _write("model.safetensors", b"\x07 not a safetensors file " * 40),
        "truncated": _truncate,
        "inf": _edit_tensors(**{NAME: _with_inf}),
        "shape": _edit_tensors(**{NAME: lambda t: t[NAME][:, :-1].contiguous()}),
        "unknown": _edit_tensors(**{"model.layers.9.mlp.down_proj.weight": lambda t: t[NAME].clone()}),
        "int": _edit_tensors(**{NORM: lambda t: t[NORM].to(torch.int32)}),
        "stale": _stale_beside,  # a new save's file beside an old one that holds a tensor again
        "no_config": lambda p: (p / "config.json").unlink(),
        "bad_config": _write("config.json", b'{"vocab_size": 256,'),
        "list_config": _write("config.json", b"[1, 2]"),
        "no_hidden": _edit_config(hidden_size=None),
        "zero_layers": _edit_config(num_hidden_layers=0),
        "arch": _edit_config(architectures=["GPT2LMHeadModel"]),
        "rope": _edit_config(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
        "rope_keys": _edit_config(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
        "gelu": _edit_config(hidden_act="gelu"),  # the MLP would run SiLU: silently other logprobs
        "model_type": _edit_config(model_type="mistral"),  # transformers would build a Mistral from it
        "float64": _edit_config(torch_dtype="float64"),
        "tokenizer": _write("tokenizer.json", b"{not json"),
        "tokenizer_schema": _write("tokenizer.json", b'{"model": {"type": "Bogus"}, "added_tokens": []}'),
    }
    paths = {name: _write_variant(ckpt, root / name, edit) for name, edit in variants.items()}
    engine = Engine(ckpt, device="cpu", kv_cache_memory=KV_BYTES)
    pairs = [(n, t.detach().clone()) for n, t in model.state_dict().items()]
    return SimpleNamespace(engine=engine, ckpt=str(ckpt), paths=paths, pairs=pairs, reference=greedy(engine),
                           shapes=dict((n, t.shape) for n, t in pairs), model=model)


def replaced(env, name, tensor):
    """The complete weight set with `name` replaced (a bad tensor anywhere fails the one group it is in)."""
    return [(n, tensor if n == name else t) for n, t in env.pairs]


def weight(env, name):
    return dict(env.pairs)[name]


def mutated(**fields):
    """A valid SamplingParams with fields set after construction (generate() checks them again)."""
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for key, value in fields.items():
        setattr(sp, key, value)
    return sp


def build(env, path=None, **kwargs):
    """Engine(...) on the test checkpoint (or `path`) with some arguments changed."""
    model_path = env.ckpt if path is None else env.paths.get(path, path)
    return Engine(model_path, **{"device": "cpu", "kv_cache_memory": KV_BYTES, **kwargs})


def gen(prompts, params=GREEDY):
    return lambda env: env.engine.generate(prompts, params, use_tqdm=False)


def update(pairs_of_env, **kwargs):
    return lambda env: env.engine.update_weights(pairs_of_env(env), **kwargs)


def disk(path_of_env, **kwargs):
    return lambda env: env.engine.update_weights_from_disk(path_of_env(env), **kwargs)


def sleep_first(env, **kwargs):
    env.engine.sleep(**kwargs)


def wake_all(env):
    env.engine.wake()


def discard_weights(env):
    env.engine.sleep(level=2)
    env.engine.wake()


def reload(env):
    env.engine.update_weights_from_disk(env.ckpt)


def half_update(env):
    """A bucketed update whose second bucket is bad: the first was copied, so the weights are incomplete."""
    with pytest.raises(ValueError, match=NAME):
        env.engine.update_weights_from_buckets([env.pairs[:1], [(NAME, weight(env, NAME)[:, :-1])]])


@dataclass
class Case:
    call: Callable
    error: type
    match: str
    setup: Callable | None = None
    restore: Callable | None = None


def case(id_, call, error, match, setup=None, restore=None, marks=()):
    return pytest.param(Case(call, error, match, setup, restore), id=id_, marks=marks)


def sp_case(field, value, match=None):
    return case(f"SamplingParams-{field}={value!r}", lambda env: SamplingParams(**{field: value}), ValueError,
                match or rf"\b{field}=")


LONG = list(range(1, 200)) * 3

CASES = [
    # ------------------------------------------------------------------ generate: prompts
    case("prompts-empty-list", gen([]), ValueError, "prompts must be"),
    case("prompts-None", gen(None), ValueError, "prompts must be"),
    case("prompts-int", gen(7), ValueError, "prompts must be"),
    case("prompts-bytes", gen(b"12+3"), ValueError, "prompts must be"),
    case("prompts-generator", gen(([1, 2] for _ in range(2))), ValueError, "prompts must be"),
    case("prompts-set", gen({1, 2, 3}), ValueError, "prompts must be"),
    case("prompt-empty-ids", gen([[]]), ValueError, "empty"),
    case("prompt-empty-text", gen(""), ValueError, "empty"),
    case("prompt-id-equals-vocab", gen([[1, VOCAB]]), ValueError, rf"\[{VOCAB}\].*\[0, {VOCAB}\)"),
    case("prompt-id-negative", gen([[-1, 2]]), ValueError, r"\[-1\]"),
    case("prompt-id-float", gen([[1.5, 2]]), ValueError, "token ids"),
    case("prompt-id-bool", gen([[True, 2]]), ValueError, "token ids"),
    case("prompt-id-str", gen([[1, "a"]]), ValueError, "token ids"),
    case("prompt-id-nested", gen([[1, [2]]]), ValueError, "token ids"),
    case("prompt-None-among-prompts", gen([[1, 2], None]), ValueError, "NoneType"),
    case("prompt-too-long", gen([LONG]), ValueError, f"prompt has {len(LONG)} tokens"),
    case("prompt-one-past-max_model_len", gen([[3] * (MAX_LEN + 1)]), ValueError, f"prompt has {MAX_LEN + 1} tokens"),
    # the length first, before any per-id work (a server body of 30M ids took 21 s to refuse, holding others)
    case("prompt-too-long-and-bad", gen([LONG + ["x"]]), ValueError, f"prompt has {len(LONG) + 1} tokens"),
    case("prompt-dict-wrong-key", gen({"prompt": [1, 2]}), ValueError, "prompt_token_ids"),
    case("prompt-dict-extra-key", gen({"prompt_token_ids": [1], "x": 1}), ValueError, "prompt_token_ids"),
    case("prompt-dict-str-ids", gen({"prompt_token_ids": "123"}), ValueError, "type str"),
    case("prompt-dict-empty-ids", gen({"prompt_token_ids": []}), ValueError, "empty"),
    case("prompt-array-2d", gen([np.zeros((2, 3), dtype=np.int64)]), ValueError, "1-D"),
    case("prompt-array-float", gen(np.array([1.0, 2.0])), ValueError, "integer token ids"),
    case("prompt-tensor-float", gen(torch.tensor([1.0, 2.0])), ValueError, "integer token ids"),
    case("prompt-tensor-bool", gen(torch.tensor([True, False])), ValueError, "token ids"),
    case("prompt-array-out-of-vocab", gen(np.array([1, 999])), ValueError, "999"),
    # ------------------------------------------------------------------ generate: sampling params
    case("params-list-wrong-length", gen([[1], [2]], [GREEDY]), ValueError, "sampling_params"),
    case("params-dict", gen([[1]], {"temperature": 0}), ValueError, "sampling_params"),
    case("params-list-with-None", gen([[1], [2]], [GREEDY, None]), ValueError, "sampling_params"),
    case("params-mutated-n", gen([[1]], mutated(n=0)), ValueError, r"\bn="),
    case("params-mutated-max_tokens", gen([[1]], mutated(max_tokens=0)), ValueError, "max_tokens"),
    case("params-mutated-temperature-nan", gen([[1]], mutated(temperature=math.nan)), ValueError, "temperature"),
    case("params-mutated-top_p", gen([[1]], mutated(top_p=0.0)), ValueError, "top_p"),
    case("params-mutated-stop-empty", gen([[1]], mutated(stop=[""])), ValueError, "stop"),
    case("params-mutated-stop_token_ids", gen([[1]], mutated(stop_token_ids=[-1])), ValueError, "stop_token_ids"),
    case("params-stop_token_ids-out-of-vocab", gen([[1]], SamplingParams(max_tokens=2, stop_token_ids=[3, 10 ** 30])),
         ValueError, r"stop_token_ids \[1000000000000000000000000000000\]"),
    case("params-mutated-second-of-list", gen([[1], [2]], [GREEDY, mutated(top_k=-3)]), ValueError, "top_k"),
    # ------------------------------------------------------------------ SamplingParams fields
    sp_case("n", 0), sp_case("n", 1.5), sp_case("n", True),
    sp_case("temperature", -0.1), sp_case("temperature", math.nan), sp_case("temperature", math.inf),
    sp_case("temperature", "1"),
    sp_case("top_p", 0.0), sp_case("top_p", 1.01), sp_case("top_p", math.nan), sp_case("top_p", -math.inf),
    sp_case("top_k", -2), sp_case("top_k", 2.0), sp_case("top_k", 2 ** 31),
    # values float32 cannot sample with (logits / 1e-45 are inf; top_p 1e-46 is 0 in float32: nothing kept)
    sp_case("temperature", 1e-45), sp_case("temperature", 1e-6), sp_case("top_p", 1e-46),
    sp_case("min_p", -0.1), sp_case("min_p", 1.5), sp_case("min_p", math.nan),
    sp_case("max_tokens", 0), sp_case("max_tokens", None), sp_case("max_tokens", 2.5),
    sp_case("seed", -1), sp_case("seed", 1.5),
    sp_case("logprobs_mode", "logits"), sp_case("ignore_eos", "yes"), sp_case("logprobs", "all"),
    sp_case("stop", 5), sp_case("stop", [""]), sp_case("stop", ["a", 3]), sp_case("stop", {"a"}),
    sp_case("stop", ["ok", "x\ud800"], match=r"stop\[1\] is not valid Unicode"),
    case("SamplingParams-stop-count", lambda env: SamplingParams(stop=[f"s{i}" for i in range(65)]), ValueError,
         "at most 64 strings"),
    case("SamplingParams-stop-length", lambda env: SamplingParams(stop=["x" * 1025]), ValueError, "at most 64 strings"),
    sp_case("stop_token_ids", 3), sp_case("stop_token_ids", [-1]), sp_case("stop_token_ids", [1.0]),
    # ------------------------------------------------------------------ update_weights
    case("update-unknown-name", update(lambda e: e.pairs + [("model.layers.7.mlp.up_proj.weight",
                                                              weight(e, NAME))]),
         ValueError, "unknown weight name 'model.layers.7.mlp.up_proj.weight'"),
    case("update-misspelt-name-suggests", update(lambda e: [("model.layers.1.mlp.down_prj.weight", weight(e, NAME))]),
         ValueError, f"down_prj.*nearest.*{NAME}"),
    case("update-wrong-shape", update(lambda e: replaced(e, NAME, weight(e, NAME)[:, :-1])), ValueError,
         f"{NAME}.*shape"),
    case("update-transposed", update(lambda e: replaced(e, "model.embed_tokens.weight",
                                                        weight(e, "model.embed_tokens.weight").t())),
         ValueError, "embed_tokens.*shape"),
    case("update-scalar", update(lambda e: replaced(e, NORM, torch.tensor(1.0))), ValueError, f"{NORM}.*shape"),
    case("update-int-dtype", update(lambda e: replaced(e, NORM, weight(e, NORM).to(torch.int32))), ValueError,
         f"{NORM}.*floating-point"),
    case("update-bool-dtype", update(lambda e: replaced(e, NORM, weight(e, NORM) > 0)), ValueError,
         f"{NORM}.*floating-point"),
    case("update-complex-dtype", update(lambda e: replaced(e, NORM, weight(e, NORM).to(torch.complex64))),
         ValueError, f"{NORM}.*floating-point"),
    case("update-float8-e4m3", update(lambda e: replaced(e, NORM, weight(e, NORM).to(torch.float8_e4m3fn))),
         ValueError, f"{NORM}.*floating-point tensor of .*float8_e4m3fn"),
    case("update-float8-e5m2", update(lambda e: replaced(e, NORM, weight(e, NORM).to(torch.float8_e5m2))),
         ValueError, f"{NORM}.*floating-point tensor of .*float8_e5m2"),
    case("update-sparse", update(lambda e: replaced(e, NORM, weight(e, NORM).to_sparse())), ValueError,
         f"{NORM}.*sparse_coo.*dense"),
    case("update-tensor-subclass", update(lambda e: replaced(e, NORM, weight(e, NORM).clone().as_subclass(_Subclass))),
         ValueError, f"{NORM}.*_Subclass.*subclass"),
    case("update-freed-storage", update(lambda e: replaced(e, NORM, _freed(weight(e, NORM)))), ValueError,
         f"{NORM}.*0 bytes of storage.*freed"),
    case("update-list-value", update(lambda e: replaced(e, NORM, weight(e, NORM).tolist())), ValueError,
         f"{NORM}.*got list"),
    case("update-numpy-value", update(lambda e: replaced(e, NORM, weight(e, NORM).numpy())), ValueError,
         f"{NORM}.*ndarray"),
    case("update-nan", update(lambda e: replaced(e, NAME, weight(e, NAME).index_fill(0, torch.tensor([2]), math.nan))),
         ValueError, f"{NAME}.*NaN"),
    case("update-inf-last", update(lambda e: [p for p in e.pairs if p[0] != NORM]
                                   + [(NORM, torch.full_like(weight(e, NORM), -math.inf))]),
         ValueError, f"{NORM}.*inf"),
    case("update-meta", update(lambda e: replaced(e, NAME, torch.empty(e.shapes[NAME], device="meta"))), ValueError,
         f"{NAME}.*meta"),
    case("update-bare-tensor", update(lambda e: weight(e, NAME)), ValueError, "named_tensors"),
    case("update-list-of-tensors", update(lambda e: [t for _, t in e.pairs]), ValueError, "pairs"),
    case("update-int-name", update(lambda e: [(1, weight(e, NAME))]), ValueError, "pairs"),
    case("update-triple", update(lambda e: [(NAME, weight(e, NAME), 0)]), ValueError, "pairs"),
    case("update-str", update(lambda e: NAME), ValueError, "named_tensors"),
    case("update-None", update(lambda e: None), ValueError, "named_tensors"),
    case("update-version-equal", lambda env: env.engine.update_weights(env.pairs, version=env.engine.weight_version),
         ValueError, "version"),
    case("update-version-lower", lambda env: env.engine.update_weights(env.pairs, version=-1), ValueError,
         "version"),
    case("update-version-str", update(lambda e: e.pairs, version="7"), ValueError, "version"),
    case("update-version-bool", update(lambda e: e.pairs, version=True), ValueError, "version"),
    case("update-version-float", update(lambda e: e.pairs, version=1e9), ValueError, "version"),
    case("update-version-past-int64", update(lambda e: e.pairs, version=2 ** 63), ValueError, "version"),
    case("update-model-draft", update(lambda e: e.pairs, model="draft"), ValueError, "model='draft'"),
    case("update-model-unknown", update(lambda e: e.pairs, model="critic"), ValueError, "model='critic'"),
    case("update-while-asleep", update(lambda e: e.pairs), EngineAsleepError, "wake", sleep_first, wake_all),
    case("update-buckets-bare-tensor", lambda env: env.engine.update_weights_from_buckets([[weight(env, NAME)]]),
         ValueError, "pairs"),
    # ------------------------------------------------------------------ update_weights_from_disk
    case("disk-missing-dir", disk(lambda e: e.ckpt + "-missing"), ValueError, r"-missing.*safetensors"),
    case("disk-no-safetensors", disk(lambda e: e.paths["empty"]), ValueError, "has no"),
    case("disk-file-not-dir", disk(lambda e: e.ckpt + "/model.safetensors"), ValueError, "has no"),
    case("disk-None", disk(lambda e: None), ValueError, "path"),
    case("disk-int", disk(lambda e: 3), ValueError, "path"),
    case("disk-garbage-file", disk(lambda e: e.paths["garbage"]), ValueError, r"garbage/model\.safetensors"),
    case("disk-truncated-file", disk(lambda e: e.paths["truncated"]), ValueError, r"truncated/model\.safetensors"),
    case("disk-inf", disk(lambda e: e.paths["inf"]), ValueError, f"{NAME}.*inf"),
    case("disk-wrong-shape", disk(lambda e: e.paths["shape"]), ValueError, f"{NAME}.*shape"),
    case("disk-unknown-name", disk(lambda e: e.paths["unknown"]), ValueError, "model.layers.9"),
    case("disk-int-tensor", disk(lambda e: e.paths["int"]), ValueError, f"{NORM}.*floating-point"),
    case("disk-tensor-in-two-files", disk(lambda e: e.paths["stale"]), ValueError,
         f"{NORM}.*two weight files.*model-old.safetensors"),
    case("disk-version-lower", disk(lambda e: e.ckpt, version=-5), ValueError, "version"),
    case("disk-model-unknown", disk(lambda e: e.ckpt, model="critic"), ValueError, "model='critic'"),
    case("disk-while-asleep", disk(lambda e: e.ckpt), EngineAsleepError, "wake", sleep_first, wake_all),
    # ------------------------------------------------------------------ sleep, wake, order
    case("sleep-level-0", lambda env: env.engine.sleep(level=0), ValueError, "level"),
    case("sleep-level-3", lambda env: env.engine.sleep(level=3), ValueError, "level"),
    case("sleep-level-True", lambda env: env.engine.sleep(level=True), ValueError, "level"),
    case("sleep-level-str", lambda env: env.engine.sleep(level="1"), ValueError, "level"),
    case("sleep-level-None", lambda env: env.engine.sleep(level=None), ValueError, "level"),
    case("sleep-tags-unknown", lambda env: env.engine.sleep(tags=["optimizer"]), ValueError, "tags"),
    case("sleep-tags-empty", lambda env: env.engine.sleep(tags=[]), ValueError, "tags"),
    case("sleep-tags-int", lambda env: env.engine.sleep(tags=5), ValueError, "tags"),
    case("sleep-tags-bytes", lambda env: env.engine.sleep(tags=b"kv_cache"), ValueError, "tags"),
    case("sleep-tags-one-unknown", lambda env: env.engine.sleep(tags=["weights", "optimizer"]), ValueError, "tags"),
    case("wake-tags-unknown", lambda env: env.engine.wake(tags=["optimizer"]), ValueError, "tags", sleep_first,
         wake_all),
    case("wake-tags-empty", lambda env: env.engine.wake(tags=[]), ValueError, "tags", sleep_first, wake_all),
    case("wake-tags-None-element", lambda env: env.engine.wake(tags=[None]), ValueError, "tags", sleep_first,
         wake_all),
    case("wake-allow_resize-str", lambda env: env.engine.wake(allow_resize="yes"), ValueError, "allow_resize",
         sleep_first, wake_all),
    case("wake-allow_resize-int", lambda env: env.engine.wake(allow_resize=1), ValueError, "allow_resize",
         sleep_first, wake_all),
    case("generate-asleep", gen(make_prompts()), EngineAsleepError, "wake", sleep_first, wake_all),
    case("generate-kv-asleep", gen(make_prompts()), EngineAsleepError, "kv_cache",
         lambda env: env.engine.sleep(tags=["kv_cache"]), wake_all),
    case("generate-weights-asleep", gen(make_prompts()), EngineAsleepError, "weights",
         lambda env: env.engine.sleep(tags="weights"), wake_all),
    case("generate-after-level-2", gen(make_prompts()), WeightsNotReadyError, "update_weights", discard_weights,
         reload),
    case("generate-after-level-2-partial-update", gen(make_prompts()), WeightsNotReadyError, "update_weights",
         lambda env: (discard_weights(env), env.engine.update_weights(env.pairs[:3])), reload),
    case("generate-after-half-update", gen(make_prompts()), WeightsNotReadyError, "partly updated", half_update,
         reload),
    # ------------------------------------------------------------------ Engine(...)
    case("engine-missing-dir", lambda env: build(env, env.ckpt + "-missing"), ValueError, "config.json"),
    case("engine-path-None", lambda env: Engine(None, device="cpu"), ValueError, "model_path"),
    case("engine-path-int", lambda env: Engine(3, device="cpu"), ValueError, "model_path"),
    case("engine-no-config", lambda env: build(env, "no_config"), ValueError, "config.json"),
    case("engine-no-weights", lambda env: build(env, "empty"), ValueError, "safetensors"),
    case("engine-tensor-in-two-files", lambda env: build(env, "stale"), ValueError, f"{NORM}.*two weight files"),
    case("engine-malformed-config", lambda env: build(env, "bad_config"), ValueError, "config.json"),
    case("engine-config-not-object", lambda env: build(env, "list_config"), ValueError, "config.json.*object"),
    case("engine-config-no-hidden_size", lambda env: build(env, "no_hidden"), ValueError, "hidden_size"),
    case("engine-config-zero-layers", lambda env: build(env, "zero_layers"), ValueError, "num_hidden_layers"),
    case("engine-config-architecture", lambda env: build(env, "arch"), ValueError, "GPT2LMHeadModel"),
    case("engine-config-rope", lambda env: build(env, "rope"), ValueError, "yarn"),
    case("engine-config-rope-keys", lambda env: build(env, "rope_keys"), ValueError, "low_freq_factor"),
    case("engine-config-hidden_act", lambda env: build(env, "gelu"), ValueError, "hidden_act='gelu'"),
    case("engine-config-model_type", lambda env: build(env, "model_type"), ValueError, "model_type='mistral'"),
    case("engine-config-float64", lambda env: build(env, "float64"), ValueError, "torch_dtype"),
    case("engine-garbage-weights", lambda env: build(env, "garbage"), ValueError, r"garbage/model\.safetensors"),
    case("engine-truncated-weights", lambda env: build(env, "truncated"), ValueError,
         r"truncated/model\.safetensors"),
    case("engine-inf-weights", lambda env: build(env, "inf"), ValueError, NAME),
    case("engine-missing-weight", lambda env: build(env, "shape"), ValueError, f"{NAME}.*shape"),
    case("engine-tokenizer-syntax", lambda env: build(env, "tokenizer"), ValueError, "tokenizer.json"),
    case("engine-tokenizer-schema", lambda env: build(env, "tokenizer_schema"), ValueError, "tokenizer.json"),
    case("engine-dtype-float99", lambda env: build(env, dtype="float99"), ValueError, "dtype"),
    case("engine-dtype-int8", lambda env: build(env, dtype=torch.int8), ValueError, "dtype"),
    case("engine-device-tpu", lambda env: build(env, device="tpu"), ValueError, "device"),
    case("engine-device-garbage", lambda env: build(env, device="cuda:x"), ValueError, "device"),
    case("engine-device-int", lambda env: build(env, device=5), ValueError, "device"),
    case("engine-device-cuda", lambda env: build(env, device="cuda"), ValueError, "device",
         marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    case("engine-kv-zero", lambda env: build(env, kv_cache_memory=0), ValueError, "kv_cache_memory"),
    case("engine-kv-negative", lambda env: build(env, kv_cache_memory=-1), ValueError, "kv_cache_memory"),
    case("engine-kv-fraction-above-1", lambda env: build(env, kv_cache_memory=1.5), ValueError, "kv_cache_memory"),
    case("engine-kv-nan", lambda env: build(env, kv_cache_memory=math.nan), ValueError, "kv_cache_memory"),
    case("engine-kv-str", lambda env: build(env, kv_cache_memory="lots"), ValueError, "kv_cache_memory"),
    case("engine-kv-bool", lambda env: build(env, kv_cache_memory=True), ValueError, "kv_cache_memory"),
    case("engine-kv-below-one-block", lambda env: build(env, kv_cache_memory=10), ValueError, "KV budget"),
    case("engine-max_num_seqs-0", lambda env: build(env, max_num_seqs=0), ValueError, "max_num_seqs"),
    case("engine-max_num_seqs-float", lambda env: build(env, max_num_seqs=4.0), ValueError, "max_num_seqs"),
    case("engine-max_model_len-0", lambda env: build(env, max_model_len=0), ValueError, "max_model_len"),
    case("engine-max_model_len-negative", lambda env: build(env, max_model_len=-8), ValueError, "max_model_len"),
    case("engine-max_model_len-too-long", lambda env: build(env, max_model_len=MAX_LEN + 1), ValueError,
         "max_model_len"),
    case("engine-block_size-0", lambda env: build(env, block_size=0), ValueError, "block_size"),
    case("engine-max_num_batched_tokens-0", lambda env: build(env, max_num_batched_tokens=0), ValueError,
         "max_num_batched_tokens"),
    case("engine-seed-str", lambda env: build(env, seed="x"), ValueError, "seed"),
    # past an int64 the dummy weights' manual_seed overflowed without naming seed, and -1 loaded as 2**64 - 1
    case("engine-seed-negative", lambda env: build(env, seed=-1), ValueError, r"seed=-1 is not allowed"),
    case("engine-seed-huge", lambda env: build(env, seed=2 ** 70), ValueError, r"seed=\d+ is not allowed"),
    # the step buffers were sized by them: a huge value failed to allocate (or overflowed) without naming it
    case("engine-max_num_seqs-huge", lambda env: build(env, max_num_seqs=10 ** 9), ValueError,
         r"max_num_seqs=1000000000 is not allowed; an int in \[1, 65536\]"),
    case("engine-max_num_seqs-int64", lambda env: build(env, max_num_seqs=2 ** 63), ValueError, "max_num_seqs"),
    case("engine-max_num_batched_tokens-huge", lambda env: build(env, max_num_batched_tokens=10 ** 12), ValueError,
         r"max_num_batched_tokens=1000000000000 is not allowed; an int in \[1, 4194304\]"),
    case("engine-tensor_parallel_size-0", lambda env: build(env, tensor_parallel_size=0), ValueError,
         "tensor_parallel_size"),
    case("engine-tensor_parallel_size-bool", lambda env: build(env, tensor_parallel_size=True), ValueError,
         "tensor_parallel_size"),
    case("engine-load_format", lambda env: build(env, load_format="pt"), ValueError, "load_format"),
    case("engine-speculative-without-draft", lambda env: build(env, num_speculative_tokens=3), ValueError,
         "num_speculative_tokens"),
    case("engine-ngram-without-k", lambda env: build(env, draft_model="[ngram]"), ValueError,
         "num_speculative_tokens"),
    case("engine-draft-int", lambda env: build(env, draft_model=123, num_speculative_tokens=2), ValueError,
         "draft_model"),
    case("engine-draft-missing", lambda env: build(env, draft_model=env.ckpt + "-missing",
                                                   num_speculative_tokens=2), ValueError, "config.json"),
    case("engine-kv_cache_dtype", lambda env: build(env, kv_cache_dtype="float99"), ValueError, "kv_cache_dtype"),
]


def test_the_table_is_large():
    assert len(CASES) >= 60


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_and_the_engine_still_serves(env, case):
    engine = env.engine
    assert issubclass(case.error, (ValueError, EngineError))
    if case.setup is not None:
        case.setup(env)
    version, asleep = engine.weight_version, engine.memory_stats()["asleep"]
    with pytest.raises(case.error, match=case.match):
        case.call(env)
    assert engine.weight_version == version  # a refused call changes nothing
    assert engine.memory_stats()["asleep"] == asleep
    if case.restore is not None:
        case.restore(env)
    assert not engine.is_sleeping
    assert greedy(engine) == env.reference


def test_tolerated_misuses_change_nothing(env):
    """Repeated or idle lifecycle calls are no-ops, not errors: sleep twice, flush and read stats while
    asleep, wake twice."""
    engine = env.engine
    engine.sleep()
    engine.sleep(level=1)  # already asleep: nothing more is released, the host copy stays (level 2 drops it)
    engine.flush_cache()
    assert engine.memory_stats()["asleep"] == ["kv_cache", "weights"]
    assert engine.stats()["preemptions"] >= 0
    engine.wake()
    engine.wake()
    engine.flush_cache()
    assert not engine.is_sleeping
    assert greedy(engine) == env.reference


def test_a_weights_file_that_is_a_fifo_is_refused_not_waited_on(env, tmp_path):
    """update_weights_from_disk over a directory whose model.safetensors is a named pipe: opening it would block
    the engine until someone writes to it (over HTTP: an admin call hanging the server while /health says ok).
    The file list refuses it before anything opens it (checked first, so a regression fails here instead of
    hanging), and the engine serves on."""
    import os

    from rollout_engine.checkpoint_files import safetensors_files

    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="not regular files"):
        safetensors_files(tmp_path)
    with pytest.raises(ValueError, match="not regular files"):
        env.engine.update_weights_from_disk(tmp_path)
    assert greedy(env.engine) == env.reference


def test_a_text_prompt_too_long_to_fit_is_refused_before_tokenizing(env, monkeypatch):
    """A text longer than the limit's tokens can hold whatever the tokenization (the longest piece per token, with
    slack for normalizers) is refused without tokenizing it: counting the tokens of tens of megabytes took the
    server's front minutes and gigabytes. A long text within the bound is still tokenized and checked."""
    from rollout_engine.inputs import NORMALIZER_SLACK, longest_piece

    tok = env.engine.tokenizer
    limit = env.engine.scheduler.max_seq_len
    bound = NORMALIZER_SLACK * limit * longest_piece(tok)
    tokenized = []
    call = type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__",
                        lambda self, text, **kw: tokenized.append(len(text)) or call(self, text, **kw))
    with pytest.raises(ValueError, match=f"prompt has {bound + 1} characters"):
        env.engine.generate("1" * (bound + 1), GREEDY, use_tqdm=False)
    assert tokenized == []
    with pytest.raises(ValueError, match="tokens; sequences hold at most"):
        env.engine.generate("1" * bound, GREEDY, use_tqdm=False)
    assert tokenized == [bound]
    assert greedy(env.engine) == env.reference


def test_the_automatic_version_stops_below_int64(env):
    """update_weights(version=None) adds one to weight_version; from 2**63 - 1 there is no next int64 version,
    so it is refused before any copy (the server packs versions as int64: 2**63 killed its engine process) and
    the weights keep serving under their version."""
    engine = build(env)
    last = 2 ** 63 - 1
    assert engine.update_weights(env.pairs, version=last) == last
    with pytest.raises(ValueError, match="version=None is not allowed.*2\\*\\*63"):
        engine.update_weights(env.pairs)
    assert engine.weight_version == last
    out = engine.generate(make_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == env.reference
    assert {v for o in out for v in o.outputs[0].weight_versions} == {last}
