"""A decoder layer's small operations, one call each: the norms with the residual add, the
q/k norm with the rotary turn, and the SwiGLU activation (vLLM's ``fused_add_rms_norm``,
``rotary_embedding`` and ``silu_and_mul``).

Written in PyTorch, each is two to nine calls, each a kernel launch on a GPU or a pass over
memory on a CPU; at a small batch a decode step's time is made of such calls, not of their
arithmetic. The functions here are defined by their PyTorch compositions (``*_reference``, in
this module) and run as one call where they can: a Triton kernel on a GPU
(``triton_layer_ops``), a C loop on a CPU in float32 (``layer_ops.c``, built by
``cpu_library``), the composition itself elsewhere (another dtype on a CPU, no C compiler).

- ``add_rms_norm(x, residual, weight, eps)``: the residual stream gains ``x`` (``residual +=
  x``, in place; with no residual yet, ``x`` is the stream), and its RMSNorm is returned with
  it: ``(rms_norm(residual) * weight, residual)``. RMSNorm is computed in float32 and rounded
  to the input's dtype before the weight multiplies it (Hugging Face's order).
- ``qk_norm_rotary(q, k, positions, cos, signed_sin, q_weight, k_weight, eps)``: in place, each
  head of ``q`` and ``k`` (``[tokens, heads, head_dim]``, views of one projection's rows) is
  normalized by its weight (Qwen3's q/k norm; no weights: Llama) and turned by its token's
  position: ``x * cos + roll(x, head_dim / 2) * signed_sin`` with the rows of ``RotaryTable``.
- ``silu_and_mul(x)``: ``silu(gate) * up`` for ``x = [gate | up]`` along the last dimension.
"""

import torch
from torch.nn import functional

from vkv.kernels import cpu_library


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x) * weight, residual + x)``; the residual is updated in place
    (``x`` itself when ``residual`` is None)."""
    path = _path(x)
    if path == "triton":
        from vkv.kernels import triton_layer_ops

        return triton_layer_ops.add_rms_norm(x, residual, weight, eps)
    stream = x if residual is None else residual
    if path == "torch" or not (x.is_contiguous() and stream.is_contiguous()):
        return add_rms_norm_reference(x, residual, weight, eps)
    if not _float32(stream, weight) or stream.shape != x.shape:
        return add_rms_norm_reference(x, residual, weight, eps)
    out = torch.empty_like(x)
    with cpu_library.labelled("vkv::add_rms_norm"):
        cpu_library.library().vkv_add_rms_norm_f32(
            x.data_ptr(),
            stream.data_ptr(),
            out.data_ptr(),
            weight.data_ptr(),
            x.numel() // x.shape[-1],
            x.shape[-1],
            x.shape[-1],
            residual is not None,
            eps,
        )
    return out, stream


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm``'s definition."""
    stream = x if residual is None else residual.add_(x)
    return functional.rms_norm(stream, (stream.shape[-1],), weight, eps), stream


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
    """Normalize (with weights) and turn each head of ``q`` and ``k`` in place; ``cos`` and
    ``signed_sin`` are ``[positions, head_dim]`` tables indexed by ``positions``."""
    path = _path(q)
    if path == "triton":
        from vkv.kernels import triton_layer_ops

        triton_layer_ops.qk_norm_rotary(q, k, positions, cos, signed_sin, q_weight, k_weight, eps)
        return
    tables = (cos, signed_sin, *(w for w in (q_weight, k_weight) if w is not None))
    plain = positions.dtype != torch.int64 or not positions.is_contiguous()
    if (
        path == "torch"
        or plain
        or not _heads_contiguous(q, k)
        or not _float32(*tables)
        or k.dtype != q.dtype
    ):
        qk_norm_rotary_reference(q, k, positions, cos, signed_sin, q_weight, k_weight, eps)
        return
    tokens, q_heads, head_dim = q.shape
    with cpu_library.labelled("vkv::qk_norm_rotary"):
        status = cpu_library.library().vkv_qk_norm_rotary_f32(
            q.data_ptr(),
            k.data_ptr(),
            positions.data_ptr(),
            cos.data_ptr(),
            signed_sin.data_ptr(),
            None if q_weight is None else q_weight.data_ptr(),
            None if k_weight is None else k_weight.data_ptr(),
            tokens,
            q_heads,
            k.shape[1],
            head_dim,
            q.stride(0),
            k.stride(0),
            len(cos),
            eps,
        )
    if status != 0:
        raise IndexError(f"qk_norm_rotary: a position lies outside the table of {len(cos)} rows")


def qk_norm_rotary_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> None:
    """``qk_norm_rotary``'s definition."""
    rows_cos, rows_sin = cos[positions][:, None], signed_sin[positions][:, None]
    for x, weight in ((q, q_weight), (k, k_weight)):
        normed = x if weight is None else functional.rms_norm(x, (x.shape[-1],), weight, eps)
        x.copy_(normed * rows_cos + normed.roll(x.shape[-1] // 2, -1) * rows_sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` (last dimension), a new tensor."""
    path = _path(x)
    if path == "triton":
        from vkv.kernels import triton_layer_ops

        return triton_layer_ops.silu_and_mul(x)
    if path == "torch" or x.dim() != 2 or x.stride(-1) != 1:
        return silu_and_mul_reference(x)
    width = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], width)
    with cpu_library.labelled("vkv::silu_and_mul"):
        cpu_library.library().vkv_silu_and_mul_f32(
            x.data_ptr(), out.data_ptr(), len(x), width, x.stride(0)
        )
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul``'s definition."""
    gate, up = x.chunk(2, -1)
    return functional.silu(gate) * up


def _path(x: torch.Tensor) -> str:
    """Which implementation runs for ``x``: "triton" on a GPU, "c" on a CPU in float32 where
    the library built, "torch" otherwise."""
    if x.device.type == "cuda":
        return "triton"
    if x.dtype == torch.float32 and x.device.type == "cpu" and cpu_library.library() is not None:
        return "c"
    return "torch"


def _heads_contiguous(*tensors: torch.Tensor) -> bool:
    """Each token's heads lie one after another, each head's values contiguous."""
    return all(t.stride()[1:] == (t.shape[2], 1) for t in tensors)


def _float32(*tensors: torch.Tensor) -> bool:
    """Contiguous float32 tensors on the CPU (what the C loops read)."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and all(
        t.is_contiguous() for t in tensors
    )
