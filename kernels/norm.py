"""RMSNorm with an optional fused residual add (Hugging Face LlamaRMSNorm numerics)."""
import torch
import triton
import triton.language as tl


def rms_norm_ref(x, weight, eps, residual=None):
    """x [T, N] -> out, or (out, x + residual) when residual is given.

    Normalise in fp32, round to x.dtype, then scale by weight (as HF does)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight.float() * normed.float()).to(x.dtype)
    return out if residual is None else (out, x)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, stride_x, stride_r, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x, weight, eps, residual=None):
    """Triton twin of rms_norm_ref: one program per row (rows must be unit-stride)."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if rows:
        res = residual if residual is not None else x
        _rms_norm_kernel[(rows,)](x, res, weight, out, res_out, n, x.stride(0), res.stride(0), eps,
                                  HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
                                  num_warps=min(16, max(1, triton.next_power_of_2(n) // 256)))
    return out if residual is None else (out, res_out)
