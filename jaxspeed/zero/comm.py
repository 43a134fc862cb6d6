"""The ZeRO collectives themselves, on one buffer: the all-gather of a shard (qwZ: int8
block-quantized) and the reduce-scatter of a gradient (qgZ: all-to-alls of block-quantized
chunks; full precision: in pieces of at most a bucket), inside `shard_map` manual over their
axes. `jaxspeed.zero.collectives` decides what each leaf, or group of leaves, runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspeed.ops import quantize as qz
from jaxspeed.sharding import two_level
from jaxspeed.zero.layout import across_hosts_last


def concat_peers(y: jax.Array, dim: int) -> jax.Array:
    """`[peers, *shard]` → the shards concatenated along `dim` (peer-major)."""
    y = jnp.moveaxis(y, 0, dim)
    shape = list(y.shape)
    shape[dim : dim + 2] = [shape[dim] * shape[dim + 1]]
    return y.reshape(shape)


def as_words(move, x: jax.Array) -> jax.Array:
    """`move(x)` (a collective that only moves values), a 16-bit float moved as its bits:
    XLA:CPU would otherwise hoist the consumer's widening convert above the collective and
    move fp32."""
    if x.dtype.itemsize != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        return move(x)
    words = move(jax.lax.bitcast_convert_type(x, jnp.uint16))
    return jax.lax.bitcast_convert_type(words, x.dtype)


def worth_quantizing(size: int, bits: int, block: int, itemsize: int) -> bool:
    """Whether `size` elements move in fewer bytes block-quantized than as `itemsize`-byte
    values (a shard smaller than a block would move its padding): else they move as they are."""
    return qz.quantized_bytes(size, bits=bits, block=block) < size * itemsize


def all_gather(x: jax.Array, axes: tuple[str, ...], dim: int, *, dtype, quantized: bool = False,
               block: int = qz.BLOCK) -> jax.Array:
    """`x` (this device's shard) in `dtype`, gathered over `axes` along `dim` (tiled).

    With `quantized`, the shard moves as int8 block-quantized values plus fp32 scales and is
    dequantized to `dtype` after the gather (qwZ).
    """
    if not quantized or not worth_quantizing(x.size, 8, block, jnp.dtype(dtype).itemsize):
        return as_words(lambda w: jax.lax.all_gather(w, axes, axis=dim, tiled=True),
                        x.astype(dtype))
    q = qz.quantize(x, bits=8, block=block)
    gathered = qz.Quantized(*(jax.lax.all_gather(a, axes, axis=0) for a in q))
    return concat_peers(qz.dequantize(gathered, x.shape, dtype, bits=8), dim)


def reduce_scatter(g: jax.Array, axes: tuple[str, ...], dim: int, *, bits: int | None = None,
                   block: int = qz.BLOCK, bucket: int | None = None) -> jax.Array:
    """The fp32 sum of `g` over `axes`, this device's block of `dim` kept (`psum_scatter`).

    With `bucket`, a `g` of more elements is reduced in pieces of at most `bucket` elements,
    one `psum_scatter` each, with the same result (`_bucketed_psum_scatter`).

    With `bits` (qgZ), one `all_to_all` per axis, `host` last (inside the host first, then
    across hosts on what is left: a 1/peers-inside-the-host part of `g`): `g` is split into
    one chunk per peer of the axis along its part of `dim` (`dim` is split over `axes`, major
    first), each chunk block-quantized to `bits` and sent to its peer, which dequantizes what
    it receives and sums it in fp32; the next axis works on that sum.
    """
    g = g.astype(jnp.float32)
    if bits is None:
        if bucket is not None and g.size > bucket:
            return _bucketed_psum_scatter(g, axes, dim, bucket)
        return jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
    left = list(axes)
    for axis in across_hosts_last(axes):
        i, shape = left.index(axis), g.shape
        parts = g.reshape(*shape[:dim], *(jax.lax.axis_size(a) for a in left), -1,
                          *shape[dim + 1:])
        g = _quantized_reduce_scatter(parts, axis, dim + i, bits, block).reshape(
            *shape[:dim], -1, *shape[dim + 1:])
        left.remove(axis)
    return g


def _bucketed_psum_scatter(g: jax.Array, axes: tuple[str, ...], dim: int, bucket: int):
    """`psum_scatter(g, axes, dim, tiled=True)` as several reduce-scatters of at most
    `bucket` elements each (`scatter_rows` on `g` as rows, one a peer)."""
    peers = jax.lax.axis_size(axes)
    mine = scatter_rows(rows_of(g, peers, dim), axes, bucket)
    return mine.reshape(shard_shape(g.shape, peers, dim))


def shard_shape(shape: tuple[int, ...], peers: int, dim: int) -> tuple[int, ...]:
    """One peer's block of `shape`, split `peers` ways on `dim`."""
    return (*shape[:dim], shape[dim] // peers, *shape[dim + 1:])


def rows_of(full: jax.Array, peers: int, dim: int) -> jax.Array:
    """`[peers, size / peers]`: row p is peer p's block of `dim`, flattened as the shard is
    (the inverse of `concat_peers` on the rows reshaped to shards)."""
    block = shard_shape(full.shape, peers, dim)
    split = full.reshape(*block[:dim], peers, *block[dim:])
    return jnp.moveaxis(split, dim, 0).reshape(peers, -1)


def scatter_rows(rows: jax.Array, axes: tuple[str, ...], bucket: int | None,
                 hosts: int = 1) -> jax.Array:
    """The fp32 sum over `axes` of row `me` of `rows [peers, width]`, in column pieces of at
    most `bucket` elements of `rows` each (None: one piece), each one reduce-scatter: one
    `psum_scatter`, or two stages over `hosts` (`two_level.reduce_scatter`)."""
    width = rows.shape[1] if bucket is None else max(1, bucket // rows.shape[0])

    def one(piece):
        if hosts > 1:
            return two_level.reduce_scatter(piece, axes[0], hosts=hosts)
        return jax.lax.psum_scatter(piece, axes, scatter_dimension=0, tiled=True)[0]

    pieces = [one(rows[:, start:start + width]) for start in range(0, rows.shape[1], width)]
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)


def _quantized_reduce_scatter(g, axis: str, dim: int, bits: int, block: int):
    peers = jax.lax.axis_size(axis)
    if not worth_quantizing(g.size // peers, bits, block, 4):
        return jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)
    y = jnp.moveaxis(g, dim, 0)
    chunks = y.reshape(peers, y.shape[0] // peers, *y.shape[1:])
    q = jax.vmap(functools.partial(qz.quantize, bits=bits, block=block))(chunks)
    received = qz.Quantized(*(
        jax.lax.all_to_all(a, axis, split_axis=0, concat_axis=0, tiled=True) for a in q))
    summed = qz.dequantize(received, chunks.shape[1:], jnp.float32, bits=bits).sum(axis=0)
    return jnp.moveaxis(summed, 0, dim)
