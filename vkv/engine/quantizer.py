"""Quantizer: INT8 and INT4 KV-cache quantization, asymmetric min/max (Phase 3, graded).

A tensor of keys or values is cut into *groups*; each group keeps two floats, its ``scale`` and
its ``zero`` (the group's minimum), and each element one small integer code:

    scale = (max - min) / (2**bits - 1)
    code  = clamp(round((x - min) / scale), 0, 2**bits - 1)
    x    ~= code * scale + min                                   (dequantize)

The *granularity* says which elements share a group:

- ``per_token`` (LMDeploy's, for keys and values): the last dimension, one token's channels of
  one head. ``x [..., head_dim]`` gives ``scale`` and ``zero`` of shape ``[..., 1]``.
- ``per_channel`` (KIVI's, for keys): the first dimension, the tokens of one block, for each
  (head, channel). ``x [tokens, ..., head_dim]`` gives ``scale`` and ``zero`` of shape
  ``[1, ..., head_dim]``. Keys have outlier channels (a few channels much larger than the
  rest); grouping along a channel keeps an outlier from stretching every other channel's grid.

Invariants:

- every code lies in ``[0, 2**bits - 1]``, and ``|x - dequantize(quantize(x))| <= scale / 2``
  for every element, with the ``scale`` of its group (rounding to the nearest code moves a value
  by at most half a step; the clamp only removes floating-point error at the ends);
- a group whose maximum equals its minimum (a constant vector) has ``scale == 0`` and
  dequantizes exactly to its constant: nothing divides by zero, nothing becomes NaN;
- INT4 codes are packed two per byte along the last dimension, by halves (LMDeploy's order): of
  ``2n`` codes, byte ``i`` holds code ``i`` in its low nibble (bits 0-3) and code ``n + i`` in
  its high nibble (bits 4-7); INT8 codes are one per byte. Codes are ``torch.uint8``; scales
  and zeros ``torch.float32``.

Bad input raises ``ValueError`` and computes nothing: ``bits`` other than 4 or 8, an unknown
granularity, a tensor that is not floating point, is empty, or holds NaN or an infinity, a
last dimension that is odd for INT4 (no byte would hold its last code alone).

``bytes_per_token`` says what one token costs in a KV cache of each format, scales counted:
what decides how many blocks a byte budget holds.
"""

from dataclasses import dataclass

import torch

from vkv.config import GRANULARITIES


