"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) on the paged KV pool, top to bottom.

Every hot op, the projections included, goes through `ops` (rollout_kernels.get_ops: Triton on CUDA, torch
references elsewhere; batch-invariant ones in that mode), so nothing here branches on the device or the mode. Projections are fused (qkv,
gate_up); each fused parameter knows how to take one Hugging Face shard (`shards`),
which is the only place the fused layout is described. With `cfg.quantization` the projections are Fp8Linear.

Tensor parallel (`tp`, a parallel.TPGroup; None on one device): each rank holds its share of the
attention heads and KV heads (qkv column-parallel: its q rows, then its k and v rows) and of the MLP's
columns (gate_up column-parallel); o_proj and down_proj are row-parallel (`ReducedLinear`: one all-reduce
each). The embedding is replicated (a lookup needs no collective); the LM head is vocab-parallel: each rank
scores its slice of the vocabulary and the slices are all-gathered before sampling. `Linear.split` says which
dimension of a Hugging Face tensor a rank takes a slice of (weights.WeightTable slices on the way in).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from rollout_kernels.fp8 import Fp8Shards

from .config import ModelConfig


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged pool (built by the model runner)."""

    slot_mapping: torch.Tensor      # [T] int64: block * block_size + offset, -1 = padding
    block_tables: torch.Tensor      # [S, max_blocks] int32
    seq_lens: torch.Tensor          # [S] int32: context length including this step's tokens
    query_start_loc: torch.Tensor   # [S + 1] int32
    max_query_len: int
    shared: object = None           # a decode step's groups sharing a prompt (rollout_kernels/shared_prefix.py)

    @property
    def rows(self) -> torch.Tensor:
        """int [1] on the device: the step's leading rows that hold tokens; a CUDA graph's padding rows follow them
        and own no query. Only these set an fp8 activation's per-tensor scale."""
        return self.query_start_loc[-1:]


