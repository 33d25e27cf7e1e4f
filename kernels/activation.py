"""SiLU-and-mul: the gate of a SwiGLU MLP."""
import torch
import triton
import triton.language as tl


def silu_and_mul_ref(x):
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:], computed in fp32."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x):
    """Triton twin of silu_and_mul_ref (rows must be unit-stride)."""
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](x, out, inter, x.stride(0), BLOCK=block)
    return out
