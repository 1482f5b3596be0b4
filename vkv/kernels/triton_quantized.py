"""The dequantizing load of the Triton paged-attention kernels (Phase 3, part 3.8, graded).

``triton_attention.py``'s kernels read the KV cache one tile at a time: a tile is ``BLOCK_N``
cached tokens of one KV head, gathered through the block table, and its keys and values go
straight into ``tl.dot``. For a 16-bit cache the tile is loaded as stored. For a quantized cache
(``QuantizedCache``, the planes of ``quantized.py``) every tile comes through
``load_dequantized``: it loads the tile's codes, scales and zeros and returns ``codes · scale +
zero`` in float32, in registers, as two half tiles. The dequantized values never exist in
memory: the kernel reads 1 byte per value (INT8) or half a byte (INT4) plus the scales, which
is why a quantized cache can be faster to read on a GPU, not only smaller.

The kernel works on a head's channels in two halves, ``0 .. HEAD_DIM/2 - 1`` and ``HEAD_DIM/2
.. HEAD_DIM - 1``: its query, its keys and values and its output are each two tiles of
``BLOCK_D / 2`` lanes, and each dot product is two half-width ones. So your load returns a
tile as its two halves, and nothing has to be put back in channel order: INT4 packs by halves
(``pack_int4``), so a byte's low nibble belongs to the first half and its high nibble to the
second, at the same lane.

What the kernel has done before it calls you (you receive these; all offsets are in elements of
the plane they index, bytes for the codes plane, and each plane's strides are already applied):

- ``rows_at [BLOCK_N]`` (int64): where each token's codes for this KV head start in the codes
  plane. INT8: byte ``rows_at[t] + i`` holds channel ``i``. INT4: byte ``rows_at[t] + j``
  holds channel ``j`` in its low nibble and channel ``HEAD_DIM/2 + j`` in its high nibble.
- ``scales_at [BLOCK_N]`` (int64): where each token's scale is in the scale plane, and its zero
  at the same offset of the zero plane. Per token (``PER_CHANNEL`` false) one scale and one zero
  serve the token's whole row; keys per channel (``PER_CHANNEL`` true) have one per channel,
  ``scales_at[t] + i`` for channel ``i``. A tile may span several blocks: tokens of different
  blocks have different ``scales_at``.
- ``dims [BLOCK_D / 2]``: the lanes ``0 .. BLOCK_D/2 - 1`` of a half; lane ``j`` is channel
  ``j`` in the first half and channel ``HEAD_DIM/2 + j`` in the second. ``BLOCK_D`` is
  ``head_dim`` rounded up to a power of two (at least 32), so lanes at and past ``HEAD_DIM/2``
  are padding.
- ``mask [BLOCK_N, BLOCK_D / 2]``: the lanes that are real, in both halves: a token the kernel
  reads (inside its sequence's context, and not one it takes from elsewhere, e.g. keys in the
  residual) and a lane below ``HEAD_DIM/2``. A row of it is all true or all false on the real
  lanes, so a token is real when any of its lanes is. A masked token's block is whatever the
  kernel's masked table load gave (block 0): its slots may be another sequence's or hold
  anything.
- ``HEAD_DIM`` (``tl.constexpr``): ``head_dim``, even.

The contract:

- return ``(first, second)``, two ``[BLOCK_N, BLOCK_D / 2]`` float32 tiles: ``first[t, j]``
  is channel ``j`` and ``second[t, j]`` channel ``HEAD_DIM/2 + j`` of token ``t``;
- a channel's value is ``code · scale + zero``, computed in float32 (the scale and zero
  converted before the multiply-add), with the token's scale and zero (per token) or the
  channel's (per channel), on every lane of ``mask``;
- every masked lane is ``0.0`` in both halves, and the load touches no memory for it (on a GPU
  an unmasked load past a plane's end is an illegal access; in the kernel a masked value's lane
  still meets a zero weight, and ``0 · NaN`` is NaN);
- ``BITS`` is 8 or 4 and ``PER_CHANNEL`` a bool, both ``tl.constexpr``: branch on them with a
  plain ``if`` (Triton compiles only the branch taken).

How fast the load runs on a GPU depends on how it reads (each byte once, in wide loads of
consecutive addresses: the handout's cost model); the tests check what it returns and what it
reads, never its time.

A Triton function body is traced, not run line by line: use ``tl.load`` with ``mask`` and
``other``, tensor arithmetic, broadcasting with ``[:, None]`` / ``[None, :]``, ``tl.where`` and
``x.to(tl.float32)``; no Python loops over lanes, no ``.item()``. The names this part's
allowlist adds (``assignment/parts.toml``): ``load``, ``to``, ``where``, ``max``, ``min``,
``maximum``, ``minimum``, ``sum``, ``full``, ``zeros``, ``zeros_like``, ``arange``,
``broadcast_to``, ``reshape``, ``expand_dims``, ``static_assert``, ``interleave``, ``join``,
``split``, the dtypes and ``x.shape`` (``mask.shape[1]`` is ``BLOCK_D / 2``). A jit function
returns two tiles as a tuple: ``return first, second``. Under
``TRITON_INTERPRET=1`` (set by the tests on a CPU) the same code runs as NumPy, so a ``print``
in it works there.
"""

import triton
import triton.language as tl


@triton.jit
def load_dequantized(
    codes_ptr,
    scale_ptr,
    zero_ptr,
    rows_at,
    scales_at,
    dims,
    mask,
    BITS: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """A tile's values as two halves ``[BLOCK_N, BLOCK_D / 2]`` (float32): channels ``j`` and
    ``HEAD_DIM/2 + j`` at lane ``j``, codes times scale plus zero on the lanes of ``mask``, 0.0
    elsewhere (see the module docstring for the layouts)."""
    ### BEGIN SOLUTION part3.8
    tokens = tl.max(mask.to(tl.int32), 1) > 0  # the real tokens
    at = rows_at[:, None] + dims[None, :]
    if BITS == 8:
        first = tl.load(codes_ptr + at, mask=mask, other=0)
        second = tl.load(codes_ptr + at + HEAD_DIM // 2, mask=mask, other=0)
    else:  # each byte loaded once: the first half in its low nibble, the second in its high one
        packed = tl.load(codes_ptr + at, mask=mask, other=0)
        first, second = packed & 0xF, packed >> 4
    if PER_CHANNEL:
        at = scales_at[:, None] + dims[None, :]
        first_scale = tl.load(scale_ptr + at, mask=mask, other=0.0).to(tl.float32)
        first_zero = tl.load(zero_ptr + at, mask=mask, other=0.0).to(tl.float32)
        at += HEAD_DIM // 2
        second_scale = tl.load(scale_ptr + at, mask=mask, other=0.0).to(tl.float32)
        second_zero = tl.load(zero_ptr + at, mask=mask, other=0.0).to(tl.float32)
        return (
            first.to(tl.float32) * first_scale + first_zero,
            second.to(tl.float32) * second_scale + second_zero,
        )
    scale = tl.load(scale_ptr + scales_at, mask=tokens, other=0.0).to(tl.float32)[:, None]
    zero = tl.load(zero_ptr + scales_at, mask=tokens, other=0.0).to(tl.float32)[:, None]
    first, second = first.to(tl.float32) * scale + zero, second.to(tl.float32) * scale + zero
    if mask.shape[1] == HEAD_DIM // 2:  # no padding lanes: a masked token is 0 * 0 + 0 already
        return first, second
    return tl.where(mask, first, 0.0), tl.where(mask, second, 0.0)
    ### END SOLUTION
