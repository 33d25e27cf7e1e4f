"""Logprob fidelity: the engine's sampled-token logprobs against the trainer's (transformers) on the same tokens.

A transformers model is built from a public shape config (benchmarks/common.py SHAPES) with random
weights made peaked (linears N(0, 0.02), embeddings N(0, 0.3), an untied lm_head N(0, 4/sqrt(hidden)) so
its logits have std ~4, norms 1), saved as a bf16 safetensors checkpoint, and loaded by `Engine(path)`
(real weights, the checkpoint's dtype). The engine samples (temperature 1, ignore_eos, logprobs on);
then the same prompt + sampled tokens are scored by the trainer side, every reference model loaded
fresh from the checkpoint in its own dtype (never `model.to(dtype)`, which would also cast the rotary
inv_freq buffer; the script checks that inv_freq stays float32):

  trainer bf16 forward        from_pretrained(path, dtype=bfloat16), one full forward, log_softmax in fp32
  trainer fp32 forward        from_pretrained(path, dtype=float32), same
  incremental bf16            the bf16 model fed the prompt, then the sampled tokens one at a time through
                              its KV cache (past_key_values), as transformers' generate computes them

For each pair (A, B), over every sampled token, d = logp_B - logp_A:
  mean / p99 / max |d|; k3 = mean(exp(d) - 1 - d), which for A = the engine (the tokens are the engine's
  samples) is an unbiased estimate of KL(engine || B); for the other pairs it is the same formula on the
  same tokens (a divergence indicator, not an unbiased KL); bitwise = fraction of tokens with
  logp_A == logp_B exactly (as float32); mean |d| over the first 64 sampled tokens and over the rest.

`--quantization fp8` also samples the same prompts (same seed) on Engine(quantization="fp8") and adds, per format:

  engine fp8 vs trainer bf16 fwd    the fp8 engine's sampled-token logprobs against the bf16 trainer forward on
                                    its tokens; k3 is an unbiased KL(engine fp8 || trainer bf16)
  engine fp8 vs engine bf16         against the bf16 engine's prompt_logprobs of the same sequences (one prefill,
                                    max_tokens=1); k3 is an unbiased KL(engine fp8 || engine bf16)
  engine bf16 vs own prefill        the control: the bf16 engine's own samples scored the same way, the floor of the
                                    row above (decode and prefill compute the same logprob by different kernels)

The last row samples again with Engine(batch_invariant=True) and scores those tokens with
trainer_adapters.on_policy_logprobs (a transformers model loaded in the engine's dtype): bitwise should be 1.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import result_name, QUANTIZATIONS, QUICK_SHAPES, SHAPES, format_label, machine, plot_bars, print_table, save  # noqa: E402

from rollout_engine import Engine, SamplingParams  # noqa: E402

FIRST = 64  # position bucket: the first FIRST sampled tokens vs the rest
PAIRS = [  # (row label, A, B)
    ("engine vs trainer bf16 fwd", "engine", "bf16_forward"),
    ("engine vs trainer fp32 fwd", "engine", "fp32_forward"),
    ("trainer bf16 fwd vs fp32 fwd", "bf16_forward", "fp32_forward"),
    ("incremental bf16 vs bf16 fwd", "bf16_incremental", "bf16_forward"),
    ("incremental bf16 vs fp32 fwd", "bf16_incremental", "fp32_forward"),
]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ checkpoints


def random_checkpoint(name: str, root: Path, device: torch.device, embed_std: float, head_std: float | None,
                      seed: int) -> Path:
    """A bf16 safetensors checkpoint of shape `name` with peaked random weights (see the module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    shape = dict(SHAPES.get(name) or QUICK_SHAPES[name])
    shape.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(shape | {"dtype": "bfloat16"}))
    config = AutoConfig.from_pretrained(path)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    head_std = head_std if head_std is not None else 4.0 / math.sqrt(config.hidden_size)
    g = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():  # a tied head is the embedding: named once
            if "norm" in pname:
                p.fill_(1.0)
            elif pname.endswith("bias"):
                p.zero_()
            else:
                std = embed_std if "embed_tokens" in pname else head_std if "lm_head" in pname else 0.02
                for row in range(0, p.shape[0], 16384):  # bounded float32 scratch for the big tables
                    part = p[row : row + 16384]
                    part.copy_(torch.empty(part.shape, device=device).normal_(0.0, std, generator=g))
    model.save_pretrained(path)  # safetensors; non-persistent buffers (rotary inv_freq) are not saved
    del model
    free(device)
    check_checkpoint_dtype(path, torch.bfloat16)
    return path


