"""The dequantizing load of the Triton paged-attention kernels (Phase 3, part 3.8, graded).

``triton_attention.py``'s kernels read the KV cache one tile at a time: a tile is ``BLOCK_N``
cached tokens of one KV head, gathered through the block table, and its keys and values go
straight into ``tl.dot``. For a 16-bit cache the tile is loaded as stored. For a quantized cache
(``QuantizedCache``, the planes of ``quantized.py``) every tile comes through
``load_dequantized``: it loads the tile's codes, scales and zeros and returns ``codes · scale +
zero`` in float32, in registers. The dequantized values never exist in memory: the kernel reads
1 byte per value (INT8) or half a byte (INT4) plus the scales, which is why a quantized cache is
faster to read on a GPU, not only smaller.

What the kernel has done before it calls you (you receive these; all offsets are in elements of
the plane they index, bytes for the codes plane, and each plane's strides are already applied):

- ``rows_at [BLOCK_N]`` (int64): where each token's codes for this KV head start in the codes
  plane: byte ``rows_at[t] + i`` holds code ``i`` (INT8) and byte ``rows_at[t] + i // 2`` holds
  code ``i`` in its low nibble if ``i`` is even, in its high nibble if odd (INT4,
  ``pack_int4``'s order).
- ``scales_at [BLOCK_N]`` (int64): where each token's scale is in the scale plane, and its zero
  at the same offset of the zero plane. Per token (``PER_CHANNEL`` false) one scale and one zero
  serve the token's whole row; keys per channel (``PER_CHANNEL`` true) have one per channel,
  ``scales_at[t] + i`` for channel ``i``. A tile may span several blocks: tokens of different
  blocks have different ``scales_at``.
- ``dims [BLOCK_D]``: the channels ``0 .. BLOCK_D - 1``; ``BLOCK_D`` is ``head_dim`` rounded up
  to a power of two (at least 16), so lanes at and past ``head_dim`` are padding.
- ``mask [BLOCK_N, BLOCK_D]``: the lanes that are real: a token inside its sequence's context
  and a channel below ``head_dim`` (so a token is real when any of its lanes is). A masked
  token's block is whatever the kernel's masked table load gave (block 0): its slots may be
  another sequence's or hold anything.
- ``HEAD_DIM`` (``tl.constexpr``): ``head_dim``. ``mask`` is the tokens to read (a row of it
  is all true or all false on the real channels; the kernel may leave out more tokens than
  those past the context, e.g. keys it reads from the residual instead) and the channels
  ``dims < HEAD_DIM``. For a mask of your own (INT4's bytes), take the tokens from ``mask``
  (any lane of a row: a reduction over a row is constant along it) and the channels from
  ``HEAD_DIM`` (``half < HEAD_DIM // 2``): the compiler can prove such a mask constant over 16
  lanes and then loads 16 bytes at once; a channel mask reduced from ``mask`` it cannot, and
  the tile is loaded a byte at a time (``scripts/compile_for_gpu.py --anatomy`` shows which
  you got).

The contract:

- ``result[t, i] = code(t, i) · scale + zero``, computed in float32 (the scale and zero
  converted before the multiply-add), for every lane of ``mask``, with the token's scale and
  zero (per token) or the channel's (per channel);
- every masked lane is ``0.0``, and the load touches no memory for it (on a GPU an unmasked
  load past a plane's end is an illegal access; in the kernel a masked value's lane still meets
  a zero weight, and ``0 · NaN`` is NaN);
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
``split``, the dtypes and ``x.shape`` (``mask.shape[1]`` is ``BLOCK_D``). Under
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
    """A tile's values ``[BLOCK_N, BLOCK_D]`` (float32): codes times scale plus zero on the
    lanes of ``mask``, 0.0 elsewhere (see the module docstring for the layouts)."""
    ### BEGIN SOLUTION part3.8
    lanes = rows_at[:, None]
    row_mask = tl.max(mask.to(tl.int32), 1) > 0  # the real tokens
    if BITS == 8:
        codes = tl.load(codes_ptr + lanes + dims[None, :], mask=mask, other=0).to(tl.int32)
    else:  # each byte loaded once, [tokens, BLOCK_D / 2]: its nibbles split, then interleaved
        half = tl.arange(0, mask.shape[1] // 2)
        pairs = row_mask[:, None] & (half < HEAD_DIM // 2)[None, :]  # provably 16 bytes at once
        packed = tl.load(codes_ptr + lanes + half[None, :], mask=pairs, other=0).to(tl.int32)
        codes = tl.interleave(packed & 0xF, packed >> 4)
    if PER_CHANNEL:
        at = scales_at[:, None] + dims[None, :]
        scale = tl.load(scale_ptr + at, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + at, mask=mask, other=0.0).to(tl.float32)
        return codes.to(tl.float32) * scale + zero
    scale = tl.load(scale_ptr + scales_at, mask=row_mask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + scales_at, mask=row_mask, other=0.0).to(tl.float32)
    return tl.where(mask, codes.to(tl.float32) * scale[:, None] + zero[:, None], 0.0)
    ### END SOLUTION
