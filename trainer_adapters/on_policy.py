"""True on-policy logprobs: a differentiable forward of a transformers Llama/Qwen2/Qwen3 model whose logprobs are
bitwise equal to what `Engine(batch_invariant=True)` reported for the same tokens.

The forward runs the engine's batch-invariant kernels (rollout_kernels.get_ops(device, batch_invariant=True)) in the
engine's order and dtypes (rollout_engine/model.py): the embedding; RMSNorm with its fused residual add; q, k, v
as one matmul over the concatenated weights (the engine's fused qkv_proj: the matmul's K split is a function of
the weight's shape, so the fused shape is what reproduces its bits), gate and up likewise; the q/k norm, rotary
(the engine's cos/sin table) and the KV store in one `rope_store`; attention with the fixed key split over the
sequences' keys laid out in blocks as the engine's pool holds them (a prefill gives a query the bits of its
decode step); the final norm, the LM head, and the sampler's own logprob kernel at the rollout's temperature
and filters. Every kernel's result for a token is independent of the rest of the batch, so the sequences may
be batched any way.

The backward is ordinary autograd: each kernel runs inside an autograd.Function whose backward is the gradient
of a plain torch twin of the same function (a matmul's gradient, scaled-dot-product attention, the torch
RMSNorm, SiLU and log-softmax), recomputed from the saved inputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout_kernels import get_ops
from rollout_kernels.activation import silu_and_mul_ref
from rollout_kernels.norm import rms_norm_ref
from rollout_kernels.sampling import mode_logprobs
from rollout_engine import SamplingParams
from rollout_engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
from rollout_engine.model import rotary_table

from .grpo import floor_dropped

BLOCK_SIZE = 16            # the KV layout's block size (the fixed key split's bits do not depend on it)
PIECE_ELEMENTS = 1 << 24   # the LM head and log-softmax go over rows in pieces of about this many logits
MODES = ("processed", "raw")


def on_policy_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       params: SamplingParams | None = None, logprobs_mode: str | None = None) -> torch.Tensor:
    """[B, L] float32: log p(input_ids[b, t] | input_ids[b, :t]) under `model`, as Engine(batch_invariant=True)
    reports it for a sampled token (0 at position 0 and at padding; a prompt token that params' filters drop gets
    float32's most negative finite number, probability 0, never -inf); differentiable in the model's parameters.

    `attention_mask` [B, L]: right padding only (each row's ones first). `params`: the rollout's SamplingParams
    (temperature, top-k, top-p, min-p, logprobs_mode; None: temperature 1, no filter, "processed");
    `logprobs_mode` as the engine's, "processed" or "raw" (None: params.logprobs_mode, the rollout's own). The
    model's parameters must be in the engine's dtype."""
    cfg = engine_config(model)
    params = params if params is not None else SamplingParams()
    params.validate()
    logprobs_mode = params.logprobs_mode if logprobs_mode is None else logprobs_mode
    if logprobs_mode not in MODES:
        raise ValueError(f"logprobs_mode={logprobs_mode!r} (the argument, or params.logprobs_mode when it is None) "
                         f"is not supported; allowed: {', '.join(map(repr, MODES))}")
    device = model.get_input_embeddings().weight.device
    lengths = sequence_lengths(input_ids, attention_mask)
    ops = get_ops(device, batch_invariant=True)
    mask = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :] < lengths[:, None]
    ids = input_ids[mask].to(device)
    layout = Layout(lengths.tolist(), cfg, device)
    h = model_hidden(model, cfg, ops, ids, layout)
    scored = mask.clone()
    scored[:, 0] = False                      # (b, t >= 1) in row-major order: the rows (b, t - 1) score ids[.. + 1]
    rows = layout.scoring_rows()
    head = model.get_output_embeddings().weight
    picked = floor_dropped(_HeadLogprobs.apply(h[rows], head, ids[rows + 1], ops, params, MODES.index(logprobs_mode)))
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=device)
    out[scored.to(device)] = picked
    return out


def engine_config(model) -> ModelConfig:
    """The engine's ModelConfig of a transformers model (its class names the architecture)."""
    arch = type(model).__name__
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model is a {arch}; on_policy_logprobs supports {list(SUPPORTED_ARCHITECTURES)}")
    raw = model.config.to_dict() | {"architectures": [arch], "dtype": "float32"}
    raw.pop("torch_dtype", None)  # the parameters' dtype is what runs; the config's is not read here
    return ModelConfig.from_dict(raw)


def sequence_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Each row's length; a ValueError unless the mask is right padding of at least one token per row."""
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an integer [B, L] tensor, got {input_ids.dtype} {tuple(input_ids.shape)}")
    if attention_mask is None:
        return torch.full((input_ids.shape[0],), input_ids.shape[1], device=input_ids.device)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must have input_ids' shape "
                         f"{tuple(input_ids.shape)}")
    lengths = (attention_mask != 0).sum(1)
    right = torch.arange(input_ids.shape[1], device=attention_mask.device)[None, :] < lengths[:, None]
    if not torch.equal(right, attention_mask != 0) or bool((lengths == 0).any()):
        raise ValueError("attention_mask must be right padding (each row's ones first) with at least one token per row")
    return lengths