def check_checkpoint_dtype(path: Path, dtype: torch.dtype) -> None:
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                t = f.get_slice(key).get_dtype()
                if t not in ("BF16", "bfloat16") and dtype == torch.bfloat16:
                    raise AssertionError(f"{file.name}:{key} is {t}, expected bf16")


def demo_checkpoint(root: Path, device: torch.device, steps: int, seed: int) -> tuple[Path, list[list[int]]]:
    """The tiny demo policy (addition mod 10, trainer_adapters.demo), trained `steps` GRPO steps with the
    engine in the loop, saved as bf16. Returns its path and the task prompts as token ids."""
    import random

    from transformers import AutoModelForCausalLM

    from rollout_engine.tiny_model import make_tiny_model
    from trainer_adapters.demo import ALPHABET, task_prompts
    from trainer_adapters.grpo import hybrid_step

    torch.manual_seed(seed)
    rng = random.Random(seed)
    start = make_tiny_model(root / "demo_init", hidden_size=128, num_layers=2, intermediate_size=512,
                            max_position_embeddings=64, alphabet=ALPHABET, seed=seed)
    tasks = task_prompts()
    n = 8
    if steps:
        engine = Engine(start, device=device, dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=100 * n,
                        seed=seed)
        model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32).to(device).eval()
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
        params = SamplingParams(n=n, temperature=1.0, max_tokens=1)
        reward = 0.0
        for _ in range(steps):
            batch = rng.sample(tasks, 100)
            result = hybrid_step(engine, model, optimizer, [p for p, _ in batch],
                                 lambda i, c, batch=batch: float(c.text == batch[i][1]), params,
                                 engine.tokenizer.pad_token_id)
            reward = result["reward"]
        print(f"demo policy: {steps} GRPO steps, last mean reward {reward:.2f}")
        tokenizer = engine.tokenizer
        engine.sleep(level=2)
        del engine
        state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
        config = model.config
        del model
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(start)
        model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
        state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
        config = model.config
        del model
    # Save the trained weights as bf16: a fresh bf16 model (inv_freq built float32) takes the cast tensors.
    path = root / "demo"
    config.dtype = torch.bfloat16
    with torch.device("cpu"):
        target = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    target.load_state_dict(state, strict=False)
    target.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del target, state
    free(device)
    check_checkpoint_dtype(path, torch.bfloat16)
    return path, [tokenizer(p)["input_ids"] for p, _ in tasks]


# ------------------------------------------------------------------ scoring


def load_reference(path: Path, dtype: torch.dtype, device: torch.device):
    """A fresh transformers model from the checkpoint in `dtype` (never cast after loading)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=str(device))
    except (ImportError, ValueError):  # device_map needs accelerate
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)  # .to(device) keeps dtypes
    model.eval()
    bad = [n for n, b in model.named_buffers() if n.endswith("inv_freq") and b.dtype != torch.float32]
    assert not bad, f"rotary buffers {bad[:3]} are not float32"
    assert next(model.parameters()).dtype == dtype
    return model


@torch.no_grad()
def forward_logprobs(model, seqs: list[list[int]], prompt_lens: list[int], batch: int, device) -> list[torch.Tensor]:
    """log p(token | prefix) of every sampled token, by one full forward per sequence (batches of equal length)."""
    out: list[torch.Tensor | None] = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]), prompt_lens[i]))
    groups: dict[tuple[int, int], list[int]] = {}
    for i in order:
        groups.setdefault((len(seqs[i]), prompt_lens[i]), []).append(i)
    for (length, plen), idx in groups.items():
        keep = length - plen + 1  # logits from the prompt's last position on
        for s in range(0, len(idx), batch):
            part = idx[s : s + batch]
            ids = torch.tensor([seqs[i] for i in part], device=device)
            logits = model(input_ids=ids, logits_to_keep=keep).logits[:, :-1]
            lp = logits.float().log_softmax(-1).gather(-1, ids[:, plen:, None])[..., 0].cpu()
            for j, i in enumerate(part):
                out[i] = lp[j]
    return out


@torch.no_grad()
def incremental_logprobs(model, seqs: list[list[int]], prompt_lens: list[int], batch: int,
                         device) -> list[torch.Tensor]:
    """The same logprobs computed the way generation does: prompt forward, then one token at a time through
    the model's KV cache (past_key_values)."""
    import inspect

    # transformers 5.x renamed past_key_values to cache (argument and output); older versions have the former
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out: list[torch.Tensor | None] = [None] * len(seqs)
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(len(seqs)):
        groups.setdefault((len(seqs[i]), prompt_lens[i]), []).append(i)
    for (length, plen), idx in groups.items():
        for s in range(0, len(idx), batch):
            part = idx[s : s + batch]
            ids = torch.tensor([seqs[i] for i in part], device=device)
            step = model(input_ids=ids[:, :plen], use_cache=True, logits_to_keep=1)
            past, cols = getattr(step, cache_kw), []
            for t in range(plen, length):
                cols.append(step.logits[:, -1].float().log_softmax(-1).gather(-1, ids[:, t, None])[:, 0])
                if t + 1 < length:
                    step = model(input_ids=ids[:, t : t + 1], use_cache=True, **{cache_kw: past})
                    past = getattr(step, cache_kw)
            lp = torch.stack(cols, 1).cpu()
            for j, i in enumerate(part):
                out[i] = lp[j]
            del past, step
    return out


def compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    """Statistics of d = logp_B - logp_A over every sampled token (see the module docstring)."""
    la, lb = torch.cat(a).double(), torch.cat(b).double()
    d = lb - la
    ad = d.abs()
    first = torch.cat([torch.arange(len(x)) < FIRST for x in a])
    return {"tokens": len(d), "mean_abs": ad.mean().item(), "p99_abs": ad.quantile(0.99).item(),
            "max_abs": ad.max().item(), "k3": (torch.expm1(d) - d).mean().item(),
            "bitwise": (torch.cat(a).float() == torch.cat(b).float()).double().mean().item(),
            f"mean_abs_first{FIRST}": ad[first].mean().item(),
            "mean_abs_rest": ad[~first].mean().item() if (~first).any() else float("nan")}


def sampled(outs) -> tuple[list[list[int]], list[int], list[torch.Tensor]]:
    """Every sample's prompt + tokens, its prompt length, and its sampled-token logprobs."""
    seqs, prompt_lens, logps = [], [], []
    for o in outs:
        for c in o.outputs:
            seqs.append(list(o.prompt_token_ids) + list(c.token_ids))
            prompt_lens.append(len(o.prompt_token_ids))
            logps.append(torch.tensor(c.logprobs, dtype=torch.float32))
    return seqs, prompt_lens, logps


def quantized_samples(path: Path, prompts: list[list[int]], params: SamplingParams, engine_kwargs: dict,
                      quantization: str, device: torch.device) -> tuple[list[list[int]], list[int], list[torch.Tensor]]:
    """sampled() of the same prompts and parameters on Engine(quantization=...)."""
    engine = Engine(path, quantization=quantization, **engine_kwargs)
    outs = engine.generate(prompts, params, use_tqdm=False)
    engine.sleep(level=2)
    del engine
    free(device)
    return sampled(outs)


def engine_scores(engine, seqs: list[list[int]], prompt_lens: list[int], batch: int) -> list[torch.Tensor]:
    """The engine's log p(token | prefix) of every token after each prompt, by prompt_logprobs (one prefill)."""
    params = SamplingParams(temperature=1.0, max_tokens=1, logprobs=None, prompt_logprobs=0)
    out = []
    for first in range(0, len(seqs), batch):
        part = seqs[first : first + batch]
        for seq, plen, o in zip(part, prompt_lens[first : first + batch], engine.generate(part, params, use_tqdm=False)):
            out.append(torch.tensor([o.prompt_logprobs[t][seq[t]] for t in range(plen, len(seq))], dtype=torch.float32))
    return out