@dataclass(slots=True, frozen=True)
class QuantizedTensor:
    """Codes (uint8; INT4: two per byte along the last dimension), and one float32 ``scale``
    and ``zero`` per group, shaped to broadcast against the unpacked codes. INT4 packs each run
    of ``head_dim`` codes of the last dimension on its own (None: the whole last dimension)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    head_dim: int | None = None


class Quantizer:
    """Quantize and dequantize float tensors with ``bits`` (8 or 4) per element."""

    def __init__(self, bits: int = 8, granularity: str = "per_token") -> None:
        """Raise ``ValueError`` for ``bits`` other than the integers 4 and 8 ("bits must be 4
        or 8, got 3"; ``8.0`` and ``True`` are not integers) or a granularity not in
        ``GRANULARITIES`` ("granularity must be one of per_token, per_channel, got
        'per_block'")."""
        ### BEGIN SOLUTION part3.1
        if not isinstance(bits, int) or isinstance(bits, bool) or bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits!r}")
        if granularity not in GRANULARITIES:
            raise ValueError(
                f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}"
            )
        self.bits = bits
        self.granularity = granularity
        ### END SOLUTION

    @property
    def max_code(self) -> int:
        return (1 << self.bits) - 1

    def quantize(self, x: torch.Tensor, head_dim: int | None = None) -> QuantizedTensor:
        """Codes, scales and zeros of ``x`` (given: checks, groups by granularity, packs INT4).

        INT4 packs each head's ``head_dim`` codes on their own, by halves; by default the last
        dimension is one head. A group over several heads (one scale for all of a token's heads)
        passes ``head_dim``: the kernels read a head's bytes at a time."""
        self._check(x)
        x = x.float()
        low, high = _token_range(x) if self.granularity == "per_token" else _channel_range(x)
        scale, codes = self._encode(x, low, high)
        if self.bits == 4:
            heads = codes.unflatten(-1, (-1, head_dim or codes.shape[-1]))
            codes = pack_int4(heads).flatten(-2)
        return QuantizedTensor(codes, scale, low, self.bits, head_dim)

    def dequantize(self, quantized: QuantizedTensor) -> torch.Tensor:
        """The float32 tensor the codes stand for (given: unpacks INT4 a head at a time, then
        decodes)."""
        codes = quantized.codes
        if quantized.bits == 4:
            packed_width = (quantized.head_dim or 2 * codes.shape[-1]) // 2
            codes = unpack_int4(codes.unflatten(-1, (-1, packed_width))).flatten(-2)
        return _decode(codes, quantized.scale, quantized.zero)

    def _check(self, x: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``x`` is a floating-point tensor ("only a floating-point
        tensor can be quantized"), with at least one dimension and one element ("cannot
        quantize an empty tensor or a scalar"), of finite values ("cannot quantize NaN or
        infinite values"), with an even last dimension for INT4 ("INT4 packs two codes per
        byte: the last dimension must be even, got 5"). Checked in this order."""
        ### BEGIN SOLUTION part3.1
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError("only a floating-point tensor can be quantized")
        if x.numel() == 0 or x.dim() == 0:
            raise ValueError("cannot quantize an empty tensor or a scalar")
        if not bool(torch.isfinite(x).all()):
            raise ValueError("cannot quantize NaN or infinite values")
        if self.bits == 4 and x.shape[-1] % 2:
            raise ValueError(
                f"INT4 packs two codes per byte: the last dimension must be even, got {x.shape[-1]}"
            )
        ### END SOLUTION

    def _encode(
        self, x: torch.Tensor, low: torch.Tensor, high: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The groups' scales and the codes (uint8, unpacked) of ``x`` for the groups' ranges.

        A group with ``high == low`` gets scale 0 and codes 0.
        """
        ### BEGIN SOLUTION part3.1
        scale = (high - low) / self.max_code
        step = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round((x - low) / step).clamp(0, self.max_code)
        return scale, codes.to(torch.uint8)
        ### END SOLUTION


def _token_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's minimum and maximum, per token: over the last dimension, kept as 1."""
    ### BEGIN SOLUTION part3.1
    return x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    ### END SOLUTION


def _decode(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``codes * scale + zero`` in float32: the values the codes stand for."""
    ### BEGIN SOLUTION part3.1
    return codes.float() * scale + zero
    ### END SOLUTION


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dimension, by halves: ``[..., 2n]`` uint8 codes
    in ``[0, 15]`` become ``[..., n]`` bytes, code ``i`` of the first half in the low nibble of
    byte ``i`` and code ``n + i`` of the second half in its high nibble. Raise ``ValueError``
    for an odd last dimension ("pack_int4 needs an even last dimension, got 3") or a code above
    15 ("a 4-bit code is at most 15")."""
    ### BEGIN SOLUTION part3.2
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even last dimension, got {codes.shape[-1]}")
    if bool((codes > 15).any()):
        raise ValueError("a 4-bit code is at most 15")
    first, second = codes.chunk(2, dim=-1)
    return (first | (second << 4)).to(torch.uint8)
    ### END SOLUTION


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4``: ``[..., n]`` bytes become ``[..., 2n]`` uint8 codes, the
    low nibbles first, then the high ones."""
    ### BEGIN SOLUTION part3.2
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)
    ### END SOLUTION


def _channel_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's minimum and maximum, per channel: over the first dimension (the block's
    tokens), kept as 1, for every head and channel."""
    ### BEGIN SOLUTION part3.3
    return x.amin(dim=0, keepdim=True), x.amax(dim=0, keepdim=True)
    ### END SOLUTION


def bytes_per_token(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache_dtype: str,
    key_granularity: str = "per_token",
    block_size: int = 16,
    scale_bytes: int = 2,
) -> float:
    """What one token costs in a KV cache, every layer, keys and values, scales counted.

    ``kv_cache_dtype``: ``"auto"`` (16-bit values, no scales), ``"int8"`` or ``"int4"``. A
    quantized token stores ``head_dim * bits / 8`` bytes of codes per head for its keys and as
    many for its values, and a scale and a zero of ``scale_bytes`` each per group: values (and
    keys per token) have one group per token and head; keys per channel have ``head_dim``
    groups per block and head, shared by the block's ``block_size`` tokens. Raise
    ``ValueError`` for an unknown dtype ("kv_cache_dtype must be auto, int8 or int4, got
    'fp8'") or granularity ("unknown key granularity 'per_block'").
    """
    ### BEGIN SOLUTION part3.4
    if kv_cache_dtype == "auto":
        return 2 * num_layers * num_kv_heads * head_dim * 2
    bits = {"int8": 8, "int4": 4}.get(kv_cache_dtype)
    if bits is None:
        raise ValueError(f"kv_cache_dtype must be auto, int8 or int4, got {kv_cache_dtype!r}")
    if key_granularity not in GRANULARITIES:
        raise ValueError(f"unknown key granularity {key_granularity!r}")
    codes = head_dim * bits / 8
    value_scales = 2 * scale_bytes
    key_scales = value_scales
    if key_granularity == "per_channel":
        key_scales = value_scales * head_dim / block_size
    return num_layers * num_kv_heads * (2 * codes + value_scales + key_scales)
    ### END SOLUTION