class Layout:
    """The packed batch as the engine's attention sees a prefill: each sequence's tokens, their positions, their
    KV slots in blocks of BLOCK_SIZE, and the block tables."""

    def __init__(self, lengths: list[int], cfg: ModelConfig, device):
        self.lengths, self.cfg, self.device = lengths, cfg, device
        blocks = [-(-n // BLOCK_SIZE) for n in lengths]
        self.num_blocks, first = sum(blocks), [sum(blocks[:i]) for i in range(len(blocks))]
        tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
        for s, (start, count) in enumerate(zip(first, blocks)):
            tables[s, :count] = torch.arange(start, start + count)
        self.positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        self.slot_mapping = torch.cat([start * BLOCK_SIZE + torch.arange(n) for start, n in zip(first, lengths)]).to(device)
        self.block_tables = tables.to(device)
        self.seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        self.query_start_loc = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        with torch.device(device):
            self.cos_sin = rotary_table(cfg, max(lengths))

    def scoring_rows(self) -> torch.Tensor:
        """Packed rows whose next token is in the sequence: every row but each sequence's last."""
        return torch.cat([start + torch.arange(n - 1) for start, n in
                          zip(self.query_start_loc[:-1].tolist(), self.lengths)]).to(self.device)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """(packed [T, ...] as [B, max length, ...] with zeros past each sequence's end, differentiable; the
        [B, max length] mask of real tokens)."""
        mask = torch.arange(max(self.lengths), device=self.device)[None, :] < self.seq_lens[:, None]
        out = x.new_zeros((len(self.lengths), max(self.lengths), *x.shape[1:]))
        return out.index_put((mask,), x), mask


def model_hidden(model, cfg: ModelConfig, ops, ids: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The final hidden states [T, hidden] of the packed tokens: CausalLM.forward's ops in its order."""
    backbone = model.model
    x, residual = F.embedding(ids, backbone.embed_tokens.weight), None
    for layer in backbone.layers:
        x, residual = norm(ops, cfg, layer.input_layernorm, x, residual)
        attn = layer.self_attn
        qkv = fused_linear(ops, x, [attn.q_proj, attn.k_proj, attn.v_proj])
        x = fused_linear(ops, attention(ops, cfg, attn, qkv, layout), [attn.o_proj])
        x, residual = norm(ops, cfg, layer.post_attention_layernorm, x, residual)
        x = _Exact.apply(ops.silu_and_mul, silu_and_mul_ref, fused_linear(ops, x, [layer.mlp.gate_proj,
                                                                                     layer.mlp.up_proj]))
        x = fused_linear(ops, x, [layer.mlp.down_proj])
    return norm(ops, cfg, backbone.norm, x, residual)[0]


def norm(ops, cfg: ModelConfig, module, x, residual):
    """RMSNorm.forward's (out, residual): the first layer's residual is its input; later ones add it first."""
    eps = cfg.rms_norm_eps
    if residual is None:
        return _Exact.apply(lambda a, w: ops.rms_norm(a, w, eps), lambda a, w: rms_norm_ref(a, w, eps), x,
                            module.weight), x
    return _Exact.apply(lambda a, w, r: ops.rms_norm(a, w, eps, r), lambda a, w, r: rms_norm_ref(a, w, eps, r), x,
                        module.weight, residual)


def fused_linear(ops, x, modules):
    """x @ cat(weights).T + cat(biases): one matmul over the modules' rows, as the engine fuses them."""
    biases = [m.bias for m in modules]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise ValueError("fused projections must all have a bias or none")
    return _FusedLinear.apply(x, ops.linear, len(modules), *[m.weight for m in modules], *biases)


def attention(ops, cfg: ModelConfig, attn, qkv, layout: Layout):
    """Attention.forward after qkv_proj: [T, heads * head_dim]."""
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    split, scale = [heads * dim, kv_heads * dim, kv_heads * dim], dim ** -0.5
    norms = (attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm else ()
    eps = cfg.rms_norm_eps

    def exact(fused, *weights):
        q, k, v = fused.clone().split(split, dim=-1)  # rope_store rotates q in place: not the saved input
        q, k, v = q.reshape(-1, heads, dim), k.reshape(-1, kv_heads, dim), v.reshape(-1, kv_heads, dim)
        cache = [torch.empty(layout.num_blocks, BLOCK_SIZE, kv_heads, dim, dtype=fused.dtype, device=fused.device)
                 for _ in range(2)]
        q = ops.rope_store(q, k, v, layout.positions, layout.cos_sin, *cache, layout.slot_mapping, None, None,
                           *weights, *((eps,) if weights else ()))
        o = ops.paged_attention(q, *cache, layout.block_tables, layout.seq_lens, layout.query_start_loc,
                                max(layout.lengths), scale, None, None)
        return o.reshape(-1, heads * dim)

    def smooth(fused, *weights):
        q, k, v = fused.split(split, dim=-1)
        q, k, v = q.reshape(-1, heads, dim), k.reshape(-1, kv_heads, dim), v.reshape(-1, kv_heads, dim)
        if weights:
            q = rms_norm_ref(q.reshape(-1, dim), weights[0], eps).view(q.shape)
            k = rms_norm_ref(k.reshape(-1, dim), weights[1], eps).view(k.shape)
        cos, sin = layout.cos_sin[layout.positions][:, None].chunk(2, dim=-1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        (q, mask), (k, _), (v, _) = layout.padded(q), layout.padded(k), layout.padded(v)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=scale, enable_gqa=heads != kv_heads)
        return o.transpose(1, 2)[mask].reshape(-1, heads * dim)

    return _Exact.apply(exact, smooth, qkv, *norms)


def rotate(x, cos, sin):
    """Rotary (rotate-half convention) in float32, rounded to x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class _Exact(torch.autograd.Function):
    """exact(*inputs) forward (the engine's kernel); the backward is the gradient of smooth(*inputs), a plain
    torch function equal to it up to rounding, recomputed from the saved inputs."""

    @staticmethod
    def forward(ctx, exact, smooth, *inputs):
        ctx.smooth = smooth
        ctx.save_for_backward(*inputs)
        return exact(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(need) for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:])]
        with torch.enable_grad():
            out = ctx.smooth(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [x for x in inputs if x.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                     if pairs and wanted else [None] * len(wanted))
        return None, None, *[next(found) if x.requires_grad else None for x in inputs]


class _FusedLinear(torch.autograd.Function):
    """x @ cat(weights).T + cat(biases) by the engine's `linear`; the backward is the matmul's gradient, shard by
    shard (the concatenated weight is not kept)."""

    @staticmethod
    def forward(ctx, x, linear, n, *params):
        weights, biases = params[:n], params[n:]
        ctx.save_for_backward(x, *weights)
        ctx.has_bias = biases[0] is not None
        weight = weights[0] if n == 1 else torch.cat(weights)
        bias = None if biases[0] is None else biases[0] if n == 1 else torch.cat(biases)
        return linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        parts = grad.split([w.shape[0] for w in weights], dim=1)
        needs = ctx.needs_input_grad
        gx = sum(p @ w for p, w in zip(parts, weights)) if needs[0] else None
        gw = [p.t() @ x if need else None for p, need in zip(parts, needs[3 : 3 + len(weights)])]
        gb = [p.sum(0) if need and ctx.has_bias else None for p, need in zip(parts, needs[3 + len(weights):])]
        return gx, None, None, *gw, *gb


class _HeadLogprobs(torch.autograd.Function):
    """The LM head and the sampler's logprob of each target token (the engine's kernels), over rows in pieces
    (never all the logits at once). The backward recomputes each piece's logits and takes the gradient of the
    torch log-softmax of the same mode (rollout_kernels.sampling.mode_logprobs)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ops, params, mode_index):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.params, ctx.mode_index = params, mode_index
        out = []
        for at in pieces(len(hidden), weight.shape[0]):
            logits = ops.linear(hidden[at], weight)
            out.append(ops.token_logprobs(logits, targets[at], *row_params(params, len(logits), logits.device))[mode_index])
        return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets = ctx.saved_tensors
        gh, gw = torch.zeros_like(hidden), torch.zeros_like(weight, dtype=torch.float32)
        for at in pieces(len(hidden), weight.shape[0]):
            logits = F.linear(hidden[at], weight).detach().requires_grad_()
            with torch.enable_grad():
                lp = mode_logprobs(logits, *row_params(ctx.params, len(logits), logits.device),
                                   MODES[ctx.mode_index]).gather(1, targets[at, None])[:, 0]
            (g,) = torch.autograd.grad(lp, logits, grad[at])
            g = g.to(weight.dtype)
            gh[at] = g @ weight
            gw += (g.t() @ hidden[at]).float()
        return gh, gw.to(weight.dtype), None, None, None, None


def pieces(rows: int, vocab: int) -> list[slice]:
    size = max(1, PIECE_ELEMENTS // vocab)
    return [slice(start, start + size) for start in range(0, rows, size)]


def row_params(params: SamplingParams, rows: int, device) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p) per row, as the model runner uploads them."""
    return (torch.full((rows,), params.temperature, dtype=torch.float32, device=device),
            torch.full((rows,), params.top_k, dtype=torch.int32, device=device),
            torch.full((rows,), params.top_p, dtype=torch.float32, device=device),
            torch.full((rows,), params.min_p, dtype=torch.float32, device=device))