def batch_invariant_row(path: Path, prompts: list[list[int]], params: SamplingParams, engine_kwargs: dict,
                        batch: int, device: torch.device) -> dict:
    """Engine(batch_invariant=True)'s sampled-token logprobs against trainer_adapters.on_policy_logprobs of a
    transformers model loaded fresh in the engine's dtype, on the same tokens (compare()'s statistics)."""
    from trainer_adapters import on_policy_logprobs

    engine = Engine(path, batch_invariant=True, **engine_kwargs)
    outs = engine.generate(prompts, params, use_tqdm=False)
    dtype = engine.dtype
    engine.sleep(level=2)
    del engine
    free(device)
    rows = [(list(o.prompt_token_ids), c) for o in outs for c in o.outputs]
    model = load_reference(path, dtype, device)
    engine_lp, ours = [], []
    with torch.no_grad():
        for first in range(0, len(rows), batch):
            part = rows[first : first + batch]
            width = max(len(p) + len(c.token_ids) for p, c in part)
            ids = torch.zeros(len(part), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, (p, c) in enumerate(part):
                ids[i, : len(p) + len(c.token_ids)], mask[i, : len(p) + len(c.token_ids)] = torch.tensor(p + c.token_ids), 1
            lp = on_policy_logprobs(model, ids.to(device), mask.to(device), params).cpu()
            for i, (p, c) in enumerate(part):
                ours.append(lp[i, len(p) : len(p) + len(c.token_ids)])
                engine_lp.append(torch.tensor(c.logprobs, dtype=torch.float32))
    del model
    free(device)
    return compare(engine_lp, ours)


# ------------------------------------------------------------------ one checkpoint


def run_checkpoint(label: str, path: Path, prompts: list[list[int]], args, device: torch.device) -> tuple[list[dict], dict]:
    timings, t0 = {}, time.perf_counter()
    limit = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    max_len = min(max(map(len, prompts)) + args.max_tokens + 16, limit)
    engine_kwargs = dict(device=device, dtype=args.engine_dtype, kv_cache_memory=args.kv_cache_memory,
                         max_num_seqs=min(256, len(prompts) * args.n), max_model_len=max_len, seed=args.seed)
    engine = Engine(path, **engine_kwargs)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=True,
                            seed=args.seed)
    outs = engine.generate(prompts, params, use_tqdm=False)
    sync(device)
    engine_dtype = str(getattr(engine, "dtype", args.engine_dtype))
    seqs, prompt_lens, engine_logps = sampled(outs)
    logps = {"engine": engine_logps}
    quantized, quantized_rows = {}, []
    if args.quantization:
        engine.sleep(level=1)  # offloaded to the host: one engine's weights on the device at a time
        for quantization in args.quantization:
            quantized[format_label(quantization, engine.dtype)] = quantized_samples(
                path, prompts, params, engine_kwargs, quantization, device)
        engine.wake()
        timings["quantized_engines_s"] = time.perf_counter() - t0
        plain = format_label(None, engine.dtype)
        own = engine_scores(engine, seqs, prompt_lens, args.forward_batch)
        quantized_rows.append({"model": label, "pair": f"engine {plain} vs own prefill"} | compare(logps["engine"], own))
        for fmt, (q_seqs, q_lens, q_logps) in quantized.items():
            quantized_rows.append({"model": label, "pair": f"engine {fmt} vs engine {plain}"}
                                  | compare(q_logps, engine_scores(engine, q_seqs, q_lens, args.forward_batch)))
    engine.sleep(level=2)  # the memory goes back before the reference models load
    del engine
    free(device)
    timings["engine_s"] = time.perf_counter() - t0
    mean_logprob = torch.cat(logps["engine"]).double().mean().item()

    t = time.perf_counter()
    model = load_reference(path, torch.bfloat16, device)
    attn = getattr(model.config, "_attn_implementation", None)
    logps["bf16_forward"] = forward_logprobs(model, seqs, prompt_lens, args.forward_batch, device)
    timings["bf16_forward_s"] = time.perf_counter() - t
    for fmt, (q_seqs, q_lens, q_logps) in quantized.items():
        quantized_rows.append({"model": label, "pair": f"engine {fmt} vs trainer bf16 fwd"}
                              | compare(q_logps, forward_logprobs(model, q_seqs, q_lens, args.forward_batch, device)))
    t = time.perf_counter()
    logps["bf16_incremental"] = incremental_logprobs(model, seqs, prompt_lens, args.incremental_batch, device)
    timings["bf16_incremental_s"] = time.perf_counter() - t
    del model
    free(device)
    t = time.perf_counter()
    model = load_reference(path, torch.float32, device)
    logps["fp32_forward"] = forward_logprobs(model, seqs, prompt_lens, args.forward_batch, device)
    timings["fp32_forward_s"] = time.perf_counter() - t
    del model
    free(device)

    rows = [{"model": label, "pair": pair} | compare(logps[a], logps[b]) | {"note": ""} for pair, a, b in PAIRS]
    rows += [r | {"note": ""} for r in quantized_rows]
    t = time.perf_counter()
    rows.append({"model": label, "pair": "engine batch_invariant vs on_policy"}
                | batch_invariant_row(path, prompts, params, engine_kwargs, args.forward_batch, device) | {"note": ""})
    timings["batch_invariant_s"] = time.perf_counter() - t
    meta = {"model": label, "prompts": len(prompts), "n": args.n, "prompt_len": max(map(len, prompts)),
            "max_tokens": args.max_tokens, "engine_dtype": engine_dtype, "mean_engine_logprob": mean_logprob,
            "transformers_attn_implementation": attn, "timings": timings,
            "mean_quantized_engine_logprob": {fmt: torch.cat(lp).double().mean().item()
                                              for fmt, (_, _, lp) in quantized.items()}}
    print(f"{label}: {len(prompts)} prompts x {args.n}, {len(seqs)} samples, mean sampled-token logprob "
          f"{mean_logprob:.2f}, transformers attention {attn}; "
          + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    return rows, meta


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["shaped", "demo"], default="shaped",
                        help="shaped: random peaked weights of --shape; demo: the tiny GRPO demo policy")
    parser.add_argument("--shape", nargs="+", default=["qwen3-1.7b", "llama-3.1-8b"], choices=list(SHAPES))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompts-8b", type=int, default=16, help="prompts for llama-3.1-8b (keeps the run short)")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--embed-std", type=float, default=0.3)
    parser.add_argument("--head-std", type=float, default=None, help="untied lm_head std (default 4/sqrt(hidden))")
    parser.add_argument("--engine-dtype", default="auto", help="Engine(dtype=...): auto = the checkpoint's on GPU")
    parser.add_argument("--kv-cache-memory", type=float, default=0.2)
    parser.add_argument("--forward-batch", type=int, default=8)
    parser.add_argument("--incremental-batch", type=int, default=128)
    parser.add_argument("--demo-steps", type=int, default=100, help="GRPO steps for --model demo (0: untrained)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default=None, help="where checkpoints are written (default: a temp dir in /tmp)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--quantization", nargs="*", default=[], choices=QUANTIZATIONS,
                        help="also sample on engines with these weight formats: the 'engine fp8 vs ...' rows")
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: tiny models, 8 prompts x 4, 96 tokens")
    args = parser.parse_args()
    name = result_name("fidelity", args, parser)  # before any argument is adjusted below
    if args.quick:
        args.shape = ["tiny-qwen3", "tiny-llama"]
        args.device = args.device or "cpu"
        args.prompts, args.n, args.prompt_len, args.max_tokens = 8, 4, 16, 96
        args.engine_dtype = "bfloat16" if args.engine_dtype == "auto" else args.engine_dtype
        args.kv_cache_memory, args.incremental_batch = 64 << 20, 32
        args.demo_steps = min(args.demo_steps, 20)
        if args.embed_std == 0.3:  # at hidden 64 a tied 0.3 embedding makes every token repeat its input
            args.embed_std = 0.1
    else:
        args.kv_cache_memory = args.kv_cache_memory if args.kv_cache_memory < 1 else int(args.kv_cache_memory)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows, metas = [], []
    root = Path(tempfile.mkdtemp(prefix="fidelity_", dir=args.root))
    try:
        if args.model == "demo":
            path, prompts = demo_checkpoint(root, device, args.demo_steps, args.seed)
            prompts = prompts[: args.prompts]  # of the 100 task prompts
            args.max_tokens = min(args.max_tokens, 64 - max(map(len, prompts)) - 1)  # its max_position_embeddings
            r, m = run_checkpoint(f"demo ({args.demo_steps} GRPO steps)", path, prompts, args, device)
            rows, metas = r, [m]
        for shape in args.shape if args.model == "shaped" else []:
            count = args.prompts_8b if shape == "llama-3.1-8b" else args.prompts
            cfg = SHAPES.get(shape) or QUICK_SHAPES[shape]
            g = torch.Generator().manual_seed(args.seed)
            prompts = [torch.randint(0, cfg["vocab_size"], (args.prompt_len,), generator=g).tolist()
                       for _ in range(count)]
            t = time.perf_counter()
            path = random_checkpoint(shape, root, device, args.embed_std, args.head_std, args.seed)
            build_s = time.perf_counter() - t
            r, m = run_checkpoint(shape, path, prompts, args, device)
            m["timings"]["checkpoint_s"] = build_s
            rows += r
            metas.append(m)
            shutil.rmtree(path, ignore_errors=True)  # an 8B bf16 checkpoint is 16 GB
            save(name, rows, {k: v for k, v in vars(args).items()} | {"models": metas})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    save(name, rows, {k: v for k, v in vars(args).items()} | {"models": metas})
    measured = [r for r in rows if "mean_abs" in r]
    plot_bars(name, [f"{r['model']}: {r['pair']}" for r in measured],
              {"mean |Δlogprob|": [r["mean_abs"] for r in measured],
               f"mean |Δ| first {FIRST}": [r[f"mean_abs_first{FIRST}"] for r in measured],
               "mean |Δ| rest": [r["mean_abs_rest"] for r in measured]}, "|Δ logprob| (nats)")
    print_table(rows, f"logprob fidelity (d = logp_B - logp_A for 'A vs B' over the engine's sampled tokens; "
                      f"k3 = mean(exp(d) - 1 - d); bitwise = fraction exactly equal), {machine()}")


if __name__ == "__main__":
    main()