class Linear(nn.Module):
    """y = x W^T (+ b) by `ops.linear`. `shards` names the row ranges Hugging Face tensors load into."""

    split = None  # tensor parallel: 0 = this rank's output rows (column-parallel), 1 = its input columns

    def __init__(self, in_features: int, out_sizes: dict, bias: bool, ops, weight_dtype: torch.dtype | None = None):
        super().__init__()
        self.ops = ops
        self.shards, start = {}, 0
        for shard, size in out_sizes.items():
            self.shards[shard] = (start, size)
            start += size
        self.weight = nn.Parameter(torch.empty(start, in_features, dtype=weight_dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(start), requires_grad=False) if bias else None

    def forward(self, x, rows=None):
        """`rows` (int [1] on the device): x's leading rows that hold tokens; only an Fp8Linear reads it."""
        return self.ops.linear(x, self.weight, self.bias)

    def silu_and_mul(self, x, fp8_out: bool = False, rows=None):
        """silu(gate) * up of this [gate; up] layer's output (one kernel at batch 1); `rows` as forward's."""
        return self.ops.linear_silu_and_mul(x, self.weight, self.bias, None, fp8_out, rows)


class Fp8Linear(Linear):
    """A Linear whose weight is float8_e4m3fn with ONE float32 scale over all its rows (`weight_scale` [1]),
    which torch._scaled_mm applies: the least power of two >= the max of its shards' own scales (`shard_scale`:
    max|shard| / 448 of the Hugging Face tensor last loaded into each shard).

    A load (`loading`) quantizes the shards that arrive with that scale, computed over them all first, so a
    complete update quantizes each shard once; the rows of shards that did not arrive are re-quantized
    from the old scale to the new one (q * old / new: bit for bit the same when the scale stays, else a
    shift of exponent, exact above e4m3's subnormals, so shards updated again and again do not drift). Both
    scales are buffers, kept through a level-1 sleep, so a shard arriving alone always finds its siblings'
    scales; a level-2 sleep discards them with the weights (LOADED). The input is an Fp8Tensor from the kernel
    that made it (RMSNorm, SiLU-and-mul), or a float tensor quantized by ops.fp8_linear. The bias stays
    in the engine's dtype."""

    LOADED = ("weight_scale", "shard_scale")  # buffers that describe the loaded weight: a level-2 sleep zeroes them

    def __init__(self, in_features: int, out_sizes: dict, bias: bool, ops):
        super().__init__(in_features, out_sizes, bias, ops, weight_dtype=torch.float8_e4m3fn)
        self.register_buffer("weight_scale", torch.zeros(1, dtype=torch.float32))
        self.register_buffer("shard_scale", torch.zeros(len(self.shards), dtype=torch.float32))

    def forward(self, x, rows=None):
        return self.ops.fp8_linear(x, self.weight, self.weight_scale, self.bias, rows=rows)

    def silu_and_mul(self, x, fp8_out: bool = False, rows=None):
        return self.ops.linear_silu_and_mul(x, self.weight, self.bias, self.weight_scale, fp8_out, rows)

    def loading(self, arriving: dict) -> Fp8Shards:
        """What ops.quantize_shards_plan takes to load {shard: Hugging Face tensor} into their rows, in place
        (see the class)."""
        index = {shard: i for i, shard in enumerate(self.shards)}
        return Fp8Shards(self.weight.data, self.weight_scale, self.shard_scale, tuple(self.shards.values()),
                         {index[shard]: tensor for shard, tensor in arriving.items()})


def takes_fp8(layer: Linear) -> bool:
    """Whether `layer` wants its input quantized by the kernel that produces it."""
    return isinstance(layer, Fp8Linear)


class ReducedLinear(Linear):
    """A row-parallel Linear: this rank's input columns; the partial sums are all-reduced across the group
    and the (replicated) bias is added by rank 0 only, so it counts once."""

    split = 1

    def __init__(self, in_features: int, out_sizes: dict, bias: bool, ops, tp):
        super().__init__(in_features, out_sizes, bias, ops)
        self.tp = tp

    def forward(self, x, rows=None):
        return self.tp.all_reduce(self.ops.linear(x, self.weight, self.bias if self.tp.rank == 0 else None))


def column_parallel(layer: Linear, tp) -> Linear:
    """Mark `layer` as holding this rank's output rows (its sizes are already the rank's)."""
    if tp is not None:
        layer.split = 0
    return layer


def row_parallel(cfg: ModelConfig, ops, in_features: int, out_features: int, bias: bool, tp) -> Linear:
    if tp is None:
        return linear(cfg, ops, in_features, {None: out_features}, bias)
    return ReducedLinear(in_features, {None: out_features}, bias, ops, tp)


def ranks(tp) -> int:
    return 1 if tp is None else tp.size


FP8_DIVISOR = 16  # torch._scaled_mm needs in and out features that are multiples of 16


def linear(cfg: ModelConfig, ops, in_features: int, out_sizes: dict, bias: bool, quantize: bool = True) -> Linear:
    """An Fp8Linear where the config quantizes and the shape allows it (on every device alike), else a Linear."""
    fits = in_features % FP8_DIVISOR == 0 and sum(out_sizes.values()) % FP8_DIVISOR == 0
    if quantize and cfg.quantization is not None:
        if fits:
            return Fp8Linear(in_features, out_sizes, bias, ops)
        warnings.warn(f"quantization={cfg.quantization!r}: a projection of {in_features} -> "
                      f"{sum(out_sizes.values())} features stays unquantized (fp8 matmuls take multiples of "
                      f"{FP8_DIVISOR})", stacklevel=2)
    return Linear(in_features, out_sizes, bias, ops)


class RMSNorm(nn.Module):
    """fp8_out: the output feeds an Fp8Linear, so the norm's own kernel quantizes it (an Fp8Tensor).
    feeds_linear: only a projection reads the output, so at batch 1 the projection's kernel may compute it
    (ops.rms_norm_for_linear)."""

    def __init__(self, size: int, eps: float, ops, fp8_out: bool = False, feeds_linear: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps, self.ops, self.fp8_out, self.feeds_linear = eps, ops, fp8_out, feeds_linear

    def forward(self, x, residual=None, rows=None):
        """`rows` (int [1] on the device): x's leading rows that hold tokens, which alone set an fp8 output's scale."""
        if self.feeds_linear:
            return self.ops.rms_norm_for_linear(x, self.weight, self.eps, residual, self.fp8_out, rows)
        if self.fp8_out:
            return self.ops.rms_norm_fp8(x, self.weight, self.eps, residual, rows)
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, tp=None):
        super().__init__()
        # this rank's heads (all of them on one device)
        self.num_heads, self.num_kv_heads = cfg.num_heads // ranks(tp), cfg.num_kv_heads // ranks(tp)
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = column_parallel(
            linear(cfg, ops, cfg.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, cfg.qkv_bias), tp)
        self.o_proj = row_parallel(cfg, ops, q_size, cfg.hidden_size, cfg.o_bias, tp)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head before rotary
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
        self.qk_norm, self.scale, self.ops = cfg.qk_norm, cfg.head_dim ** -0.5, ops
        self.split = [q_size, kv_size, kv_size]
        # Views into the single KV pool, bound by the runner through pool_rows; None while released.
        self.k_cache = self.v_cache = self.k_scale = self.v_scale = None

    def forward(self, x, positions, cos_sin, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        # (Qwen3) per-head RMSNorm of q and k, rotary, k and v into their cache slots, then attention over
        # the cache (and its split merge): rope_store's launch is folded into attention's at batch 1
        # (rollout_kernels/decode_attention.py).
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
        o = self.ops.rope_store_attention(q, k, v, positions, cos_sin, self.k_cache, self.v_cache,
                                          meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                          meta.max_query_len, self.scale, self.k_scale, self.v_scale, *norms,
                                          shared=meta.shared)
        # attention leaves a CUDA graph's padding rows as it found them (any bytes): `rows` keeps them out of an
        # fp8 o_proj's per-tensor scale (and DecoderLayer's out of the later ones)
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim), rows=meta.rows)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, tp=None):
        super().__init__()
        size = cfg.intermediate_size // ranks(tp)
        self.gate_up_proj = column_parallel(linear(cfg, ops, cfg.hidden_size, {0: size, 1: size}, cfg.mlp_bias), tp)
        self.down_proj = row_parallel(cfg, ops, size, cfg.hidden_size, cfg.mlp_bias, tp)
        self.fp8_out = takes_fp8(self.down_proj)

    def forward(self, x, rows=None):
        return self.down_proj(self.gate_up_proj.silu_and_mul(x, self.fp8_out, rows), rows)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, tp=None):
        super().__init__()
        self.self_attn = Attention(cfg, ops, tp)
        self.mlp = MLP(cfg, ops, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, takes_fp8(self.self_attn.qkv_proj),
                                       feeds_linear=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops,
                                                takes_fp8(self.mlp.gate_up_proj), feeds_linear=True)

    def forward(self, x, residual, positions, cos_sin, meta):
        # a CUDA graph's padding rows carry its attention's leftover bytes down the residual stream: only the rows
        # that hold tokens set an fp8 activation's per-tensor scale
        rows = meta.rows
        if residual is None:
            x, residual = self.input_layernorm(x, rows=rows), x
        else:
            x, residual = self.input_layernorm(x, residual, rows)
        x = self.self_attn(x, positions, cos_sin, meta)
        x, residual = self.post_attention_layernorm(x, residual, rows)
        return self.mlp(x, rows), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, tp=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


