"""Decode steps of the engine beside a gpt-fast-style torch.compile decoder: same shapes, same run, same GPU.

The baseline is what a user writes for fast decoding without a serving engine, done the way gpt-fast does it:
one model file, a static KV cache [batch, kv heads, max_len, head dim] per layer written at the step's
position (its address marked static), scaled_dot_product_attention over the whole cache under a position mask
with K/V repeated to the query heads, and the step compiled with
torch.compile(mode="reduce-overhead", fullgraph=True) (Inductor kernels replayed from CUDA graphs) with
Inductor's coordinate-descent tuning on. The decoder is this script's own code, with random bf16 weights of the
shapes in common.SHAPES (fused qkv and gate_up projections; Qwen3's q/k norms; a tied head where the model ties
it); its rotary tables are plain (no llama3 frequency scaling), which does not change its speed. Each step
samples every row at temperature 1 (Gumbel-max, no host sync) and returns the sampled token's logprob, as an
RL rollout needs and the engine does.

Both run as a generate loop runs them: steps launched back to back, the tokens fed to the next step, the host
never waiting (the engine: decode_roofline.pipelined_step, PIPELINED_STEPS steps of sequences whose `context`
tokens are already cached; the baseline: the same number of steps from the same position). The roofline is
the same for both: every weight read once a step (the embedding table only where the head is tied to it) and
each sequence's K/V up to its mean position, at the device-to-device copy bandwidth measured in this run. The
baseline's cache is sized to the steps it runs (context + PIPELINED_STEPS), so its masked attention reads
little past the context.

`--quick` runs tiny shapes on the CPU with torch.compile's eager backend: a smoke test of the script.
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUICK_SHAPES, SHAPES, copy_bandwidth, machine, plot_bars, print_table, result_name, save, sync  # noqa: E402
from decode_roofline import PIPELINED_STEPS, run_shape  # noqa: E402


class StaticCacheDecoder(torch.nn.Module):
    """A decoder-only transformer of a common.SHAPES config, decoding one token per row from a static cache."""

    def __init__(self, cfg: dict, batch: int, max_len: int, device: str, dtype=torch.bfloat16):
        super().__init__()
        hidden, heads, kv_heads, head_dim = (cfg["hidden_size"], cfg["num_attention_heads"],
                                             cfg["num_key_value_heads"], cfg["head_dim"])
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, cfg["rms_norm_eps"]
        self.qk_norm = cfg["model_type"] == "qwen3"

        def weight(*shape):
            return torch.nn.Parameter(torch.randn(*shape, device=device, dtype=dtype) * shape[-1] ** -0.5,
                                      requires_grad=False)

        def ones(n):
            return torch.nn.Parameter(torch.ones(n, device=device, dtype=dtype), requires_grad=False)

        layers = cfg["num_hidden_layers"]
        self.embed = weight(cfg["vocab_size"], hidden)
        self.head = self.embed if cfg["tie_word_embeddings"] else weight(cfg["vocab_size"], hidden)
        self.qkv = torch.nn.ParameterList(weight((heads + 2 * kv_heads) * head_dim, hidden) for _ in range(layers))
        self.o = torch.nn.ParameterList(weight(hidden, heads * head_dim) for _ in range(layers))
        self.gate_up = torch.nn.ParameterList(weight(2 * cfg["intermediate_size"], hidden) for _ in range(layers))
        self.down = torch.nn.ParameterList(weight(hidden, cfg["intermediate_size"]) for _ in range(layers))
        self.norms = torch.nn.ParameterList(ones(hidden) for _ in range(2 * layers + 1))
        self.q_norms = torch.nn.ParameterList(ones(head_dim) for _ in range(layers))
        self.k_norms = torch.nn.ParameterList(ones(head_dim) for _ in range(layers))
        # A buffer of its own per layer, as gpt-fast's: a write into a slice of one stacked buffer is
        # functionalized into a copy of the whole stack. Mutated in place: CUDA graphs keep their addresses.
        shape = (batch, kv_heads, max_len, head_dim)
        for i in range(layers):
            for kind in ("k", "v"):
                self.register_buffer(f"{kind}_cache_{i}", torch.randn(*shape, device=device, dtype=dtype))
                torch._dynamo.mark_static_address(getattr(self, f"{kind}_cache_{i}"))
        self.k_caches = [getattr(self, f"k_cache_{i}") for i in range(layers)]
        self.v_caches = [getattr(self, f"v_cache_{i}") for i in range(layers)]
        inv_freq = cfg["rope_theta"] ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos().to(dtype))
        self.register_buffer("sin", angles.sin().to(dtype))
        self.register_buffer("positions", torch.arange(max_len, device=device))

    def rms(self, x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * w

    def rope(self, x, pos):
        half = self.head_dim // 2
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]  # [1, 1, D/2]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor):
        """tokens [B] at position pos [1] (every row at the same position): (next tokens [B], their logprobs)."""
        x = self.embed[tokens]
        batch, q_width, kv_width = x.shape[0], self.heads * self.head_dim, self.kv_heads * self.head_dim
        mask = (self.positions <= pos)[None, None, None, :]  # [1, 1, 1, max_len]
        for i in range(len(self.qkv)):
            q, k, v = (self.rms(x, self.norms[2 * i]) @ self.qkv[i].T).split([q_width, kv_width, kv_width], -1)
            q, k = q.view(batch, self.heads, self.head_dim), k.view(batch, self.kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = self.rms(q, self.q_norms[i]), self.rms(k, self.k_norms[i])
            q, k = self.rope(q, pos), self.rope(k, pos)
            k_cache, v_cache = self.k_caches[i], self.v_caches[i]
            k_cache.index_copy_(2, pos, k[:, :, None])
            v_cache.index_copy_(2, pos, v.view(batch, self.kv_heads, 1, self.head_dim))
            group = self.heads // self.kv_heads  # gpt-fast's GQA: K/V repeated to the query heads
            o = F.scaled_dot_product_attention(q[:, :, None], k_cache.repeat_interleave(group, 1),
                                               v_cache.repeat_interleave(group, 1), attn_mask=mask)
            x = x + o.reshape(batch, q_width) @ self.o[i].T
            gate, up = (self.rms(x, self.norms[2 * i + 1]) @ self.gate_up[i].T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ self.down[i].T
        logits = (self.rms(x, self.norms[-1]) @ self.head.T).float()
        logprobs = torch.log_softmax(logits, -1)
        noise = torch.empty_like(logprobs).exponential_(1)
        next_tokens = torch.argmax(logprobs.exp() / noise, -1)
        return next_tokens, logprobs.gather(-1, next_tokens[:, None])[:, 0]


def weight_bytes(model: StaticCacheDecoder) -> int:
    """Bytes a step reads from weights: all but the embedding table, which only a tied head reads whole."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied head counted once
    return total - (0 if model.head is model.embed else model.embed.numel() * model.embed.element_size())


