"""Engine(batch_invariant=True): a request's tokens and logprobs have the same bits alone, among 63 others of
mixed lengths and sampling parameters, after a prefix-cache hit, and with its prefill chunked (DESIGN.md,
"Logprobs"); and trainer_adapters.on_policy_logprobs, a differentiable forward of the transformers model,
reports exactly those bits for the same tokens.

CPU: float32, the torch twins. GPU (`gpu`): bfloat16, the Triton kernels, CUDA graphs on."""
import pytest
import torch
from conftest import VOCAB

from rollout_engine import Engine, SamplingParams
from trainer_adapters import on_policy_logprobs

KV = 64 << 20
PROMPT_LEN = 300       # past one attention key chunk (256), not a whole number of blocks (16)
CHUNK = 64             # the chunked-prefill engine's token budget: the prompt prefills in 5 pieces
MAX_TOKENS = 24
FAMILY_NAMES = ["qwen3", "llama3"]  # q/k norm and tied head; GQA with Llama-3 rope scaling and an untied head
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TARGETS = {"sampled": SamplingParams(temperature=1.0, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True),
           "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)}


def random_prompts(lens, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in lens]


def others(vocab, count=63):
    """`count` prompts of mixed lengths (3 to ~350 tokens) with mixed sampling parameters."""
    lens = [3 + (37 * i) % 350 for i in range(count)]
    params = [SamplingParams(temperature=[1.0, 0.7, 0.0][i % 3], top_p=[1.0, 0.9][i % 2], seed=i,
                             max_tokens=4 + i % 40, ignore_eos=True) for i in range(count)]
    return random_prompts(lens, vocab, seed=7), params


def bits(out):
    """(token ids, logprobs as float32 bit patterns) of a request's one sample."""
    c = out.outputs[0]
    return c.token_ids, torch.tensor(c.logprobs, dtype=torch.float32).view(torch.int32).tolist()


def schedules(path, prompt, params, vocab, **engine_kw) -> dict:
    """The request's (tokens, logprob bits) when run: alone, in the middle of 63 others, after a prefix-cache
    hit, and with its prefill chunked (a second engine with a small token budget)."""
    kw = dict(kv_cache_memory=KV, max_num_seqs=64, max_model_len=512) | engine_kw
    engine = Engine(path, **kw)
    runs = {"alone": bits(engine.generate([prompt], params, use_tqdm=False)[0])}
    engine.flush_cache()
    other_prompts, other_params = others(vocab)
    outs = engine.generate(other_prompts[:31] + [prompt] + other_prompts[31:],
                           other_params[:31] + [params] + other_params[31:], use_tqdm=False)
    runs["among 63 others"] = bits(outs[31])
    cached = []
    match = engine.block_manager.match_prefix

    def recording(seq, *rest):
        match(seq, *rest)
        cached.append(seq.num_computed)

    engine.block_manager.match_prefix = recording
    runs["prefix-cache hit"] = bits(engine.generate([prompt], params, use_tqdm=False)[0])
    engine.block_manager.match_prefix = match
    assert cached and cached[0] == PROMPT_LEN // 16 * 16, f"expected a prefix-cache hit, got {cached}"
    engine.sleep(level=2)
    chunked = Engine(path, **kw, max_num_batched_tokens=CHUNK, enable_prefix_caching=False)
    runs["chunked prefill"] = bits(chunked.generate([prompt], params, use_tqdm=False)[0])
    chunked.sleep(level=2)
    return runs


def assert_invariant(runs):
    alone = runs["alone"]
    for name, got in runs.items():
        assert got[0] == alone[0], f"{name}: tokens differ from the request alone"
        assert got[1] == alone[1], f"{name}: logprob bits differ from the request alone"


# ---------------------------------------------------------------- arguments


def test_batch_invariant_argument_is_checked(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    with pytest.raises(ValueError, match="batch_invariant=1 is not allowed"):
        Engine(path, device="cpu", batch_invariant=1, kv_cache_memory=KV)
    with pytest.raises(ValueError, match="quantization='fp8'"):
        Engine(path, device="cpu", batch_invariant=True, quantization="fp8", kv_cache_memory=KV)
    with pytest.raises(ValueError, match="speculative decoding"):
        Engine(path, device="cpu", batch_invariant=True, draft_model="ngram", num_speculative_tokens=2,
               kv_cache_memory=KV)
    # an e4m3 cache's Triton attention rounds by the largest value scale of the keys a tile loads, which include
    # a prefill row's later keys: its bits would move with how a prompt is chunked
    for kv_cache_dtype in ("fp8", "fp8_e4m3", "float8_e4m3fn"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype='{kv_cache_dtype}'"):
            Engine(path, device="cpu", batch_invariant=True, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=KV)
    assert Engine(path, device="cpu", batch_invariant=True, kv_cache_dtype="float16", kv_cache_memory=KV)


# ---------------------------------------------------------------- CPU


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_request_bits_do_not_depend_on_the_batch(hf_checkpoint, family, target):
    path, _ = hf_checkpoint(family)
    prompt = random_prompts([PROMPT_LEN], VOCAB, seed=3)[0]
    assert_invariant(schedules(path, prompt, TARGETS[target], VOCAB, device="cpu", dtype="float32",
                               batch_invariant=True))


def test_default_mode_is_not_batch_invariant_on_the_cpu(hf_checkpoint):
    """The check above can fail: without batch_invariant the CPU BLAS picks its path by the number of rows (a
    decode alone is a matrix-vector product), so the request's logprobs among 63 others are not its logprobs
    alone (measured: 1 to 2 of 24 equal, |d| up to 5e-6). On this CPU the prefix-cache hit and the chunked
    prefill happen to match in the default mode too."""
    path, _ = hf_checkpoint("qwen3")
    prompt = random_prompts([PROMPT_LEN], VOCAB, seed=3)[0]
    runs = schedules(path, prompt, TARGETS["sampled"], VOCAB, device="cpu", dtype="float32")
    assert runs["among 63 others"][1] != runs["alone"][1]


# ---------------------------------------------------------------- the trainer's on-policy forward

ON_POLICY_PARAMS = {"temperature 1": SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True),
                    "greedy": SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                    "temperature 0.7, top-p 0.9": SamplingParams(n=2, temperature=0.7, top_p=0.9, seed=6,
                                                                 max_tokens=20, ignore_eos=True)}


def padded_batch(outs, device):
    """(input_ids, attention_mask, completion mask, engine logprobs) [N, L], right-padded, one row per sample."""
    rows = [(o.prompt_token_ids, c) for o in outs for c in o.outputs]
    width = max(len(p) + len(c.token_ids) for p, c in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros(len(rows), width, dtype=torch.bool)
    engine_lp = torch.zeros(len(rows), width)
    for i, (prompt, c) in enumerate(rows):
        p, n = len(prompt), len(c.token_ids)
        ids[i, : p + n], attention[i, : p + n] = torch.tensor(prompt + c.token_ids), 1
        completion[i, p : p + n] = True
        engine_lp[i, p : p + n] = torch.tensor(c.logprobs)
    return ids.to(device), attention.to(device), completion.to(device), engine_lp.to(device)


def on_policy_against_engine(path, model, params, vocab, device, **engine_kw):
    """Sample completions of prompts of mixed lengths with Engine(batch_invariant=True), then score them in one
    padded batch with on_policy_logprobs; returns (theirs, the engine's, completion mask, attention mask)."""
    engine = Engine(path, device=device, batch_invariant=True, kv_cache_memory=KV, max_model_len=512, **engine_kw)
    outs = engine.generate(random_prompts([5, 40, 300, 17], vocab, seed=11), params, use_tqdm=False)
    engine.sleep(level=2)
    ids, attention, completion, engine_lp = padded_batch(outs, device)
    return on_policy_logprobs(model, ids, attention, params), engine_lp, completion, attention


@pytest.mark.parametrize("params", list(ON_POLICY_PARAMS))
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_on_policy_logprobs_equal_the_engine_bitwise(hf_checkpoint, family, params):
    path, model = hf_checkpoint(family)
    got, engine_lp, completion, attention = on_policy_against_engine(path, model, ON_POLICY_PARAMS[params], VOCAB,
                                                                     "cpu", dtype="float32")
    assert torch.equal(got[completion], engine_lp[completion])
    assert not got[:, 0].any() and not got[attention == 0].any()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_on_policy_gradients_are_transformers_gradients(hf_checkpoint, family):
    """The backward is ordinary autograd: a policy-gradient-like loss gives every weight a finite, non-zero
    gradient equal to the one transformers' own forward gives (float32: the two forwards differ by rounding,
    ~1e-6 relative, so the gradients agree to 1e-3 of their largest entry)."""
    from trainer_adapters.grpo import RolloutBatch, token_logprobs

    path, model = hf_checkpoint(family)
    params = ON_POLICY_PARAMS["temperature 1"]
    engine = Engine(path, device="cpu", dtype="float32", batch_invariant=True, kv_cache_memory=KV, max_model_len=512)
    outs = engine.generate(random_prompts([5, 40, 17], VOCAB, seed=12), params, use_tqdm=False)
    engine.sleep(level=2)
    ids, attention, completion, _ = padded_batch(outs, "cpu")
    weights = torch.linspace(-1, 1, completion.numel()).view(completion.shape) * completion

    def grads(logprobs):
        model.zero_grad()
        (logprobs * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ours = grads(on_policy_logprobs(model, ids, attention, params))
    batch = RolloutBatch(ids, attention, completion.float(), torch.zeros(completion.shape), torch.zeros(len(ids)))
    theirs = grads(token_logprobs(model, batch))
    model.zero_grad()
    for name, g in ours.items():
        assert torch.isfinite(g).all() and g.abs().max() > 0, name
        torch.testing.assert_close(g, theirs[name], atol=1e-3 * theirs[name].abs().max().item(), rtol=0, msg=name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter is on only without CUDA (conftest)")
def test_on_policy_runs_the_triton_kernels(hf_checkpoint, monkeypatch):
    """The GPU path's code (Triton kernels, here in the interpreter, float32) runs forward and backward and agrees
    with the torch twins' path within fp32 order noise (logprobs of size ~5: 1e-4 is 100x that noise)."""
    import rollout_kernels
    import trainer_adapters.on_policy as on_policy

    _, model = hf_checkpoint("qwen3")
    ids = torch.randint(0, VOCAB - 1, (3, 40), generator=torch.Generator().manual_seed(4))
    mask = (torch.arange(40)[None, :] < torch.tensor([[30], [40], [7]])).long()
    params = SamplingParams(temperature=0.8)
    twins = on_policy_logprobs(model, ids, mask, params)
    monkeypatch.setattr(on_policy, "get_ops", lambda device, batch_invariant: rollout_kernels.get_ops("cuda", batch_invariant))
    model.zero_grad()
    got = on_policy_logprobs(model, ids, mask, params)
    got.sum().backward()
    torch.testing.assert_close(got, twins, atol=1e-4, rtol=0)
    assert all(torch.isfinite(p.grad).all() and p.grad.abs().max() > 0 for p in model.parameters())
    model.zero_grad()


def test_on_policy_refuses_bad_input(hf_checkpoint):
    _, model = hf_checkpoint("qwen3")
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="right padding"):
        on_policy_logprobs(model, ids, torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="logprobs_mode"):
        on_policy_logprobs(model, ids, logprobs_mode="temperature")
    with pytest.raises(ValueError, match="input_ids"):
        on_policy_logprobs(model, ids.float())


# ---------------------------------------------------------------- GPU: bfloat16, Triton kernels, CUDA graphs

GPU_VOCAB = 32000
GPU_FAMILIES = {  # hidden 1024 (two K chunks in the matmul), head_dim 128, GQA 8:2
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
}


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory):
    """family -> (path of a bf16 checkpoint, the transformers model loaded from it in bf16 on CUDA)."""
    import transformers

    made = {}

    def get(family):
        if family not in made:
            config_cls, model_cls, extra = GPU_FAMILIES[family]
            config = getattr(transformers, config_cls)(
                vocab_size=GPU_VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=1024,
                initializer_range=0.05, eos_token_id=GPU_VOCAB - 1, bos_token_id=0, **extra)
            torch.manual_seed(0)
            path = tmp_path_factory.mktemp(f"gpu-{family}")
            getattr(transformers, model_cls)(config).to(torch.bfloat16).save_pretrained(path)
            model = getattr(transformers, model_cls).from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
            made[family] = (path, model)
        return made[family]

    return get


@gpu
@needs_cuda
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gpu_request_bits_do_not_depend_on_the_batch(gpu_checkpoint, family, target):
    path, _ = gpu_checkpoint(family)
    prompt = random_prompts([PROMPT_LEN], GPU_VOCAB, seed=3)[0]
    assert_invariant(schedules(path, prompt, TARGETS[target], GPU_VOCAB, device="cuda", batch_invariant=True,
                               kv_cache_memory=512 << 20))


@gpu
@needs_cuda
@pytest.mark.parametrize("params", list(ON_POLICY_PARAMS))
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gpu_on_policy_logprobs_equal_the_engine_bitwise(gpu_checkpoint, family, params):
    path, model = gpu_checkpoint(family)
    got, engine_lp, completion, _ = on_policy_against_engine(path, model, ON_POLICY_PARAMS[params], GPU_VOCAB,
                                                             "cuda")
    same = (got[completion] == engine_lp[completion]).double().mean().item()
    gap = (got[completion] - engine_lp[completion]).abs().max().item()
    assert same == 1.0, f"{same:.4%} of tokens bitwise equal, largest |d| {gap:.3g}"
    model.zero_grad()
    (got * completion).sum().backward()
    for name, p in model.named_parameters():
        assert torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name
    model.zero_grad()