def rotary_table(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32 on the default device: cos of each position's rotary angles, then
    their sin. One element's bits depend on its position and frequency only, not on max_positions."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), cfg.inv_freq())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class CausalLM(nn.Module):
    """Parameter names mirror Hugging Face's, except the fused qkv_proj and gate_up_proj."""

    def __init__(self, cfg: ModelConfig, ops, max_positions: int, tp=None):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.num_kv_heads = cfg.num_kv_heads // ranks(tp)  # what this rank's KV pool holds per token
        self.model = Backbone(cfg, ops, tp)
        if cfg.quantization == "fp8_lm_head" and cfg.tie_word_embeddings:
            warnings.warn("quantization='fp8_lm_head' quantizes the projections only: this model's LM head is its "
                          "embedding (tied), which stays unquantized", stacklevel=2)
        if not cfg.tie_word_embeddings:
            self.lm_head = column_parallel(linear(cfg, ops, cfg.hidden_size, {None: cfg.vocab_size // ranks(tp)},
                                                  False, quantize=cfg.quantization == "fp8_lm_head"), tp)
        self.register_buffer("cos_sin", rotary_table(cfg, max_positions), persistent=False)
        self.ops = ops

    def attention_modules(self) -> list[Attention]:
        """The modules that read the KV pool, in the order pool rows are assigned."""
        return [layer.self_attn for layer in self.model.layers]

    def forward(self, input_ids, positions, meta: AttentionMetadata):
        """Final hidden states [T, hidden] for every scheduled token."""
        with self._launches():
            x, residual = self.model.embed_tokens(input_ids), None
            for layer in self.model.layers:
                x, residual = layer(x, residual, positions, self.cos_sin, meta)
            return self.model.norm(x, residual)[0]

    def _launches(self):
        return self.ops.projection_launches(self.model.embed_tokens.weight.dtype, self.cfg.quantization is not None,
                                            self.tp is not None)

    def logits(self, hidden, rows=None):
        """`rows` (int [1] on the device): hidden's leading rows that hold tokens, which alone set an fp8 LM head's
        activation scale."""
        with self._launches():
            return self._logits(hidden, rows)

    def _logits(self, hidden, rows=None):
        if self.tp is not None:
            return self.tp.gather_vocab(self._vocab_slice_logits(hidden))
        if not self.cfg.tie_word_embeddings:
            return self.lm_head(hidden, rows=rows)
        return self.ops.linear(hidden, self.model.embed_tokens.weight)

    def _vocab_slice_logits(self, hidden):
        """Tensor parallel: the logits of this rank's slice of the vocabulary (tied: its rows of the embedding)."""
        if not self.cfg.tie_word_embeddings:
            return self.lm_head(hidden)
        per = self.cfg.vocab_size // self.tp.size
        return self.ops.linear(hidden, self.model.embed_tokens.weight[self.tp.rank * per : (self.tp.rank + 1) * per])