def run_baseline(name: str, cfg: dict, batches, contexts, bandwidth: float, device: str, backend: str) -> list[dict]:
    rows = []
    for context in contexts:
        for batch in batches:
            model = StaticCacheDecoder(cfg, batch, context + PIPELINED_STEPS + 1, device)
            step = torch.compile(model, fullgraph=True, backend=backend,
                                 **({"mode": "reduce-overhead"} if backend == "inductor" else {}))
            start = time.perf_counter()
            tokens = torch.randint(0, cfg["vocab_size"], (batch,), device=device)
            first = torch.full((1,), context, device=device)
            for _ in range(3):  # compile, then record the CUDA graph
                step(tokens, first)
            sync(device)
            compile_s = time.perf_counter() - start
            times = []
            for _ in range(4):  # the first is warm-up
                pos, tokens = first.clone(), torch.randint(0, cfg["vocab_size"], (batch,), device=device)
                sync(device)
                t = time.perf_counter()
                for _ in range(PIPELINED_STEPS):
                    tokens, _ = step(tokens, pos)
                    tokens, pos = tokens.clone(), pos + 1
                sync(device)
                times.append((time.perf_counter() - t) / PIPELINED_STEPS)
            piped = sorted(times[1:])[1]
            kv_per_token = 2 * len(model.k_caches) * model.kv_heads * model.head_dim * model.k_caches[0].element_size()
            roofline = (weight_bytes(model) + batch * (context + PIPELINED_STEPS // 2) * kv_per_token) / bandwidth
            rows.append({"model": name, "decoder": f"torch.compile ({backend})", "batch": batch, "context": context,
                         "pipelined_ms": piped * 1e3, "pipelined_of_roofline": roofline / piped,
                         "tokens_per_s": batch / piped, "compile_s": compile_s})
            del step, model
            torch._dynamo.reset()  # each shape compiles afresh; the graphs of the last one are freed
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def engine_rows(name: str, batches, contexts, bandwidth: float, root: Path, device: str) -> list[dict]:
    rows = run_shape(name, batches, contexts, bandwidth, root, device)
    return [{"model": name, "decoder": "rollout-engine", "batch": r["batch"], "context": r["context"],
             "pipelined_ms": r["pipelined_ms"], "pipelined_of_roofline": r["pipelined_of_roofline"],
             "tokens_per_s": r["tokens_per_s"]} for r in rows]


def add_speedups(rows: list[dict]) -> None:
    """The engine's speed-up: the baseline's step time over the engine's, on each (model, batch, context)."""
    engine = {(r["model"], r["batch"], r["context"]): r["pipelined_ms"] for r in rows if r["decoder"] == "rollout-engine"}
    for r in rows:
        if r["decoder"] != "rollout-engine":
            r["engine_speedup"] = r["pipelined_ms"] / engine.get((r["model"], r["batch"], r["context"]), float("nan"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen3-1.7b", "llama-3.1-8b"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: a smoke test of the script")
    args = parser.parse_args(argv)
    result = result_name("compiled_baseline", args, parser)
    device, backend = ("cpu", "eager") if args.quick else ("cuda", "inductor")
    if args.quick:
        args.models, args.batches, args.contexts = list(QUICK_SHAPES), [1, 4], [32]
    else:
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True  # gpt-fast's setting
    bandwidth = copy_bandwidth(device=device)
    root = Path(tempfile.mkdtemp())
    rows = []
    for name in args.models:  # saved after each model, so a run cut short keeps what it measured
        cfg = SHAPES[name] if name in SHAPES else QUICK_SHAPES[name]
        rows += run_baseline(name, cfg, args.batches, args.contexts, bandwidth, device, backend)
        rows += engine_rows(name, args.batches, args.contexts, bandwidth, root, device)
        add_speedups(rows)
        save(result, rows, {"copy_bandwidth_bytes_per_s": bandwidth, "pipelined_steps": PIPELINED_STEPS})
    print_table(rows, f"decode step, engine vs gpt-fast-style torch.compile (copy {bandwidth / 1e12:.2f} TB/s), "
                      f"{machine()}")
    labels = [f"{r['model']} b{r['batch']} c{r['context']}" for r in rows if r["decoder"] == "rollout-engine"]
    series = {d: [r["pipelined_ms"] for r in rows if r["decoder"] == d] for d in dict.fromkeys(r["decoder"] for r in rows)}
    plot_bars(result, labels, series, "ms per decode step (pipelined)")


if __name__ == "__main__":
    main()
