"""``layer_ops``'s operations as Triton kernels, one launch each (the GPU's path).

Same contracts as ``layer_ops``'s PyTorch definitions, up to rounding: each kernel computes in
float32 and rounds once where the composition rounds after every op in a half-precision model.
One program per token (norms, rotary turn) or per token and block of channels (activation); a
token's heads are one 2-D tile, so the q/k norm and the turn take one pass over a row. Under
``TRITON_INTERPRET=1`` they run on a CPU (the tests' way of checking them without a GPU).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, stream_ptr, out_ptr, weight_ptr, hidden, eps, ADD: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < hidden
    x = tl.load(x_ptr + token * hidden + columns, mask=mask, other=0.0)
    if ADD:  # the stream's sum, rounded to its dtype as PyTorch's add is
        x = (x + tl.load(stream_ptr + token * hidden + columns, mask=mask, other=0.0)).to(x.dtype)
        tl.store(stream_ptr + token * hidden + columns, x, mask=mask)
    wide = x.to(tl.float32)
    normed = (wide * tl.rsqrt(tl.sum(wide * wide, 0) / hidden + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + columns, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + token * hidden + columns, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer_ops.add_rms_norm`` (``x`` and the residual contiguous)."""
    x = x.contiguous()
    stream = x if residual is None else residual
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    _add_rms_norm_kernel[(x.numel() // hidden,)](
        x,
        stream,
        out,
        weight,
        hidden,
        eps,
        ADD=residual is not None,
        BLOCK=triton.next_power_of_2(hidden),
    )
    return out, stream


@triton.jit
def _norm_and_turn(
    x_ptr,
    weight_ptr,
    cos_lo,
    cos_hi,
    sin_lo,
    sin_hi,
    heads,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
):
    """One token's heads (rows of the tile) normalized and turned, in place."""
    lo_at = heads[:, None] * HEAD_DIM + tl.arange(0, HALF)[None, :]
    mask = (heads[:, None] >= 0) & (tl.arange(0, HALF)[None, :] < HEAD_DIM // 2)
    lo = tl.load(x_ptr + lo_at, mask=mask, other=0.0)
    hi = tl.load(x_ptr + lo_at + HEAD_DIM // 2, mask=mask, other=0.0)
    dtype = lo.dtype
    lo, hi = lo.to(tl.float32), hi.to(tl.float32)
    if NORM:
        inverse = tl.rsqrt((tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)) / HEAD_DIM + eps)[:, None]
        half = tl.arange(0, HALF)
        in_half = half < HEAD_DIM // 2
        w_lo = tl.load(weight_ptr + half, mask=in_half, other=0.0).to(tl.float32)
        w_hi = tl.load(weight_ptr + half + HEAD_DIM // 2, mask=in_half, other=0.0).to(tl.float32)
        lo = (lo * inverse).to(dtype).to(tl.float32) * w_lo[None, :]
        hi = (hi * inverse).to(dtype).to(tl.float32) * w_hi[None, :]
    turned_lo = lo * cos_lo[None, :] + hi * sin_lo[None, :]
    turned_hi = hi * cos_hi[None, :] + lo * sin_hi[None, :]
    tl.store(x_ptr + lo_at, turned_lo.to(dtype), mask=mask)
    tl.store(x_ptr + lo_at + HEAD_DIM // 2, turned_hi.to(dtype), mask=mask)


@triton.jit
def _qk_norm_rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    q_stride,
    k_stride,
    q_heads,
    k_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HEADS: tl.constexpr,
    NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    half = tl.arange(0, HALF)
    in_half = half < HEAD_DIM // 2
    row = position * HEAD_DIM
    cos_lo = tl.load(cos_ptr + row + half, mask=in_half, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + row + HEAD_DIM // 2 + half, mask=in_half, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + row + half, mask=in_half, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + row + HEAD_DIM // 2 + half, mask=in_half, other=0.0).to(tl.float32)
    heads = tl.arange(0, HEADS)
    q_heads_here = tl.where(heads < q_heads, heads, -1)
    k_heads_here = tl.where(heads < k_heads, heads, -1)
    _norm_and_turn(
        q_ptr + token * q_stride,
        q_weight_ptr,
        cos_lo,
        cos_hi,
        sin_lo,
        sin_hi,
        q_heads_here,
        eps,
        HEAD_DIM,
        HALF,
        NORM,
    )
    _norm_and_turn(
        k_ptr + token * k_stride,
        k_weight_ptr,
        cos_lo,
        cos_hi,
        sin_lo,
        sin_hi,
        k_heads_here,
        eps,
        HEAD_DIM,
        HALF,
        NORM,
    )


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> None:
    """``layer_ops.qk_norm_rotary`` (each token's heads contiguous in ``q`` and ``k``)."""
    tokens, q_heads, head_dim = q.shape
    if q.stride()[1:] != (head_dim, 1) or k.stride()[1:] != (head_dim, 1):
        raise ValueError("qk_norm_rotary: each token's heads must lie one after another")
    norm = q_weight is not None
    _qk_norm_rotary_kernel[(tokens,)](
        q,
        k,
        positions,
        cos.contiguous(),
        signed_sin.contiguous(),
        q_weight if norm else q,
        k_weight if norm else k,
        q.stride(0),
        k.stride(0),
        q_heads,
        k.shape[1],
        eps,
        HEAD_DIM=head_dim,
        HALF=triton.next_power_of_2(head_dim // 2),
        HEADS=triton.next_power_of_2(max(q_heads, k.shape[1])),
        NORM=norm,
    )


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, x_stride, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < width
    gate = tl.load(x_ptr + token * x_stride + columns, mask=mask, other=0.0)
    up = tl.load(x_ptr + token * x_stride + width + columns, mask=mask, other=0.0)
    wide = gate.to(tl.float32)
    activated = (wide * tl.sigmoid(wide)).to(gate.dtype)  # PyTorch's silu rounds here
    out = activated.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + token * width + columns, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``layer_ops.silu_and_mul`` for ``x`` ``[tokens, 2 * width]``."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    width = x.shape[-1] // 2
    out = x.new_empty(x.shape[0], width)
    block = min(1024, triton.next_power_of_2(max(width, 1)))
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(width, block))](
        x, out, width, x.stride(0), BLOCK=block
    )
    return out
