"""Symmetric block quantization: int8 values, or int4 packed two to a byte, one scale a block.

ZeRO++ (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant
Model Training", §3.1 and §3.3) moves weights as block-quantized int8 (qwZ) and gradients as
block-quantized int4 (qgZ). Here an array is flattened, zero-padded to whole blocks of `block`
elements, and each block gets an fp32 scale `max|x| / qmax` (`qmax` = 127 for int8, 7 for
int4); the values are `round(x / scale)` (round to nearest even), so a dequantized element is
within `scale / 2` of the original. An all-zero block has scale 0 and quantizes to zeros.

int4 values lie in [-7, 7] and are stored offset by 8 (in [1, 15]), two to a `uint8`: element
`2i` in the low nibble, `2i + 1` in the high one (`block` must be even).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

#: The default block: elements sharing one scale (DeepSpeed's qwZ uses 2048-element groups;
#: smaller blocks bound the error tighter for 4/256 = 1.6% more bytes at int8).
BLOCK = 256
#: Largest quantized magnitude per bit width.
QMAX = {8: 127, 4: 7}


class Quantized(NamedTuple):
    """A block-quantized array.

    Attributes:
      values: int8 `[blocks, block]` (8 bits), or uint8 `[blocks, block / 2]` (4 bits, packed).
      scales: float32 `[blocks]`.
    """

    values: jax.Array
    scales: jax.Array


def num_blocks(size: int, block: int = BLOCK) -> int:
    """Blocks of `block` elements that hold `size` elements (the last one zero-padded)."""
    return max(1, math.ceil(size / block))


def quantized_bytes(size: int, *, bits: int, block: int = BLOCK) -> int:
    """Bytes of `size` elements block-quantized: the values plus one fp32 scale per block."""
    blocks = num_blocks(size, block)
    return blocks * block * bits // 8 + 4 * blocks


def _check(bits: int, block: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"quantize: bits must be 4 or 8, got {bits!r}")
    if block < 2 or block % 2:
        raise ValueError(f"quantize: block must be an even number >= 2, got {block!r}")


def quantize(x: jax.Array, *, bits: int = 8, block: int = BLOCK) -> Quantized:
    """Block-quantizes `x` (any shape, floating) to `bits` bits.

    Args:
      x: the array; it is flattened and zero-padded to a whole number of blocks.
      bits: 8 (int8) or 4 (int4, packed two to a uint8).
      block: elements per scale.

    Returns:
      `Quantized` with `num_blocks(x.size, block)` blocks.
    """
    _check(bits, block)
    flat = x.reshape(-1).astype(jnp.float32)
    blocks = num_blocks(flat.size, block)
    flat = jnp.pad(flat, (0, blocks * block - flat.size)).reshape(blocks, block)
    qmax = QMAX[bits]
    scales = jnp.max(jnp.abs(flat), axis=1) / qmax
    safe = jnp.where(scales > 0, scales, 1.0)
    q = jnp.clip(jnp.round(flat / safe[:, None]), -qmax, qmax).astype(jnp.int8)
    if bits == 4:
        offset = (q + 8).astype(jnp.uint8).reshape(blocks, block // 2, 2)
        q = offset[..., 0] | (offset[..., 1] << 4)
    return Quantized(q, scales)


def dequantize(q: Quantized, shape, dtype, *, bits: int = 8) -> jax.Array:
    """The array `quantize` was given, to within half a scale per element.

    Args:
      q: from `quantize`, with any leading dims before `[blocks, ...]` kept (e.g. a gathered
        `[peers, blocks, block]`): each leading index is dequantized to `shape`.
      shape: the original array's shape.
      dtype: the result dtype.
      bits: as given to `quantize`.

    Returns:
      `[*leading, *shape]` in `dtype`.
    """
    values = q.values
    if bits == 4:
        low = (values & 0xF).astype(jnp.int8) - 8
        high = (values >> 4).astype(jnp.int8) - 8
        values = jnp.stack([low, high], axis=-1).reshape(*values.shape[:-1], -1)
    x = values.astype(jnp.float32) * q.scales[..., None]
    lead = x.shape[:-2]
    size = math.prod(shape)
    x = x.reshape(*lead, -1)[..., :size]
    return x.reshape(*lead, *shape).astype(dtype)
